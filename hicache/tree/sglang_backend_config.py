"""What the SGLang radix-cache backend reads of SGLang 0.5.23's server arguments: the modes it
refuses (each named by its flag), the tree options it builds from and, under
``--hicache-storage-backend``, the L3 settings (:class:`StorageArgs`, what the project's
``build_storage_controller`` reads). Plain attribute reads, so this runs without SGLang."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from hicache_prefill.hicache.tree.hiradix_cache import WRITE_POLICIES

BACKEND_NAME = "hicache_prefill"
STORAGE_BACKENDS = ("file", "mooncake")
"""L3 backends the tree's storage tier builds by name from SGLang's flags."""

# (attribute, refused when, the flag and why); checked in this order, all reported at once.
_REFUSED_FLAGS: tuple[tuple[str, Any, str], ...] = (
    ("disable_radix_cache", True, "--disable-radix-cache: no prefix cache to replace"),
    (
        "hicache_host_memory_mode",
        "buffer_only",
        "--hicache-host-memory-mode buffer_only: SGLang serves it from the unified tree only",
    ),
    (
        "enable_session_radix_cache",
        True,
        "--enable-session-radix-cache: sessions live in SGLang's unified tree",
    ),
    (
        "enable_streaming_session",
        True,
        "--enable-streaming-session: streaming sessions live in SGLang's unified tree",
    ),
    ("enable_lmcache", True, "--enable-lmcache: LMCache replaces the tree"),
    ("enable_flexkv", True, "--enable-flexkv: FlexKV replaces the tree"),
    (
        "enable_unified_cache_external_linker",
        True,
        "--enable-unified-cache-external-linker: the linker attaches to the unified tree",
    ),
    (
        "disaggregation_decode_retraction_backup",
        "host_pool",
        "--disaggregation-decode-retraction-backup host_pool: retraction backups are the unified "
        "tree's",
    ),
    ("enable_hisparse", True, "--enable-hisparse: hierarchical sparse attention is not modelled"),
)


@dataclass(frozen=True)
class BackendOptions:
    """The tree the backend builds: device only, or with the L2 host tier (and L3)."""

    page_size: int
    hierarchical: bool
    write_policy: str
    io_backend: str
    mem_layout: str
    hicache_ratio: float
    hicache_size: float
    storage_backend: str | None


def refusals(
    args: Any, *, is_hybrid_swa: bool = False, is_hybrid_ssm: bool = False, is_dsa: bool = False
) -> list[str]:
    """Every mode of ``args`` (SGLang's ``ServerArgs``) and of the model the backend cannot
    serve, each as 'flag: reason' (empty: it can)."""
    out = []
    if is_hybrid_swa:
        out.append("a sliding-window (SWA) model: hybrid SWA pools need SGLang's unified tree")
    if is_hybrid_ssm:
        out.append("a mamba / linear-attention model: mamba state lives in SGLang's unified tree")
    if is_dsa:
        out.append("a DSA (sparse attention) model: its indexer pool is the unified tree's")
    for name, refused, why in _REFUSED_FLAGS:
        if getattr(args, name, None) == refused:
            out.append(why)
    policy = getattr(args, "radix_eviction_policy", "lru")
    if policy not in (None, "lru"):
        out.append(f"--radix-eviction-policy {policy}: this tree evicts in LRU order only")
    spec = getattr(args, "speculative_algorithm", None)
    if spec is not None:
        out.append(f"--speculative-algorithm {spec}: bigram (EAGLE) keys are not supported")
    for name, flag in (("pp_size", "--pp-size"), ("dcp_size", "--dcp-size")):
        value = getattr(args, name, 1)
        if value not in (None, 1):
            out.append(f"{flag} {value}: one pipeline stage and no decode context parallelism")
    if getattr(args, "enable_hierarchical_cache", False):
        policy = getattr(args, "hicache_write_policy", "write_through")
        if policy not in WRITE_POLICIES:
            out.append(f"--hicache-write-policy {policy}: one of {', '.join(WRITE_POLICIES)}")
        storage = getattr(args, "hicache_storage_backend", None)
        if storage == "dynamic":
            out.append(
                "--hicache-storage-backend dynamic: the tree's L3 tier builds file or mooncake "
                "by name; register a class under one of those names instead"
            )
        elif storage is not None and storage not in STORAGE_BACKENDS:
            out.append(f"--hicache-storage-backend {storage}: one of {', '.join(STORAGE_BACKENDS)}")
    return out


def backend_options(args: Any, page_size: int) -> BackendOptions:
    """The tree options ``args`` (SGLang's ``ServerArgs``) select, with the tree's page size."""
    if isinstance(page_size, bool) or not isinstance(page_size, int) or page_size < 1:
        raise ValueError(f"page_size must be a positive int, got {page_size!r}")
    return BackendOptions(
        page_size=page_size,
        hierarchical=bool(getattr(args, "enable_hierarchical_cache", False)),
        write_policy=getattr(args, "hicache_write_policy", None) or "write_through",
        io_backend=getattr(args, "hicache_io_backend", None) or "kernel",
        mem_layout=getattr(args, "hicache_mem_layout", None) or "layer_first",
        hicache_ratio=float(getattr(args, "hicache_ratio", None) or 2.0),
        hicache_size=float(getattr(args, "hicache_size", 0) or 0),
        storage_backend=getattr(args, "hicache_storage_backend", None),
    )


@dataclass(frozen=True)
class StorageArgs:
    """The L3 settings of SGLang's ``ServerArgs`` under the names the project's
    ``build_storage_controller`` reads (the project's ``ServerArgs`` has the same)."""

    hicache_storage_backend: str
    page_size: int
    hicache_storage_prefetch_policy: str
    hicache_host_memory_mode: str
    hicache_storage_backend_extra_config: Any
    served_model_name: str | None

    @classmethod
    def from_server_args(cls, args: Any, page_size: int) -> StorageArgs:
        backend = getattr(args, "hicache_storage_backend", None)
        if backend not in STORAGE_BACKENDS:
            raise ValueError(
                f"--hicache-storage-backend {backend}: one of {', '.join(STORAGE_BACKENDS)}"
            )
        return cls(
            hicache_storage_backend=backend,
            page_size=page_size,
            hicache_storage_prefetch_policy=getattr(args, "hicache_storage_prefetch_policy", None)
            or "timeout",
            hicache_host_memory_mode=getattr(args, "hicache_host_memory_mode", None) or "cache",
            hicache_storage_backend_extra_config=getattr(
                args, "hicache_storage_backend_extra_config", None
            ),
            served_model_name=getattr(args, "served_model_name", None)
            or getattr(args, "model_path", None),
        )

    def storage_extra_config(self) -> dict[str, Any]:
        """``--hicache-storage-backend-extra-config``: JSON, or ``@file`` (as SGLang reads it)."""
        from hicache_prefill.server_args import parse_extra_config

        return parse_extra_config(self.hicache_storage_backend_extra_config)

    def storage_model_name(self) -> str | None:
        """SGLang's ``served_model_name`` (its ``model_path`` by default), the model part of the
        L3 keys, as SGLang's controller names pages."""
        return self.served_model_name
