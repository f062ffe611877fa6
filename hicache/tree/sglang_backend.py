"""The project's tree as an SGLang 0.5.23 radix-cache backend (``--radix-cache-backend
hicache_prefill``): :func:`register` puts :func:`build_backend` in SGLang's registry, which builds
``HiRadixCache`` (or the device-only ``RadixCache``) over SGLang's device pool and allocator and
wraps it in :class:`HiRadixCacheBackend`, a ``BasePrefixCache`` answering SGLang's calls with its
parameter and result objects; under ``--hicache-storage-backend file|mooncake`` the tree's L3 tier
(``HiCacheStorageController``) serves the scheduler's storage calls. Needs SGLang importable.
Ownership follows SGLang's ruler: a request owns ``row[cache_protected_len:]``, the tree owns
``row[:cache_protected_len]``, which the request holds with ``req.lock``."""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import torch
from sglang.srt.mem_cache.base_prefix_cache import (
    BasePrefixCache,
    CacheRequestHandle,
    CacheRequestOutcome,
    DecLockRefParams,
    DecLockRefResult,
    EvictParams,
    EvictResult,
    IncLockRefResult,
    InitLoadBackParams,
    MatchPrefixParams,
    MatchResult,
)
from sglang.srt.mem_cache.registry import (
    TreeCacheBuildContext,
    register_radix_cache_backend,
    registered_radix_cache_backends,
)

from hicache_prefill.hicache.storage.io.workers import CacheRequestHandle as AttemptHandle
from hicache_prefill.hicache.tree.hiradix_cache import HiRadixCache
from hicache_prefill.hicache.tree.node import TreeNode
from hicache_prefill.hicache.tree.radix_cache import RadixCache
from hicache_prefill.hicache.tree.sglang_allocator import SGLangAllocatorView
from hicache_prefill.hicache.tree.sglang_backend_config import (
    BACKEND_NAME,
    StorageArgs,
    backend_options,
    refusals,
)

if TYPE_CHECKING:
    from sglang.srt.managers.schedule_batch import Req
    from sglang.srt.mem_cache.cache_init_params import CacheInitParams

    from hicache_prefill.hicache.memory.host_pool import HostKVPool
    from hicache_prefill.hicache.storage.io.controller import HiCacheStorageController
    from hicache_prefill.hicache.transfer.streams import Delay, Streams

logger = logging.getLogger(__name__)

STORAGE_DRAIN_S = 60.0
"""How long ``reset`` waits for the L3 operations in flight to finish."""


def attempt(handle: CacheRequestHandle) -> AttemptHandle:
    """The storage tier's handle of SGLang's ``CacheRequestHandle`` (one attempt of one rid)."""
    return AttemptHandle(handle.rid, handle.attempt_id)


class HiRadixCacheBackend(BasePrefixCache):
    """SGLang's ``BasePrefixCache`` over the project's ``tree``. ``cache_controller`` is the
    tree's ``HiCacheController`` (``None`` device only); ``storage`` its L3 tier (``None``
    without ``--hicache-storage-backend``); nodes are the tree's ``TreeNode``."""

    def __init__(
        self,
        params: CacheInitParams,
        tree: RadixCache | HiRadixCache,
        host_pool: HostKVPool | None = None,
        storage: HiCacheStorageController | None = None,
    ) -> None:
        self.req_to_token_pool = params.req_to_token_pool
        self.token_to_kv_pool_allocator = params.token_to_kv_pool_allocator
        self.page_size = params.page_size
        self.disable = False
        self.sliding_window_size = None
        self.tree = tree
        self.host_pool = host_pool
        self.cache_controller = getattr(tree, "controller", None)
        self.storage = storage
        self.enable_storage = storage is not None
        self.hicache_storage_pass_prefix_keys = (
            storage is not None and storage.settings.pass_prefix_keys
        )
        self.prefetch_threshold = storage.settings.prefetch_threshold if storage else 0
        if params.enable_metrics:
            self.init_metrics_collector()

    # ------------------------------------------------------------------ the tree's shape
    @property
    def root_node(self) -> TreeNode:
        return self.tree.root_node

    def is_root(self, node: TreeNode) -> bool:
        return node is self.tree.root_node

    def is_backuped(self, node: TreeNode) -> bool:
        return node.backuped

    def get_last_hash_value(self, node: TreeNode) -> str | None:
        """The L3 key of ``node``'s last page (``None``: the root, or no storage tier)."""
        return node.hash_value[-1] if node.hash_value else None

    def get_prefix_hash_values(self, node: TreeNode) -> list[str]:
        """The L3 keys of every page from the root to ``node``, in order."""
        parts = []
        x: TreeNode | None = node
        while x is not None and x is not self.tree.root_node:
            parts.append(x.hash_value or [])
            x = x.parent
        return [k for part in reversed(parts) for k in part]

    def supports_prefix_sharing(self) -> bool:
        return True

    @property
    def ongoing_write_through(self) -> dict[int, TreeNode]:
        """Nodes whose D2H backup is not acked yet (by node id)."""
        return getattr(self.tree, "ongoing_write_through", {})

    @property
    def ongoing_load_back(self) -> dict[int, TreeNode]:
        """Last nodes of H2D loads not acked yet (by node id)."""
        return getattr(self.tree, "ongoing_load_back", {})

    def reset(self) -> None:
        """Forget every node, after the copies in flight finish (SGLang calls it on a drained
        scheduler and clears its own device allocator next); the host pool is emptied."""
        tree = self.tree
        if isinstance(tree, HiRadixCache):
            c = tree.controller
            if c.load_queue:
                tree.cancel_load_back()  # loads never started: no request waits for them
            c.write_stream.synchronize()
            c.load_stream.synchronize()
            tree.check_hicache_events()
            if tree.ongoing_write_through or tree.ongoing_load_back:
                raise RuntimeError("reset: copies still unacked after their streams finished")
            if self.storage is not None:
                self._drain_storage()
            c.host_allocator.clear()
        tree.reset()

    def _drain_storage(self) -> None:
        """Release every prefetch, then apply the L3 operations' results until none is in
        flight (their acks free host slots the reset is about to clear)."""
        book = self.storage.prefetches
        for handle in {*book.ongoing, *book.staged, *book.loaded}:
            self.storage.release(handle)
        deadline = time.monotonic() + STORAGE_DRAIN_S
        while self.storage.ops_in_flight():
            if time.monotonic() > deadline:
                raise RuntimeError(
                    f"reset: {self.storage.ops_in_flight()} storage operations still in flight"
                )
            self.storage.check_events()
            time.sleep(0.001)

    # ------------------------------------------------------------------ match and lock
    def match_prefix(self, params: MatchPrefixParams) -> MatchResult:
        """The longest cached prefix of ``params.key`` (cut at its ``limit``) in whole pages.
        A key with an ``extra_key`` or ``cache_salt`` (LoRA, salted requests) is a miss: the
        tree has one namespace, so such requests never share a prefix."""
        key = params.key
        root = self.tree.root_node
        miss = MatchResult(0, root, root, root)
        if key.extra_key is not None or key.cache_salt is not None or key.is_bigram:
            return miss
        ids = key.token_ids if key.limit is None else key.token_ids[: key.limit]
        r = self.tree.match_prefix(ids)
        device = len(r.device_indices)
        return MatchResult(
            device_prefix_len=device,
            last_device_node=r.last_device_node,
            last_host_node=r.last_host_node,
            best_match_node=r.last_host_node,
            host_hit_length=r.host_hit_length,
            full_kv_hit_length=device + r.host_hit_length,
        )

    def touch_prefix(self, key: Any) -> None:
        if key.extra_key is None and key.cache_salt is None and not key.is_bigram:
            self.tree.match_prefix(key.token_ids)

    def path_device_indices(self, node: TreeNode) -> torch.Tensor:
        """Device slots from the root to ``node`` (``ValueError`` when one on it is evicted)."""
        values = []
        x = node
        while x is not self.tree.root_node:
            if x.value is None:
                raise ValueError(f"path_device_indices: {x!r} on the path is not on the device")
            values.append(x.value)
            x = x.parent
        if not values:
            return torch.empty((0,), dtype=torch.int64, device=self.tree.device)
        return torch.cat(values[::-1])

    def inc_host_lock_ref(self, node: TreeNode) -> IncLockRefResult:
        """Keep the host copies on the path to ``node`` from host eviction."""
        if isinstance(self.tree, HiRadixCache):
            self.tree.protect_host(node)
        return IncLockRefResult(node_id=node.id)

    def dec_host_lock_ref(
        self, node: TreeNode, params: DecLockRefParams | None = None
    ) -> DecLockRefResult:
        if isinstance(self.tree, HiRadixCache):
            self.tree.release_host(node)
        return DecLockRefResult()

    def inc_lock_ref(self, node: TreeNode) -> IncLockRefResult:
        return IncLockRefResult(delta=-self.tree.inc_lock_ref(node))  # evictable size change

    def dec_lock_ref(
        self, node: TreeNode, params: DecLockRefParams | None = None
    ) -> DecLockRefResult:
        return DecLockRefResult(delta=self.tree.dec_lock_ref(node))

    # ------------------------------------------------------------------ a request's KV
    def checkpoint(self, req: Req, *, up_to: int, **kwargs: Any) -> None:
        """Insert ``row[:up_to]`` (whole pages) of ``req``; free the request's copies of pages
        the tree already held past ``cache_protected_len``, point the row at the tree's slots
        and move ``req.lock`` onto the node the insert ended on. A namespaced request
        (``extra_key`` / ``cache_salt``) keeps its KV: nothing is inserted."""
        if req.extra_key is not None or req.cache_salt is not None:
            return
        ps = self.page_size
        n = (min(up_to, len(req.full_untruncated_fill_ids)) // ps) * ps
        protected = req.kv.cache_protected_len
        if n <= protected:
            return
        tokens = req.full_untruncated_fill_ids[:n]
        row = self.req_to_token_pool.req_to_token[req.kv.req_pool_idx]
        values = row[:n].to(dtype=torch.int64, copy=True)
        # SGLang 0.5.23 counts a hit once per request and node, chunk or not (inserted_len).
        present = self.tree.insert(
            tokens, values, chunked=not req.finished(), counted_from=req.kv.cache_inserted_len
        )
        if present > protected:  # the request's duplicates of what the tree held
            self.tree.allocator.free(values[protected:present])  # validated, then SGLang's
        match = self.tree.match_prefix(tokens)
        new_indices = match.device_indices
        if len(new_indices) != n or match.last_device_node is not match.last_host_node:
            raise AssertionError(
                f"checkpoint: {len(new_indices)} device tokens after inserting {n}"
            )
        row[protected:n] = new_indices[protected:].to(row.dtype)
        self.unlock(req.lock)
        req.lock = self.lock(match.last_device_node)
        req.kv.cache_protected_len = n
        req.kv.cache_inserted_len = max(req.kv.cache_inserted_len, n)
        req.last_node = match.last_device_node

    # ------------------------------------------------------------------ eviction
    def evict(self, params: EvictParams) -> EvictResult:
        if params.num_tokens <= 0:
            return EvictResult()
        return EvictResult(num_tokens_evicted=self.tree.evict(params.num_tokens))

    def evict_host(self, num_tokens: int) -> int:
        return self.tree.evict_host(num_tokens)

    def evictable_size(self) -> int:
        return self.tree.evictable_size()

    def full_evictable_size(self) -> int:
        return self.tree.evictable_size()

    def protected_size(self) -> int:
        return self.tree.protected_size()

    def full_protected_size(self) -> int:
        return self.tree.protected_size()

    def total_size(self) -> int:
        return self.tree.total_size()

    # ------------------------------------------------------------------ the host tier
    def init_load_back(self, params: InitLoadBackParams) -> tuple[int, Any] | None:
        """Queue the H2D load of the host hit ending at ``params.best_match_node``; returns
        (tokens loaded, the node now ending the device prefix): all of the hit, or 0 and the
        request's ``last_node`` when it is below the threshold or finds no device room."""
        node = params.best_match_node
        fallback = params.req.last_node if params.req is not None else node
        tree = self.tree
        if not isinstance(tree, HiRadixCache) or not node.evicted:
            return 0, fallback
        tree._check_attached(node, "best_match_node")
        ancestor, chain = node, 0
        while ancestor.evicted:
            chain += len(ancestor.host_value)
            ancestor = ancestor.parent
        if chain < tree.load_back_threshold:
            return 0, fallback
        short = chain - self.token_to_kv_pool_allocator.available_size()
        if short > 0:  # as SGLang: evict the shortfall, the hit and its device path held
            tree.inc_lock_ref(ancestor)
            tree.protect_host(node)
            try:
                self.evict_for_alloc(EvictParams(num_tokens=short))
            finally:
                tree.release_host(node)
                tree.dec_lock_ref(ancestor)
        slots, last = tree.init_load_back(node, params.host_hit_length)
        if slots.numel() == 0:
            return 0, fallback
        return int(slots.numel()), last

    # ------------------------------------------------------------------ the L3 tier
    @property
    def ongoing_prefetch(self) -> dict[AttemptHandle, Any]:
        """Prefetches not yet applied, by attempt (SGLang's idle check reads their count)."""
        return self.storage.prefetches.ongoing if self.storage is not None else {}

    @property
    def ongoing_backup(self) -> dict[int, Any]:
        """Backups to L3 not yet acked, by operation id."""
        return self.storage.backups if self.storage is not None else {}

    def prefetch_from_storage(
        self,
        request: CacheRequestHandle,
        last_host_node: TreeNode,
        new_input_tokens: list[int],
        last_hash: str | None = None,
        prefix_keys: list[str] | None = None,
        matched_prefix_tokens: list[int] | None = None,
        extra_key: str | None = None,
        cache_salt: str | None = None,
        storage_hit_end: int | None = None,
    ) -> bool | None:
        """Start the L3 lookup (then fetch into host slots) of ``new_input_tokens`` after
        ``last_host_node``, the deepest matched node, which ends at token
        ``len(matched_prefix_tokens)``; the keys chain from the node's (``last_hash`` and
        ``prefix_keys`` are the same, derived by the tree). ``True`` when issued; ``None`` when
        declined (no tier, a namespaced key, shorter than ``prefetch_threshold``, rate limited,
        or the attempt has one). ``storage_hit_end`` (SGLang's paced-retry hint) is not used."""
        if self.storage is None or extra_key is not None or cache_salt is not None:
            return None
        self.tree._check_attached(last_host_node, "last_host_node")
        start = len(matched_prefix_tokens or [])
        issued = self.storage.prefetch(
            attempt(request), last_host_node, list(new_input_tokens), start
        )
        return True if issued else None

    def check_prefetch_progress(self, request: CacheRequestHandle) -> bool:
        """Whether the attempt may be admitted now: no prefetch, or its fetched pages are in the
        tree as host-only nodes (under ``best_effort`` / an expired ``timeout``, what landed)."""
        if self.storage is None:
            return True
        return self.storage.check_prefetch_progress(attempt(request), time.monotonic())

    def pop_prefetch_loaded_tokens(self, request: CacheRequestHandle) -> int:
        return self.pop_prefetch_loaded_span(request)[0]

    def pop_prefetch_loaded_span(self, request: CacheRequestHandle) -> tuple[int, int | None]:
        """(tokens the attempt's prefetch put in the tree, the position of the first)."""
        if self.storage is None:
            return 0, None
        return self.storage.take_loaded_span(attempt(request))

    def release_aborted_request(self, request: CacheRequestHandle) -> None:
        """Drop the attempt's prefetch: its anchor's host protection, its host slots (at once,
        or at the IO thread's ack when a read is still running) and its loaded count."""
        if self.storage is not None:
            self.storage.release(attempt(request))

    def finish(self, request: CacheRequestHandle, outcome: CacheRequestOutcome) -> None:
        """SGLang's: a non-success outcome releases the attempt; a success keeps its work (the
        pages are in the tree) and forgets an unpopped loaded count."""
        if outcome != CacheRequestOutcome.SUCCESS:
            self.release_aborted_request(request)
        elif self.storage is not None:
            self.storage.take_loaded_span(attempt(request))

    def clear_storage_backend(self) -> bool:
        """Remove every page from L3 (SGLang's clear-HiCache call); ``False`` without a tier,
        with L3 operations in flight, or when the backend could not clear. The tree keeps its
        device and host copies."""
        if self.storage is None or self.storage.ops_in_flight():
            return False
        self.storage.beliefs.clear()
        return self.storage.backend.clear() is not False

    def attach_storage_backend(self, storage_backend: str, **kwargs: Any) -> tuple[bool, str]:
        """Refused: the L3 tier is chosen at start (``--hicache-storage-backend``)."""
        return False, (
            f"--radix-cache-backend {BACKEND_NAME}: attaching an L3 backend at runtime is not "
            "supported; start with --hicache-storage-backend file|mooncake"
        )

    def detach_storage_backend(self) -> tuple[bool, str]:
        """Refused: the L3 tier stays for the server's life."""
        if self.storage is None:
            return True, "no L3 backend attached"
        return False, (
            f"--radix-cache-backend {BACKEND_NAME}: detaching the L3 backend at runtime is not "
            "supported"
        )

    def ready_to_load_host_cache(self) -> int:
        return self.tree.ready_to_load_host_cache()

    def is_load_back_event_done(self, consumer_index: int) -> bool:
        if consumer_index < 0 or self.cache_controller is None:
            return True
        event = self.cache_controller.layer_done_counter.events.get(consumer_index)
        return event is None or event.finish_event.query()

    def has_free_load_back_slot(self) -> bool:
        return True

    def check_hicache_events(self) -> None:
        self.tree.check_hicache_events()

    def flush_pending_backups(self) -> None:
        """Backups launch at insert (write_through*) or eviction (write_back), L3 stores at the
        host copy's ack (``check_hicache_events``): none queued."""

    @property
    def token_to_kv_pool_host(self) -> HostKVPool | None:
        """The host pool (``None`` device only); SGLang's metrics read its size and use."""
        return self.host_pool

    def release_host_resources(self) -> None:
        """On shutdown: finish the copies, stop the CPU stream threads, unregister the host
        pool's pinned memory (idempotent); the L3 tier's threads and backend first."""
        if self.storage is not None:
            self.storage.close()
        if self.cache_controller is not None:
            self.cache_controller.close()
        if self.host_pool is not None:
            self.host_pool.destroy()

    def all_values_flatten(self) -> torch.Tensor:
        """Every device slot the tree holds (SGLang's leak census reads them)."""
        values = [x.value for x in self.tree.all_nodes() if x.value is not None]
        if not values:
            return torch.empty((0,), dtype=torch.int64, device=self.tree.device)
        return torch.cat(values)

    def sanity_check(self) -> None:
        self.tree.check_integrity()
        if self.storage is not None:
            self.storage.check_integrity()

    def pretty_print(self) -> None:
        stack = [(self.tree.root_node, 0)]
        while stack:
            x, depth = stack.pop()
            logger.info("%s%r", "  " * depth, x)
            stack.extend((c, depth + 1) for c in x.children.values())


def build_backend(
    ctx: TreeCacheBuildContext,
    *,
    copy_delay: Delay = 0.0,
    streams: Streams | str | None = None,
) -> HiRadixCacheBackend:
    """The backend for SGLang's build context: ``ValueError`` naming every refused flag first;
    then, over SGLang's allocator and device pool, ``HiRadixCache`` with a host pool and copy
    streams (``--enable-hierarchical-cache``; its layer-done counter registered with the pool
    and the TP worker; with ``--hicache-storage-backend file|mooncake`` its L3 tier, built as
    :func:`hicache.builder.build_kv_cache` builds it) or the device-only ``RadixCache``.
    ``copy_delay`` / ``streams``: as :func:`hicache.builder.build_kv_cache` (tests on a CPU)."""
    args = ctx.server_args
    problems = refusals(
        args, is_hybrid_swa=ctx.is_hybrid_swa, is_hybrid_ssm=ctx.is_hybrid_ssm, is_dsa=ctx.is_dsa
    )
    if ctx.disable_radix_cache and not any(p.startswith("--disable-radix") for p in problems):
        problems.append("--disable-radix-cache: no prefix cache to replace")
    if problems:
        raise ValueError(
            f"--radix-cache-backend {BACKEND_NAME} does not serve: " + "; ".join(problems)
        )
    params = ctx.params
    opts = backend_options(args, params.page_size)
    view = SGLangAllocatorView(params.token_to_kv_pool_allocator)
    if view.page_size != opts.page_size:
        raise ValueError(
            f"page_size: the tree's {opts.page_size} differs from the allocator's {view.page_size}"
        )
    if not opts.hierarchical:
        tree = RadixCache(view, opts.page_size, view.device)
        logger.info("%s: device-only tree, page %d", BACKEND_NAME, opts.page_size)
        return HiRadixCacheBackend(params, tree)

    from hicache_prefill.hicache.memory.host_pool import make_host_pool
    from hicache_prefill.hicache.tp.group import DistTPGroup, SingleRankGroup
    from hicache_prefill.hicache.transfer.controller import HiCacheController

    device_pool = params.token_to_kv_pool_allocator.get_kvcache()
    cpu_group = getattr(ctx.tp_group, "cpu_group", None)
    if ctx.tp_size > 1 and cpu_group is None:
        raise ValueError(f"tp_group: --tp-size {ctx.tp_size} needs SGLang's TP group (cpu_group)")
    group = SingleRankGroup() if ctx.tp_size == 1 else DistTPGroup(cpu_group)
    host_pool = make_host_pool(device_pool, opts.hicache_ratio, opts.hicache_size, opts.mem_layout)
    try:
        controller = HiCacheController(
            view,
            device_pool,
            host_pool,
            io_backend=opts.io_backend,
            streams=streams,
            copy_delay=copy_delay,
            group=group,
        )
    except ValueError:
        host_pool.destroy()
        raise
    tree = HiRadixCache(controller, opts.page_size, write_policy=opts.write_policy)
    storage = None
    if opts.storage_backend is not None:
        from hicache_prefill.hicache.storage.io.controller import build_storage_controller

        try:
            storage = build_storage_controller(
                StorageArgs.from_server_args(args, opts.page_size), tree, host_pool, group
            )
        except ValueError as e:
            controller.close()
            host_pool.destroy()
            raise ValueError(f"--radix-cache-backend {BACKEND_NAME}: {e}") from e
    counter = controller.layer_done_counter
    device_pool.register_layer_transfer_counter(counter)
    if ctx.tp_worker is not None:
        ctx.tp_worker.register_hicache_layer_transfer_counter(counter)
    logger.info(
        "%s: device %d + host %d tokens, page %d, %s, %s/%s, L3 %s",
        BACKEND_NAME,
        view.size,
        host_pool.size,
        opts.page_size,
        opts.write_policy,
        opts.mem_layout,
        opts.io_backend,
        opts.storage_backend,
    )
    return HiRadixCacheBackend(params, tree, host_pool, storage)


def register(
    name: str = BACKEND_NAME,
    factory: Callable[[TreeCacheBuildContext], BasePrefixCache] | None = None,
) -> str:
    """Register ``factory`` (default :func:`build_backend`) as SGLang's radix-cache backend
    ``name``; a second call with the same name does nothing. Returns ``name``."""
    if name not in registered_radix_cache_backends():
        register_radix_cache_backend(name, factory or build_backend)
    return name
