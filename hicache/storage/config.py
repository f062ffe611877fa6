"""``HiCacheStorageConfig``: what every storage backend is built from (SGLang 0.5.23's fields, in
its order, so backends written for SGLang read the same attributes), and
``storage_config_for_pool``, the config of one rank's host pool.

Fields:

- ``tp_rank``, ``tp_size``: the attention TP rank and size (file names and Mooncake keys carry
  them for MHA; an MLA page is the same on every rank).
- ``pp_rank``, ``pp_size``, ``attn_cp_rank``, ``attn_cp_size``: pipeline stage and attention
  context-parallel shard; they enter key names only when the size is above 1.
- ``is_mla_model``: SGLang's name for "rank-replicated KV" (MLA): one object per page for all
  ranks, written by rank 0 only (``is_storage_writer``).
- ``enable_storage_metrics``: whether the controller collects storage metrics.
- ``is_page_first_layout``: the host layout is ``page_first`` (SGLang's test; ``page_first_direct``
  is not).
- ``model_name``: the served model name, tagged with the page format (``format_tag``).
- ``tp_lcm_size``, ``should_split_heads``: SGLang's heterogeneous-TP head splitting, which needs
  the ``page_head`` layout; kept for attribute compatibility, and ``should_split_heads`` must stay
  ``False`` (no ``page_head`` here).
- ``dp_rank``: the data-parallel rank under DP attention.
- ``extra_config``: the backend's settings (``--hicache-storage-backend-extra-config``), a dict.
- ``dcp_size``, ``dcp_rank``, ``logical_page_size``: decode context parallelism (SGLang shards MLA
  pages over it); kept for compatibility, ``dcp_size`` must be 1.
- ``format_tag`` (not SGLang's): the page-format tag ``model_name`` carries, set by
  ``storage_config_for_pool``; ``None`` means SGLang's untagged names and, for ``HiCacheFile``,
  its pages without an integrity check.

Bad values raise ``ValueError`` naming the field.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Any

from hicache.storage.extra_config import as_extra_config
from hicache.storage.format_tag import AUTO, FORMAT_TAG_KEY, resolve_format_tag, tagged_model_name

logger = logging.getLogger(__name__)


def _check_rank(rank: Any, size: Any, rank_name: str, size_name: str) -> None:
    for name, value in ((rank_name, rank), (size_name, size)):
        if isinstance(value, bool) or not isinstance(value, int):
            raise ValueError(f"{name} must be an int, got {value!r}")
    if size < 1 or not 0 <= rank < size:
        raise ValueError(f"{rank_name}={rank} must be in [0, {size_name}={size})")


@dataclass
class HiCacheStorageConfig:
    """One rank's storage identity and backend settings (module docstring)."""

    tp_rank: int
    tp_size: int
    pp_rank: int = 0
    pp_size: int = 1
    attn_cp_rank: int = 0
    attn_cp_size: int = 1
    is_mla_model: bool = False
    enable_storage_metrics: bool = False
    is_page_first_layout: bool = False
    model_name: str | None = None
    tp_lcm_size: int | None = None
    should_split_heads: bool = False
    dp_rank: int = 0
    extra_config: dict | None = None
    dcp_size: int = 1
    dcp_rank: int = 0
    logical_page_size: int | None = None
    format_tag: str | None = None

    def __post_init__(self) -> None:
        _check_rank(self.tp_rank, self.tp_size, "tp_rank", "tp_size")
        _check_rank(self.pp_rank, self.pp_size, "pp_rank", "pp_size")
        _check_rank(self.attn_cp_rank, self.attn_cp_size, "attn_cp_rank", "attn_cp_size")
        for name in ("model_name", "format_tag"):
            if getattr(self, name) is not None and not isinstance(getattr(self, name), str):
                raise ValueError(f"{name} must be a str or None, got {getattr(self, name)!r}")
        if self.extra_config is not None:
            self.extra_config = as_extra_config(self.extra_config)
        if self.should_split_heads:
            raise ValueError("should_split_heads needs the page_head layout, not supported here")
        if self.dcp_size != 1 or self.dcp_rank != 0:
            raise ValueError(
                f"dcp_size={self.dcp_size}, dcp_rank={self.dcp_rank}: decode context "
                "parallelism is not supported here (dcp_size must be 1)"
            )

    @property
    def is_storage_writer(self) -> bool:
        """Whether this rank writes pages: every rank for MHA, rank 0 for MLA (SGLang)."""
        return not self.is_mla_model or self.tp_rank == self.dcp_rank


def storage_config_for_pool(
    host_pool: Any,
    model_name: str | None,
    *,
    tp_rank: int = 0,
    tp_size: int = 1,
    pp_rank: int = 0,
    pp_size: int = 1,
    extra_config: dict | None = None,
    enable_storage_metrics: bool = False,
    dp_rank: int = 0,
) -> HiCacheStorageConfig:
    """The config of ``host_pool``'s rank, as SGLang's controller builds it: ``is_mla_model`` from
    the pool's kind (an MLA pool has ``kv_cache_dim``), ``is_page_first_layout`` from its layout,
    ``model_name`` tagged with the page format (and that tag in ``format_tag``). The extra-config
    key ``storage_format_tag`` is consumed here (``format_tag`` module); the rest goes to the
    backend."""
    extra = as_extra_config(extra_config)
    setting = extra.pop(FORMAT_TAG_KEY, AUTO)
    tag = resolve_format_tag(setting, host_pool)
    return HiCacheStorageConfig(
        tp_rank=tp_rank,
        tp_size=tp_size,
        pp_rank=pp_rank,
        pp_size=pp_size,
        is_mla_model=hasattr(host_pool, "kv_cache_dim"),
        enable_storage_metrics=enable_storage_metrics,
        is_page_first_layout=getattr(host_pool, "layout", None) == "page_first",
        model_name=tagged_model_name(model_name, host_pool, setting),
        dp_rank=dp_rank,
        extra_config=extra,
        format_tag=tag,
    )
