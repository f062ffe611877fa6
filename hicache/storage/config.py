"""``HiCacheStorageConfig``: what every storage backend is built from (SGLang 0.5.23's fields, in
its order), plus ``format_tag`` (``None``: SGLang's untagged names and unchecked pages);
``storage_config_for_pool``; ``as_extra_config`` and ``parse_size``, the one size grammar of every
backend setting. Bad values raise ``ValueError`` naming the field.
"""

from __future__ import annotations

import math
import re
from collections.abc import Mapping
from dataclasses import dataclass
from decimal import Decimal
from typing import Any

from hicache_prefill.hicache.storage.format_tag import (
    AUTO,
    FORMAT_TAG_KEY,
    resolve_format_tag,
    tagged_model_name,
)

FLAG = "--hicache-storage-backend-extra-config"

_SIZE_RE = re.compile(r"(\d+(?:\.\d+)?)\s*(?:([kmgt])(ib|i|b)?)?", re.IGNORECASE)
_POWERS = {"k": 1, "m": 2, "g": 3, "t": 4}


def as_extra_config(extra_config: Any) -> dict:
    if extra_config is None:
        return {}
    if not isinstance(extra_config, Mapping):
        raise ValueError(f"{FLAG} must be a JSON object, got {type(extra_config).__name__}")
    return dict(extra_config)


def parse_size(value: Any, name: str) -> int:
    """Bytes of a size setting: a non-negative number, or a string with an optional unit
    (case-insensitive). ``K``/``M``/``G``/``T`` are powers of 1000 (SGLang's
    ``human_readable_int``, decimals allowed: ``"25.6k"``); with ``B`` (SGLang Mooncake's
    ``"4gb"``) or ``i``/``iB`` powers of 1024, integers only."""
    if isinstance(value, bool) or not isinstance(value, int | float | str):
        raise ValueError(f"{name} must be a size (bytes or e.g. '200G', '4GB'), got {value!r}")
    if isinstance(value, int | float):
        if not math.isfinite(value) or value < 0:
            raise ValueError(f"{name} must be a non-negative size, got {value!r}")
        return int(value)
    match = _SIZE_RE.fullmatch(value.strip())
    if match is None:
        raise ValueError(
            f"{name}={value!r} is not a size: use bytes or a unit (200G, 25.6k, 4GB, 1Gi, 512MiB)"
        )
    number, unit, binary = match.groups()
    if unit is None:
        if "." in number:
            raise ValueError(f"{name}={value!r}: a size without a unit is a whole number of bytes")
        return int(number)
    power = _POWERS[unit.lower()]
    if binary is None:
        return int(Decimal(number) * 1000**power)
    if "." in number:
        raise ValueError(f"{name}={value!r}: binary units (KB, KiB, ...) take integers only")
    return int(number) * 1024**power


def _check_rank(rank: Any, size: Any, rank_name: str, size_name: str) -> None:
    for name, value in ((rank_name, rank), (size_name, size)):
        if isinstance(value, bool) or not isinstance(value, int):
            raise ValueError(f"{name} must be an int, got {value!r}")
    if size < 1 or not 0 <= rank < size:
        raise ValueError(f"{rank_name}={rank} must be in [0, {size_name}={size})")


@dataclass
class HiCacheStorageConfig:
    """``should_split_heads`` must stay ``False`` and ``dcp_size`` 1 (SGLang's attributes)."""

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
    """As SGLang's controller builds it from the pool (an MLA pool has ``kv_cache_dim``), with
    ``model_name`` tagged by the page format; ``storage_format_tag`` is consumed here."""
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


def as_storage_config(config: Any) -> HiCacheStorageConfig:
    """This project's config for ``config``: itself, or one made from another class with
    SGLang's fields (SGLang's ``HiCacheStorageConfig``, as SGLang's controller and factory build
    it). SGLang's controller has already put its host pool's tag in the model name (SGLang's
    ``storage_model_name``; its MHA / MLA host pools carry none), so the extra-config key
    ``storage_format_tag`` absent, ``"auto"`` or ``"none"`` keeps that name and SGLang's
    unchecked page bytes; another string appends ``-{tag}`` and turns the integrity footer on."""
    if isinstance(config, HiCacheStorageConfig):
        return config
    extra = as_extra_config(getattr(config, "extra_config", None))
    setting = extra.pop(FORMAT_TAG_KEY, AUTO)
    tag = None if setting == AUTO else resolve_format_tag(setting, None)
    model = config.model_name
    if tag is not None:
        model = f"{model}-{tag}" if model else tag
    return HiCacheStorageConfig(
        tp_rank=config.tp_rank,
        tp_size=config.tp_size,
        pp_rank=config.pp_rank,
        pp_size=config.pp_size,
        attn_cp_rank=config.attn_cp_rank,
        attn_cp_size=config.attn_cp_size,
        is_mla_model=bool(config.is_mla_model),
        enable_storage_metrics=bool(config.enable_storage_metrics),
        is_page_first_layout=bool(config.is_page_first_layout),
        model_name=model,
        tp_lcm_size=getattr(config, "tp_lcm_size", None),
        should_split_heads=bool(getattr(config, "should_split_heads", False)),
        dp_rank=getattr(config, "dp_rank", 0),
        extra_config=extra,
        dcp_size=getattr(config, "dcp_size", 1),
        dcp_rank=getattr(config, "dcp_rank", 0),
        logical_page_size=getattr(config, "logical_page_size", None),
        format_tag=tag,
    )
