"""``MooncakeStore``: the Mooncake Store as the L3 backend (``--hicache-storage-backend mooncake``,
SGLang 0.5.23's ``MooncakeStore``): every instance on one master reuses the pages any other stored.

A page is one object per part (``names``): the part's bytes as the host pool lays them out, plus an
integrity footer (``page_footers``) unless the pages are SGLang's (``storage_format_tag: "none"``).
A page is found, stored or read only when every object of it succeeded, and read only when each
object is whole and checked; anything else is a counted miss. Every call is gated on
``health_check()``, so a down master costs a counted skip instead of Mooncake's ~4.4 s wait.
"""

from __future__ import annotations

import logging
import os
import threading
import time
from collections.abc import Callable
from itertools import accumulate
from typing import Any, ClassVar

import torch

from hicache_prefill.hicache.storage.base import (
    HiCacheStorage,
    HiCacheStorageExtraInfo,
    host_indices_fit,
)
from hicache_prefill.hicache.storage.config import (
    FLAG,
    HiCacheStorageConfig,
    as_extra_config,
    as_storage_config,
)
from hicache_prefill.hicache.storage.mooncake.client import (
    HEALTHY,
    MooncakeClient,
    error_name,
    open_client,
)
from hicache_prefill.hicache.storage.mooncake.config import (
    BACKEND_KEYS,
    MooncakeStoreConfig,
    device_for_rank,
    load_mooncake_config,
    parse_bool,
)
from hicache_prefill.hicache.storage.mooncake.names import ObjectNames
from hicache_prefill.hicache.storage.mooncake.page_footers import GET_CALL, PUT_CALL, PageFooters
from hicache_prefill.hicache.storage.mooncake.store_stats import (
    MooncakeCounters,
    MooncakeStoreStats,
)

logger = logging.getLogger(__name__)

SGLANG_KEYS = frozenset({"backend_name", "module_path", "class_name", "interface_v1"})
"""Extra-config keys SGLang's factory and controller read and pass on (``dynamic``)."""

_Meta = tuple[list[str], list[str], list[int], list[int]]  # keys, object names, addresses, sizes


def _check_keys(keys: list[str], call: str) -> None:
    for key in keys:
        if not isinstance(key, str) or not key:
            raise ValueError(f"{call}: storage keys must be non-empty strings, got {key!r}")


def host_regions(host_pool: Any) -> list[tuple[int, int]]:
    """``(address, bytes)`` of each host allocation of ``host_pool`` to register: its
    ``page_regions()`` (this project's host pools), else what SGLang's ``MooncakeStore``
    registers (SGLang's host pools): each tensor of ``get_hybrid_pool_buffer()``, else
    ``kv_buffer`` (a tensor or a sequence of them), as its whole allocation."""
    if hasattr(host_pool, "page_regions"):
        return list(host_pool.page_regions())
    get_buffers = getattr(host_pool, "get_hybrid_pool_buffer", None)
    buffers = list(get_buffers()) if get_buffers is not None else [host_pool.kv_buffer]
    regions: dict[int, int] = {}
    while buffers:
        buf = buffers.pop(0)
        if isinstance(buf, list | tuple):
            buffers[:0] = list(buf)
        elif isinstance(buf, torch.Tensor):
            storage = buf.untyped_storage()
            regions[storage.data_ptr()] = storage.nbytes()
    if not regions:
        raise ValueError(f"{type(host_pool).__name__} has no host buffer to register")
    return list(regions.items())


class MooncakeStore(HiCacheStorage):
    """``storage_config``: this project's or SGLang's (``as_storage_config``); ``None``: rank 0 of
    1. ``mem_pool_host`` is accepted for SGLang's constructor shapes (``mooncake``: the host
    pool; ``dynamic``: the factory's keyword dict) and not used: ``register_mem_pool_host``
    registers the pool. Construction connects."""

    store_factory: ClassVar[Callable[[], Any] | None] = None
    """Builds the raw ``MooncakeDistributedStore`` (tests substitute a fake)."""

    def __init__(
        self, storage_config: HiCacheStorageConfig | None = None, mem_pool_host: Any = None
    ) -> None:
        cfg = as_storage_config(
            storage_config if storage_config is not None else HiCacheStorageConfig(0, 1)
        )
        extra = as_extra_config(cfg.extra_config)
        unknown = sorted(set(extra) - BACKEND_KEYS - SGLANG_KEYS)
        if unknown:
            logger.warning("MooncakeStore: extra config keys %s are not Mooncake settings", unknown)
        if cfg.attn_cp_size > 1:
            raise ValueError(
                f"attn_cp_size={cfg.attn_cp_size}: Mooncake object names do not carry the "
                "context-parallel rank (SGLang's neither); not supported"
            )
        self.storage_config = cfg
        self.config: MooncakeStoreConfig = load_mooncake_config(extra)
        self.names = ObjectNames.for_config(cfg, extra.get("extra_backend_tag"))
        self.is_writer = cfg.is_storage_writer
        group_semantics = parse_bool(
            extra.get("enable_group_semantics", False),
            f"extra config key 'enable_group_semantics' ({FLAG})",
        )
        self.segment_bytes = self.config.global_segment_size // (cfg.tp_size * cfg.pp_size)
        self.client: MooncakeClient = open_client(
            self.config,
            device_name=device_for_rank(
                self.config.device_name, cfg.tp_rank, self.config.source("device_name")
            ),
            segment_bytes=self.segment_bytes,
            ssd_offload_path=self._ssd_path(cfg),
            factory=type(self).store_factory,
        )
        self.footers = None if cfg.format_tag is None else PageFooters(self.client)
        if self.footers is not None and not all(map(self.client.supports, (PUT_CALL, GET_CALL))):
            self.client.close()
            raise ValueError(
                f"this Mooncake has no {PUT_CALL} / {GET_CALL}, which the pages' integrity "
                "footer needs: upgrade Mooncake, or set the extra-config key storage_format_tag "
                "to 'none' (SGLang's pages, without a check)"
            )
        self._replicate_config = self._group_config_class() if group_semantics else None
        self.counters = MooncakeCounters()
        self._object_sizes: list[int] = []
        self._unhealthy_since: float | None = None
        self._warned_size = False
        self._health_lock = threading.Lock()
        logger.info(
            "MooncakeStore rank %d/%d: master %s, %d MiB segment, objects %s (%s)",
            cfg.tp_rank,
            cfg.tp_size,
            self.config.master_server_address,
            self.segment_bytes >> 20,
            self.names.objects(["<key>"]),
            "no integrity check" if self.footers is None else "checked",
        )

    def _ssd_path(self, cfg: HiCacheStorageConfig) -> str | None:
        """SGLang's per-rank subfolder of ``ssd_offload_path`` (ranks must not share one)."""
        base = self.config.ssd_offload_path
        if base is None:
            return None
        rank = f"rank_{cfg.dp_rank}_{cfg.tp_rank}_{cfg.pp_rank}_{cfg.attn_cp_rank}"
        path = os.path.join(base, rank)
        try:
            os.makedirs(path, exist_ok=True)
        except OSError as e:
            raise ValueError(f"{self.config.source('ssd_offload_path')}={base!r}: {e}") from e
        return path

    def _group_config_class(self) -> Any:
        try:
            from mooncake.store import ReplicateConfig
        except ImportError:
            return None
        if not hasattr(ReplicateConfig(), "group_ids"):
            logger.warning(
                "enable_group_semantics: this Mooncake has no ReplicateConfig.group_ids; "
                "objects are put without groups"
            )
            return None
        return ReplicateConfig

    def register_mem_pool_host(self, mem_pool_host: Any) -> None:
        """Register the host pool's buffers with Mooncake (zero copy)."""
        if getattr(mem_pool_host, "layout", None) == "layer_first":
            raise ValueError(
                "--hicache-mem-layout=layer_first: Mooncake stores one object per page part, "
                "which needs page_first or page_first_direct (SGLang resolves the same)"
            )
        _, sizes = mem_pool_host.get_page_buffer_meta(
            torch.arange(mem_pool_host.page_size, dtype=torch.int64)
        )
        if len(sizes) != self.names.per_page:
            raise ValueError(
                f"host pool gives {len(sizes)} buffers per page, Mooncake names "
                f"{self.names.per_page} objects per page (MLA: {self.storage_config.is_mla_model})"
            )
        self.client.register(host_regions(mem_pool_host))
        super().register_mem_pool_host(mem_pool_host)
        self._object_sizes = list(sizes)

    def _v1(
        self, keys: list[str], host_indices: torch.Tensor, call: str, io: Callable[..., list[bool]]
    ) -> list[bool]:
        """``io`` of the pages at ``host_indices``; all ``False`` (logged) when the counts
        disagree (SGLang's answer)."""
        if not keys:
            return []
        pool = self._v1_pool()
        _check_keys(keys, call)
        if not host_indices_fit(keys, host_indices, pool.page_size, call):
            return [False] * len(keys)
        ptrs, sizes = pool.get_page_buffer_meta(host_indices)
        return io(keys, self.names.objects(keys), ptrs, sizes)

    def _flat_meta(self, key: str, page: Any, call: str) -> _Meta:
        """The meta of one flat page tensor (parts back to back)."""
        if not self._object_sizes:
            raise ValueError(f"MooncakeStore.{call}: register_mem_pool_host first")
        if not (
            isinstance(page, torch.Tensor) and page.device.type == "cpu" and page.is_contiguous()
        ):
            raise ValueError(f"MooncakeStore.{call}: the page must be a contiguous CPU tensor")
        total = sum(self._object_sizes)
        if page.numel() * page.element_size() != total:
            raise ValueError(f"MooncakeStore.{call}: the page must hold {total} bytes")
        _check_keys([key], f"MooncakeStore.{call}")
        offsets = accumulate([0, *self._object_sizes[:-1]])
        ptrs = [page.data_ptr() + offset for offset in offsets]
        return [key], self.names.objects([key]), ptrs, list(self._object_sizes)

    def _healthy(self) -> bool:
        state = self.client.health()
        with self._health_lock:
            if state == HEALTHY:
                if self._unhealthy_since is not None:
                    logger.warning(
                        "Mooncake master %s reachable again after %.1f s",
                        self.config.master_server_address,
                        time.monotonic() - self._unhealthy_since,
                    )
                    self._unhealthy_since = None
                return True
            if self._unhealthy_since is None:
                self._unhealthy_since = time.monotonic()
                logger.warning(
                    "Mooncake health_check=%d (master %s unreachable or client closed): storage "
                    "calls answer as failures until it is back",
                    state,
                    self.config.master_server_address,
                )
        self.counters.add(skipped_unhealthy=1)
        return False

    def _codes(self, name: str, result: Any, n: int) -> list[int]:
        """``result`` as ``n`` return codes (a missing or malformed answer: failures)."""
        if isinstance(result, list) and len(result) == n:
            return [int(r) for r in result]
        if result is None:
            self.counters.add(call_errors=1)
            return [-1] * n
        logger.warning("Mooncake %s answered %r for %d objects", name, result, n)
        code = result[0] if isinstance(result, list) and result else -1
        return [int(code)] * n

    def _per_page(self, ok: list[bool]) -> list[bool]:
        k = self.names.per_page
        return [all(ok[i : i + k]) for i in range(0, len(ok), k)]

    def _exists(self, names: list[str]) -> list[int]:
        """1 exists, 0 not, < 0 error."""
        self.counters.add(exists_queries=1)
        result = self.client.call("batch_is_exist", names)
        return self._codes("batch_is_exist", result, len(names))

    def batch_exists(
        self, keys: list[str], extra_info: HiCacheStorageExtraInfo | None = None
    ) -> int:
        if not keys:
            return 0
        names = self.names.objects(keys)
        if not self._healthy():
            return 0
        pages = self._per_page([r == 1 for r in self._exists(names)])
        return next((i for i, ok in enumerate(pages) if not ok), len(pages))

    def exists(self, key: str) -> bool:
        return self.batch_exists([key]) == 1

    def _get(self, names: list[str], ptrs: list[int], sizes: list[int]) -> list[bool]:
        """Per object whether it arrived whole and checked; failures are counted."""
        footers, buf, call = self.footers, None, "batch_get_into"
        if footers is None:
            result = self.client.call(call, names, ptrs, sizes)
            whole = sizes
        else:
            call = GET_CALL
            buf = footers.staging(len(names))
            if buf is None:
                self.counters.add(call_errors=1)
                return [False] * len(names)
            result = self.client.call(call, names, *footers.buffers(buf, ptrs, sizes))
            whole = [size + footers.size for size in sizes]
        ok = []
        rcs = self._codes(call, result, len(names))
        for i, (rc, size) in enumerate(zip(rcs, whole, strict=True)):
            if rc == size:
                good = buf is None or footers.holds(buf, i, names[i], ptrs[i], sizes[i])
                if not good:
                    self._corrupt(names[i])
                ok.append(good)
                continue
            ok.append(False)
            if rc > 0:
                self.counters.add(wrong_size=1)
            else:
                self.counters.error(error_name(rc))
            if (rc > 0 or rc == -600) and not self._warned_size:
                self._warned_size = True
                logger.warning(
                    "Mooncake objects of another size under this server's names (read %d "
                    "bytes into %d): another TP size or geometry writes the same names; give "
                    "it its own extra_backend_tag. Those pages are misses.",
                    rc,
                    size,
                )
        return ok

    def _corrupt(self, name: str) -> None:
        """Removed, so that a writer can put it again."""
        self.counters.add(read_corrupt=1)
        logger.warning("Mooncake object %s fails its check (damaged or another's); removed", name)
        self.client.call("remove", name, True)

    def _read(
        self, keys: list[str], names: list[str], ptrs: list[int], sizes: list[int]
    ) -> list[bool]:
        if not self._healthy():
            return [False] * (len(names) // self.names.per_page)
        ok = self._get(names, ptrs, sizes)
        pages = self._per_page(ok)
        good = sum(pages)
        self.counters.add(
            pages_read=good,
            pages_read_failed=len(pages) - good,
            bytes_read=sum(s for s, o in zip(sizes, ok, strict=True) if o),
        )
        return pages

    def batch_get_v1(
        self,
        keys: list[str],
        host_indices: torch.Tensor,
        extra_info: HiCacheStorageExtraInfo | None = None,
    ) -> list[bool]:
        """A failed page may leave partial bytes in its slots (the prefetch frees them)."""
        return self._v1(keys, host_indices, "batch_get_v1", self._read)

    def get(
        self, key: str, target_location: Any | None = None, target_sizes: Any | None = None
    ) -> torch.Tensor | None:
        """``target_location``: a contiguous CPU tensor of one flat page."""
        ok = self._read(*self._flat_meta(key, target_location, "get"))[0]
        return target_location if ok else None

    def _put(self, names: list[str], ptrs: list[int], sizes: list[int], groups: list[str]) -> Any:
        config: tuple[Any, ...] = ()
        if self._replicate_config is not None:
            replicate = self._replicate_config()
            replicate.group_ids = groups
            config = (replicate,)
        footers = self.footers
        if footers is None:
            return self.client.call("batch_put_from", names, ptrs, sizes, *config)
        buf = footers.staging(len(names))
        if buf is None:
            return None
        for i, (name, ptr, size) in enumerate(zip(names, ptrs, sizes, strict=True)):
            footers.write(buf, i, name, ptr, size)
        return self.client.call(PUT_CALL, names, *footers.buffers(buf, ptrs, sizes), *config)

    def _write(
        self, keys: list[str], names: list[str], ptrs: list[int], sizes: list[int]
    ) -> list[bool]:
        """Put the objects the store lacks; a page is stored when every object of it exists or
        was put. MLA ranks other than 0 put nothing and answer whether the page is stored."""
        n_pages = len(names) // self.names.per_page
        if not self._healthy():
            return [False] * n_pages
        present = [r == 1 for r in self._exists(names)]
        if not self.is_writer:
            return self._per_page(present)
        missing = [i for i, p in enumerate(present) if not p]
        ok = list(present)
        if missing:
            groups = [f"sglang-hicache:{self.names.tagged(k)}" for k in keys]
            result = self._put(
                [names[i] for i in missing],
                [ptrs[i] for i in missing],
                [sizes[i] for i in missing],
                [groups[i // self.names.per_page] for i in missing],
            )
            rcs = self._codes("batch_put_from", result, len(missing))
            for i, rc in zip(missing, rcs, strict=True):
                ok[i] = rc == 0
                if rc != 0:
                    self.counters.error(error_name(rc))
            written = [i for i, rc in zip(missing, rcs, strict=True) if rc == 0]
            self.counters.add(
                objects_written=len(written), bytes_written=sum(sizes[i] for i in written)
            )
        pages = self._per_page(ok)
        good = sum(pages)
        self.counters.add(
            objects_already_stored=sum(present),
            pages_stored=good,
            pages_store_failed=n_pages - good,
        )
        return pages

    def batch_set_v1(
        self,
        keys: list[str],
        host_indices: torch.Tensor,
        extra_info: HiCacheStorageExtraInfo | None = None,
    ) -> list[bool]:
        return self._v1(keys, host_indices, "batch_set_v1", self._write)

    def set(
        self,
        key: str,
        value: Any | None = None,
        target_location: Any | None = None,
        target_sizes: Any | None = None,
    ) -> bool:
        return self._write(*self._flat_meta(key, value, "set"))[0]

    def clear(self) -> bool:
        """``remove_all()``: every instance's objects (those read in the last lease stay)."""
        removed = self.client.call("remove_all")
        logger.info("MooncakeStore.clear removed %s objects", removed)
        return isinstance(removed, int) and removed >= 0

    def get_stats(self) -> MooncakeStoreStats:
        return self.counters.snapshot()

    def close(self) -> None:
        """The objects in this process's segment leave the store with it."""
        self.client.close()
