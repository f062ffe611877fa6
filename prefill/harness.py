"""Building blocks shared by the executor's tests and benchmarks: an executor wired to a
virtual (or wall) clock and a decode side that keeps what it received, and the check that a
request's decode-side KV equals a full recompute."""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any

import torch

from prefill.bootstrap import DecodeSide, PeerConfig
from prefill.clock import Clock, VirtualClock
from prefill.executor import CostModel, OptimisticPrefillExecutor
from prefill.model import ModelConfig, PagedTransformer

logger = logging.getLogger(__name__)

KV_ATOL = 1e-5
"""fp32 tolerance of decode-side KV vs a full recompute (matmul reduction order only)."""


def build_cache(args: Any, copy_delay: float | Callable[[], float] = 0.0) -> Any:
    """``hicache.cache.build_kv_cache(args)``; ``copy_delay`` (CPU only) widens race windows of
    the controller's side streams when the builder accepts it."""
    try:
        from hicache.cache import build_kv_cache
    except ImportError:  # TODO(prefill): drop once hicache/cache.py has landed
        return _build_cache_locally(args, copy_delay)
    if copy_delay:
        try:
            return build_kv_cache(args, copy_delay=copy_delay)
        except TypeError:
            logger.warning("build_kv_cache takes no copy_delay; building without it")
    return build_kv_cache(args)


def make_executor(
    args: Any,
    peer_config: PeerConfig | None = None,
    clock: Clock | None = None,
    cost_model: CostModel | None = None,
    keep_received: bool = True,
    decode_pool_size: int = 1 << 16,
    cache: Any = None,
    model: PagedTransformer | None = None,
) -> OptimisticPrefillExecutor:
    """An executor over ``build_kv_cache(args)`` and the model of ``args``, with a decode side
    that keeps received KV (for ``assert_decode_kv_matches``) and a ``VirtualClock`` default."""
    clock = clock if clock is not None else VirtualClock()
    cache = cache if cache is not None else build_cache(args)
    if model is None:
        model = PagedTransformer(ModelConfig.from_server_args(args), args.resolved_device())
    peer_config = peer_config if peer_config is not None else PeerConfig.from_server_args(args)
    decode = DecodeSide(
        cache.device_pool, clock, peer_config, size=decode_pool_size, keep_received=keep_received
    )
    return OptimisticPrefillExecutor(
        args, cache=cache, model=model, clock=clock, decode=decode, cost_model=cost_model
    )


def assert_decode_kv_matches(
    executor: OptimisticPrefillExecutor, rid: str, atol: float = KV_ATOL
) -> None:
    """Decode-side KV of ``rid`` (tokens ``[decode_prefix_len, n)``, every layer, K and V)
    equals the model's full recompute of the prompt within ``atol``."""
    req = executor.requests[rid]
    dpl, k, v = executor.decode.received_kv(rid)
    ids = torch.tensor(req.token_ids, dtype=torch.int64)
    _, ref_k, ref_v = executor.model.forward_reference(ids)
    torch.testing.assert_close(k, ref_k[:, dpl:].to(k.dtype), atol=atol, rtol=atol)
    torch.testing.assert_close(v, ref_v[:, dpl:].to(v.dtype), atol=atol, rtol=atol)


def _build_cache_locally(args: Any, copy_delay: float | Callable[[], float] = 0.0) -> Any:
    """Stand-in for ``build_kv_cache`` while it is not in the tree (same attributes)."""
    from types import SimpleNamespace

    from hicache.allocator import TokenToKVPoolAllocator
    from hicache.controller import HiCacheController
    from hicache.hiradix_cache import HiRadixCache
    from hicache.memory_pool import MHATokenToKVPool
    from hicache.memory_pool_host import MHATokenToKVPoolHost
    from hicache.radix_cache import RadixCache

    pool = MHATokenToKVPool.from_server_args(args)
    alloc = TokenToKVPoolAllocator(args.max_total_tokens, args.page_size, pool.device)
    if not args.enable_hierarchical_cache:
        tree = RadixCache(alloc, args.page_size)
        return SimpleNamespace(
            device_pool=pool, allocator=alloc, tree=tree, host_pool=None, controller=None
        )
    host = MHATokenToKVPoolHost(
        pool, args.hicache_ratio, args.hicache_size, args.page_size, args.hicache_mem_layout,
        pin_memory=False,
    )
    ctrl = HiCacheController(alloc, pool, host, args.hicache_io_backend, copy_delay=copy_delay)
    tree = HiRadixCache(
        ctrl, args.page_size, args.hicache_write_policy, args.load_back_threshold,
        args.hicache_upstream_chunked_insert,
    )
    return SimpleNamespace(
        device_pool=pool, allocator=alloc, tree=tree, host_pool=host, controller=ctrl
    )


_ROOT_LOCK_MSG = "root lock count below its children's"


def root_lock_check_is_buggy() -> bool:
    """True while ``hicache.tree_integrity`` flags two requests locking different subtrees
    (the root's ``lock_ref`` is pinned to 1 and never counts path locks, as in SGLang)."""
    from hicache.allocator import TokenToKVPoolAllocator
    from hicache.radix_cache import RadixCache

    alloc = TokenToKVPoolAllocator(8, 1, "cpu")
    tree = RadixCache(alloc, 1)
    for key in ([1], [2]):
        tree.insert(key, alloc.alloc(1))
        tree.inc_lock_ref(tree.match_prefix(key).last_device_node)
    try:
        tree.check_integrity(request_owned=0)
    except AssertionError as exc:
        return _ROOT_LOCK_MSG in str(exc)
    return False


def ignore_root_lock_false_positive(monkeypatch: Any) -> None:
    """TEMPORARY test workaround (reported to the hicache owner): while the check above is
    buggy, make ``tree_integrity`` skip only that one message; every other check still runs.
    A no-op once the check is fixed."""
    if not root_lock_check_is_buggy():
        return
    import hicache.tree_integrity as ti

    original = ti._fail

    def _fail(msg: str) -> None:
        if msg == _ROOT_LOCK_MSG:
            return
        original(msg)

    monkeypatch.setattr(ti, "_fail", _fail)


def single_torch_thread() -> Any:
    """Context manager: ``torch.set_num_threads(1)`` inside, the previous count restored after.

    The tiny model's ops are far too small for intra-op threads; on a loaded 2-core machine
    OpenMP spinning made them ~20x slower (measured: 1.6 ms vs 27 ms CPU per forward)."""
    from contextlib import contextmanager

    @contextmanager
    def _cm():  # type: ignore[no-untyped-def]
        before = torch.get_num_threads()
        torch.set_num_threads(1)
        try:
            yield
        finally:
            torch.set_num_threads(before)

    return _cm()
