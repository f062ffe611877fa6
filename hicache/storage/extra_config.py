"""The extra config (``--hicache-storage-backend-extra-config``) read into typed values: the
controller's ``StorageSettings`` (SGLang 0.5.23's keys and defaults) and the backends' readers
(extra-config key, then environment variable, then default). A malformed value raises a
``ValueError`` naming the key or variable, where SGLang warns and goes on.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from hicache_prefill.hicache.storage.config import FLAG, as_extra_config, parse_size

logger = logging.getLogger(__name__)

PREFETCH_POLICIES = ("best_effort", "wait_complete", "timeout")
HOST_MEMORY_MODES = ("cache", "buffer_only")
_CONTROLLER_DEFAULTS: dict[str, Any] = {
    "prefetch_threshold": 256,
    "prefetch_timeout_base": 1.0,
    "prefetch_timeout_per_ki_token": 0.25,
    "hicache_storage_pass_prefix_keys": False,
}


@dataclass(frozen=True)
class StorageSettings:
    """``prefetch_policy`` and ``host_memory_mode`` from their flags, the rest from the extra
    config."""

    prefetch_policy: str = "timeout"
    prefetch_threshold: int = 256
    prefetch_timeout_base: float = 1.0
    prefetch_timeout_per_ki_token: float = 0.25
    pass_prefix_keys: bool = False
    host_memory_mode: str = "cache"

    def __post_init__(self) -> None:
        if self.prefetch_policy not in PREFETCH_POLICIES:
            raise ValueError(
                f"--hicache-storage-prefetch-policy={self.prefetch_policy!r} is not one of "
                f"{', '.join(PREFETCH_POLICIES)}"
            )
        if self.host_memory_mode not in HOST_MEMORY_MODES:
            raise ValueError(
                f"--hicache-host-memory-mode={self.host_memory_mode!r} is not one of "
                f"{', '.join(HOST_MEMORY_MODES)}"
            )

    @property
    def buffer_only(self) -> bool:
        return self.host_memory_mode == "buffer_only"

    def timeout_s(self, requested_tokens: int, page_size: int) -> float:
        pages = requested_tokens // page_size
        return self.prefetch_timeout_base + pages * (
            page_size / 1024 * self.prefetch_timeout_per_ki_token
        )


def _number(name: str, value: Any, kind: type) -> Any:
    ok = isinstance(value, int | float) if kind is float else isinstance(value, kind)
    if isinstance(value, bool) and kind is not bool:
        ok = False
    if not ok:
        want = {int: "an integer", float: "a number", bool: "true or false"}[kind]
        raise ValueError(f"extra config key {name!r} ({FLAG}) must be {want}, got {value!r}")
    if kind in (int, float) and value < 0:
        raise ValueError(f"extra config key {name!r} ({FLAG}) must be >= 0, got {value!r}")
    return kind(value)


def split_extra_config(
    extra_config: Any,
    *,
    page_size: int,
    prefetch_policy: str = "timeout",
    host_memory_mode: str = "cache",
) -> tuple[StorageSettings, dict]:
    """``(settings, the rest for the backend)`` (SGLang's ``parse_storage_backend_extra_config``);
    ``prefetch_threshold`` is raised to at least one page."""
    extra = as_extra_config(extra_config)
    values = {
        name: _number(name, extra.pop(name), type(default)) if name in extra else default
        for name, default in _CONTROLLER_DEFAULTS.items()
    }
    threshold = max(values["prefetch_threshold"], page_size)
    if threshold != values["prefetch_threshold"]:
        logger.info("prefetch_threshold raised to one page (%d tokens)", threshold)
    settings = StorageSettings(
        prefetch_policy=prefetch_policy,
        prefetch_threshold=threshold,
        prefetch_timeout_base=values["prefetch_timeout_base"],
        prefetch_timeout_per_ki_token=values["prefetch_timeout_per_ki_token"],
        pass_prefix_keys=values["hicache_storage_pass_prefix_keys"],
        host_memory_mode=host_memory_mode,
    )
    return settings, extra


def _setting(extra: Mapping, key: str, env: str) -> tuple[Any, str] | None:
    if extra.get(key) is not None:
        return extra[key], f"extra config key {key!r} ({FLAG})"
    raw = os.environ.get(env)
    if raw is not None and raw != "":
        return raw, f"environment variable {env}"
    return None


def read_size(extra: Mapping, key: str, env: str, default: int = 0) -> int:
    """Bytes (0 = off)."""
    found = _setting(extra, key, env)
    return default if found is None else parse_size(*found)


def read_fraction(extra: Mapping, key: str, env: str, default: float) -> float:
    found = _setting(extra, key, env)
    if found is None:
        return default
    value, name = found
    try:
        if isinstance(value, bool):
            raise TypeError
        fraction = float(value)
    except (TypeError, ValueError):
        raise ValueError(f"{name} must be a number in (0, 1], got {value!r}") from None
    if not 0.0 < fraction <= 1.0:
        raise ValueError(f"{name} must be in (0, 1], got {value!r}")
    return fraction


def read_env_float(env: str) -> float | None:
    """``None`` when unset (SGLang's ``EnvFloat(None)``)."""
    raw = os.environ.get(env)
    if raw is None or raw == "":
        return None
    try:
        return float(raw)
    except ValueError:
        raise ValueError(f"environment variable {env}={raw!r} is not a number") from None
