"""``StorageSettings``: how the controller runs the storage tier (SGLang 0.5.23's names and
defaults), and ``split_extra_config``, which takes the controller's keys out of the extra config
(``--hicache-storage-backend-extra-config``) before the rest goes to the backend, as SGLang's
``parse_storage_backend_extra_config`` does.

| setting | where | default |
|---|---|---|
| ``prefetch_policy`` | ``--hicache-storage-prefetch-policy`` | ``timeout`` |
| ``prefetch_threshold`` | extra config (int, tokens) | 256, raised to at least one page |
| ``prefetch_timeout_base`` | extra config (seconds) | 1.0 |
| ``prefetch_timeout_per_ki_token`` | extra config (seconds per 1024 tokens) | 0.25 |
| ``hicache_storage_pass_prefix_keys`` | extra config (bool) | False |
| ``host_memory_mode`` | ``--hicache-host-memory-mode`` | ``cache`` |

A prefetch that waits under ``timeout`` waits at most ``prefetch_timeout_base + pages *
page_size / 1024 * prefetch_timeout_per_ki_token`` seconds of the executor's clock after its
first blocked admission poll. Prefetch capacity (SGLang's): in ``cache`` mode prefetches may
reserve up to half the host pool's tokens; in ``buffer_only`` mode new prefetches are declined
while the host pool, less write staging, is 90% used. Bad values raise ``ValueError`` naming the
key and the flag.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Any

from hicache.storage.config import FLAG, as_extra_config

logger = logging.getLogger(__name__)

PREFETCH_POLICIES = ("best_effort", "wait_complete", "timeout")
HOST_MEMORY_MODES = ("cache", "buffer_only")
CACHE_PREFETCH_CAPACITY_FRACTION = 0.5
BUFFER_PREFETCH_CAPACITY_FRACTION = 0.9  # SGLang HICACHE_LOAD_POOL_USAGE_FRACTION

_DEFAULTS: dict[str, Any] = {
    "prefetch_threshold": 256,
    "prefetch_timeout_base": 1.0,
    "prefetch_timeout_per_ki_token": 0.25,
    "hicache_storage_pass_prefix_keys": False,
}


@dataclass(frozen=True)
class StorageSettings:
    """See the module docstring."""

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
        """The wait budget of a prefetch of ``requested_tokens`` (page-aligned) tokens."""
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
    """``(settings, what the backend gets)``: the controller's keys (module docstring) are
    type-checked and removed; the rest is returned untouched."""
    extra = as_extra_config(extra_config)
    values = {
        name: _number(name, extra.pop(name), type(default)) if name in extra else default
        for name, default in _DEFAULTS.items()
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
