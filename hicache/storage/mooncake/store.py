"""``MooncakeStore``: the Mooncake Store as the L3 backend (``--hicache-storage-backend mooncake``,
SGLang 0.5.23's ``MooncakeStore``): every prefill instance on one Mooncake master reuses the KV
pages any other instance (or an SGLang server) stored.

**Objects.** One page is one object per part (``names``: ``{model}_{hash}_{tp_rank}_k`` / ``_v``
for MHA, ``{model}_{hash}__k`` for MLA). An object holds the part's bytes of the page as the
host pool lays them out (``get_page_buffer_meta``: ``page_first`` token-major, ``page_first_direct``
layer-major; the format tag in the model name keeps the two apart). ``layer_first`` pools are
refused (SGLang resolves them to ``page_first`` for Mooncake; so does ``server_args``).

**Zero copy.** ``register_mem_pool_host`` registers the host pool's buffers with Mooncake
(``register_buffer``, needed by RDMA); the v1 calls hand Mooncake the host pages' addresses:

- ``batch_exists(keys)``: ``batch_is_exist`` of every object; the pages from the first whose
  objects all exist;
- ``batch_get_v1(keys, host_indices)``: ``batch_get_into`` straight into the host slots; a page is
  read only when every object of it returned exactly its part's size (Mooncake returns the
  object's size, so an object of another geometry under the same name would otherwise pass);
- ``batch_set_v1(keys, host_indices)``: ``batch_is_exist``, then ``batch_put_from`` of the objects
  that are missing only (a put of an existing key is a no-op in Mooncake); a page is stored when
  every object of it exists or was put (return code 0). MLA ranks other than 0 write nothing
  (rank 0 stores the page for all) and answer whether the page is in the store.

A failed read may leave partial bytes in the host slots it was given; those slots belong to the
prefetch that asked, which never inserts a page that was not read whole, and frees them.

**Faults.** Every call is gated on ``health_check()``: with the master unreachable a call is
answered as a failure at once (``skipped_unhealthy``) instead of waiting about 4.4 s in Mooncake;
calls resume by themselves when a master serves the address again (its objects are gone: a
Mooncake master keeps everything in memory). Mooncake's return codes are counted per object
(``get_stats()``, ``stats.MooncakeStoreStats``); runtime failures are results (``False``, a
shorter count), never exceptions; bad arguments raise ``ValueError``. Startup errors (no master,
a bad setting, a segment below 16 MiB, nowhere to put) are one ``ValueError`` naming the setting.

**Where objects live.** The master places each object in a random mounted segment (one per
client: ``global_segment_size`` divided among this server's TP x PP ranks). An object lives in
its segment owner's memory and is gone when that process exits. Readers of a killed owner get
-800 (about 1 s per call) until the master drops it (``client_ttl``, 10 s).

**Threads.** Calls come from the storage IO threads (query, prefetch IO, backup), never from the
scheduler thread; each blocks on Mooncake. ``close()`` waits for calls in flight, then closes the
client; every later call is a failure. Not implemented from SGLang: the dummy-client mode
(``standalone_storage``), heterogeneous-TP head splitting, decode context parallelism and the
hybrid (v2) pools.
"""

from __future__ import annotations

import logging
import os
import threading
import time
from collections.abc import Callable
from typing import Any, ClassVar

import torch

from hicache.storage.base import HiCacheStorage, HiCacheStorageExtraInfo
from hicache.storage.config import HiCacheStorageConfig
from hicache.storage.config import FLAG, as_extra_config
from hicache.storage.mooncake.client import (
    HEALTHY,
    MooncakeClient,
    error_name,
    open_client,
)
from hicache.storage.mooncake.config import (
    BACKEND_KEYS,
    MooncakeStoreConfig,
    device_for_rank,
    load_mooncake_config,
)
from hicache.storage.mooncake.names import ObjectNames
from hicache.storage.mooncake.stats import MooncakeCounters, MooncakeStoreStats

logger = logging.getLogger(__name__)

_Meta = tuple[list[str], list[str], list[int], list[int]]  # keys, object names, addresses, sizes


class MooncakeStore(HiCacheStorage):
    """The Mooncake Store backend of one rank (module docstring).

    Args:
        storage_config: this rank's ``HiCacheStorageConfig`` (its ``extra_config`` holds the
            Mooncake keys; ``None``: rank 0 of 1, settings from the file or environment).
        mem_pool_host: accepted for SGLang's constructor shape; the host pool is registered by
            ``register_mem_pool_host``.

    Construction connects to the master and blocks for the probe and the setup (well under a
    second on loopback).
    """

    store_factory: ClassVar[Callable[[], Any] | None] = None
    """Builds the raw ``MooncakeDistributedStore`` (tests substitute a fake; ``None``: Mooncake)."""

    def __init__(
        self, storage_config: HiCacheStorageConfig | None = None, mem_pool_host: Any = None
    ) -> None:
        cfg = storage_config if storage_config is not None else HiCacheStorageConfig(0, 1)
        extra = as_extra_config(cfg.extra_config)
        unknown = sorted(set(extra) - BACKEND_KEYS)
        if unknown:
            logger.warning("MooncakeStore: extra config keys %s are not Mooncake settings; "
                           "ignored", unknown)  # fmt: skip
        if cfg.attn_cp_size > 1:
            raise ValueError(
                f"attn_cp_size={cfg.attn_cp_size}: Mooncake object names do not carry the "
                "context-parallel rank (SGLang's neither); not supported"
            )
        self.storage_config = cfg
        self.config: MooncakeStoreConfig = load_mooncake_config(extra)
        self.names = ObjectNames.for_config(cfg, extra.get("extra_backend_tag"))
        self.is_writer = cfg.is_storage_writer
        self.group_semantics = _as_bool(extra.get("enable_group_semantics", False),
                                        "enable_group_semantics")  # fmt: skip
        self.segment_bytes = self.config.global_segment_size // (cfg.tp_size * cfg.pp_size)
        device = device_for_rank(self.config.device_name, cfg.tp_rank,
                                 self.config.source("device_name"))  # fmt: skip
        self.client: MooncakeClient = open_client(
            self.config, device_name=device, segment_bytes=self.segment_bytes,
            ssd_offload_path=self._ssd_path(cfg), factory=type(self).store_factory,
        )  # fmt: skip
        self._replicate_config = self._group_config_class() if self.group_semantics else None
        self.counters = MooncakeCounters()
        self._object_sizes: list[int] = []
        self._unhealthy_since: float | None = None
        self._warned_size = False
        self._health_lock = threading.Lock()
        logger.info(
            "MooncakeStore rank %d/%d: master %s (%s), segment %d MiB, protocol %s, names "
            "%s<key>%s", cfg.tp_rank, cfg.tp_size, self.config.master_server_address,
            self.config.source("master_server_address"), self.segment_bytes >> 20,
            self.config.protocol, (self.names.prefix + "_") if self.names.prefix else "",
            "|".join(self.names.suffixes),
        )  # fmt: skip

    def _ssd_path(self, cfg: HiCacheStorageConfig) -> str | None:
        """SGLang's per-rank subfolder of ``ssd_offload_path`` (ranks must not share one)."""
        base = self.config.ssd_offload_path
        if base is None:
            return None
        path = os.path.join(base, f"rank_{cfg.dp_rank}_{cfg.tp_rank}_{cfg.pp_rank}"
                                  f"_{cfg.attn_cp_rank}")  # fmt: skip
        try:
            os.makedirs(path, exist_ok=True)
        except OSError as e:
            raise ValueError(f"{self.config.source('ssd_offload_path')}={base!r}: {e}") from e
        return path

    def _group_config_class(self) -> Any:
        """``ReplicateConfig`` when this Mooncake knows ``group_ids``, else ``None`` (warned)."""
        try:
            from mooncake.store import ReplicateConfig
        except ImportError:
            return None
        if not hasattr(ReplicateConfig(), "group_ids"):
            logger.warning("enable_group_semantics: this Mooncake has no ReplicateConfig."
                           "group_ids; objects are put without groups")  # fmt: skip
            return None
        return ReplicateConfig

    # ------------------------------------------------------------------ host pool
    def register_mem_pool_host(self, mem_pool_host: Any) -> None:
        """Register the host pool's buffers with Mooncake (zero copy). ``ValueError`` for a
        ``layer_first`` pool (one object per part needs each part's page contiguous) or when
        Mooncake refuses a buffer."""
        layout = getattr(mem_pool_host, "layout", None)
        if layout == "layer_first":
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
        self.client.register(mem_pool_host.page_regions())
        super().register_mem_pool_host(mem_pool_host)
        self._object_sizes = list(sizes)

    def _meta(self, keys: list[str], host_indices: torch.Tensor, call: str) -> _Meta | None:
        """Object names, addresses and sizes of ``keys``' pages at ``host_indices``; ``None``
        (logged) when the counts disagree (SGLang answers all ``False``)."""
        pool = self._v1_pool()
        for key in keys:
            if not isinstance(key, str) or not key:
                raise ValueError(f"{call}: storage keys must be non-empty strings, got {key!r}")
        n = int(host_indices.numel()) if isinstance(host_indices, torch.Tensor) else -1
        if n != len(keys) * pool.page_size:
            logger.error("%s: %d keys need %d host indices, got %d", call, len(keys),
                         len(keys) * pool.page_size, n)  # fmt: skip
            return None
        ptrs, sizes = pool.get_page_buffer_meta(host_indices)
        return keys, self.names.objects(keys), ptrs, sizes

    # ------------------------------------------------------------------ health
    def _healthy(self, n_objects: int) -> bool:
        """Whether Mooncake's master is reachable now; a call is skipped (counted) if not."""
        state = self.client.health()
        with self._health_lock:
            if state == HEALTHY:
                if self._unhealthy_since is not None:
                    logger.warning("Mooncake master %s reachable again after %.1f s",
                                   self.config.master_server_address,
                                   time.monotonic() - self._unhealthy_since)  # fmt: skip
                    self._unhealthy_since = None
                return True
            if self._unhealthy_since is None:
                self._unhealthy_since = time.monotonic()
                logger.warning("Mooncake health_check=%d (master %s unreachable or client "
                               "closed): storage calls answer as failures until it is back",
                               state, self.config.master_server_address)  # fmt: skip
        self.counters.add(skipped_unhealthy=1)
        return False

    def _codes(self, name: str, result: Any, n: int) -> list[int]:
        """``result`` as ``n`` return codes (a missing or malformed answer: ``n`` failures)."""
        if isinstance(result, list) and len(result) == n:
            return [int(r) for r in result]
        if result is None:
            self.counters.add(call_errors=1)
        else:
            logger.warning("Mooncake %s answered %r for %d objects", name, result, n)
            code = result[0] if isinstance(result, list) and result else -1
            return [int(code)] * n
        return [-1] * n

    def _per_page(self, ok: list[bool]) -> list[bool]:
        k = self.names.per_page
        return [all(ok[i : i + k]) for i in range(0, len(ok), k)]

    # ------------------------------------------------------------------ existence
    def _exists(self, names: list[str]) -> list[int]:
        """``batch_is_exist`` of ``names`` (1 exists, 0 not, < 0 error)."""
        self.counters.add(exists_queries=1)
        return self._codes("batch_is_exist", self.client.call("batch_is_exist", names),
                           len(names))  # fmt: skip

    def batch_exists(
        self, keys: list[str], extra_info: HiCacheStorageExtraInfo | None = None
    ) -> int:
        """How many of ``keys``' pages, from the first, have every object in the store."""
        if not keys:
            return 0
        names = self.names.objects(keys)
        if not self._healthy(len(names)):
            return 0
        pages = self._per_page([r == 1 for r in self._exists(names)])
        return next((i for i, ok in enumerate(pages) if not ok), len(pages))

    def exists(self, key: str) -> bool:
        return self.batch_exists([key]) == 1

    # ------------------------------------------------------------------ reads
    def _read(
        self, keys: list[str], names: list[str], ptrs: list[int], sizes: list[int]
    ) -> list[bool]:
        if not self._healthy(len(names)):
            return [False] * (len(names) // self.names.per_page)
        rcs = self._codes("batch_get_into",
                          self.client.call("batch_get_into", names, ptrs, sizes), len(names))
        ok = []
        for rc, size in zip(rcs, sizes, strict=True):
            if rc == size:
                ok.append(True)
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
                    "it its own extra_backend_tag. Those pages are misses.", rc, size,
                )  # fmt: skip
        pages = self._per_page(ok)
        good = sum(pages)
        self.counters.add(pages_read=good, pages_read_failed=len(pages) - good,
                          bytes_read=sum(s for s, o in zip(sizes, ok, strict=True) if o))
        return pages

    def batch_get_v1(
        self,
        keys: list[str],
        host_indices: torch.Tensor,
        extra_info: HiCacheStorageExtraInfo | None = None,
    ) -> list[bool]:
        """Read each page straight into its host slots; one ``bool`` per key (module
        docstring)."""
        if not keys:
            return []
        meta = self._meta(keys, host_indices, "batch_get_v1")
        return [False] * len(keys) if meta is None else self._read(*meta)

    def get(
        self, key: str, target_location: Any | None = None, target_sizes: Any | None = None
    ) -> torch.Tensor | None:
        """Read ``key``'s page into ``target_location`` (a contiguous CPU tensor of one flat
        page, as ``get_dummy_flat_data_page`` makes); that tensor, or ``None``."""
        ok = self._read(*self._flat_meta(key, target_location, "get"))[0]
        return target_location if ok else None

    def _flat_meta(self, key: str, page: Any, call: str) -> _Meta:
        """Object names, addresses and sizes of one flat page tensor (parts back to back)."""
        if not self._object_sizes:
            raise ValueError(f"MooncakeStore.{call}: register_mem_pool_host first")
        if not isinstance(page, torch.Tensor) or page.device.type != "cpu" or not (
            page.is_contiguous()
        ):
            raise ValueError(f"MooncakeStore.{call}: the page must be a contiguous CPU tensor")
        if page.numel() * page.element_size() != sum(self._object_sizes):
            raise ValueError(f"MooncakeStore.{call}: the page must hold "
                             f"{sum(self._object_sizes)} bytes")  # fmt: skip
        if not isinstance(key, str) or not key:
            raise ValueError(f"MooncakeStore.{call}: the key must be a non-empty string")
        base, ptrs = page.data_ptr(), []
        for size in self._object_sizes:
            ptrs.append(base)
            base += size
        return [key], self.names.objects([key]), ptrs, list(self._object_sizes)

    # ------------------------------------------------------------------ writes
    def _write(
        self, keys: list[str], names: list[str], ptrs: list[int], sizes: list[int]
    ) -> list[bool]:
        n_pages = len(names) // self.names.per_page
        if not self._healthy(len(names)):
            return [False] * n_pages
        present = [r == 1 for r in self._exists(names)]
        if not self.is_writer:  # MLA, rank > 0: rank 0 stores the page for every rank
            return self._per_page(present)
        missing = [i for i, p in enumerate(present) if not p]
        ok = list(present)
        if missing:
            put = ([names[i] for i in missing], [ptrs[i] for i in missing],
                   [sizes[i] for i in missing])  # fmt: skip
            args: tuple[Any, ...] = put
            if self._replicate_config is not None:
                rc_config = self._replicate_config()
                groups = [f"sglang-hicache:{self.names.tagged(k)}" for k in keys
                          for _ in self.names.suffixes]  # fmt: skip
                rc_config.group_ids = [groups[i] for i in missing]
                args = (*put, rc_config)
            rcs = self._codes("batch_put_from", self.client.call("batch_put_from", *args),
                              len(missing))  # fmt: skip
            for i, rc in zip(missing, rcs, strict=True):
                ok[i] = rc == 0
                if rc != 0:
                    self.counters.error(error_name(rc))
            written = [i for i, rc in zip(missing, rcs, strict=True) if rc == 0]
            self.counters.add(objects_written=len(written),
                              bytes_written=sum(sizes[i] for i in written))  # fmt: skip
        pages = self._per_page(ok)
        good = sum(pages)
        self.counters.add(objects_already_stored=sum(present), pages_stored=good,
                          pages_store_failed=n_pages - good)  # fmt: skip
        return pages

    def batch_set_v1(
        self,
        keys: list[str],
        host_indices: torch.Tensor,
        extra_info: HiCacheStorageExtraInfo | None = None,
    ) -> list[bool]:
        """Store each page straight from its host slots, putting only the objects the store
        lacks; one ``bool`` per key (module docstring)."""
        if not keys:
            return []
        meta = self._meta(keys, host_indices, "batch_set_v1")
        return [False] * len(keys) if meta is None else self._write(*meta)

    def set(
        self,
        key: str,
        value: Any | None = None,
        target_location: Any | None = None,
        target_sizes: Any | None = None,
    ) -> bool:
        """Store ``value`` (one flat page, a contiguous CPU tensor) under ``key``."""
        return self._write(*self._flat_meta(key, value, "set"))[0]

    # ------------------------------------------------------------------ housekeeping
    def clear(self) -> bool:
        """SGLang's ``clear``: ``remove_all()`` of the whole store (every instance's objects;
        objects read in the last lease period, 10 s by default, stay)."""
        removed = self.client.call("remove_all")
        logger.info("MooncakeStore.clear removed %s objects", removed)
        return isinstance(removed, int) and removed >= 0

    def get_stats(self) -> MooncakeStoreStats:
        return self.counters.snapshot()

    def close(self) -> None:
        """Close the client after the calls in flight (idempotent). The objects in this
        process's segment leave the store with it."""
        self.client.close()


def _as_bool(value: Any, key: str) -> bool:
    if isinstance(value, bool):
        return value
    raise ValueError(f"extra config key {key!r} ({FLAG}) must be true or false, got {value!r}")
