"""The KV cache's counters (:class:`CacheStats`). Prefix hits are recorded once per admitted
attempt (never by ``match_prefix``); the tree records backups, loads and evictions, the controller
bytes and copy time at each ack.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

DIRECTIONS = ("d2h", "h2d")


@dataclass
class CacheStats:
    """Counters since construction. Bytes are K and V of all layers; copy time runs from a copy's
    start event to its finish event (on CPU streams with queueing and injected delay).

    ``matched_attempts`` counts a request that yields and retries again. A host hit recomputed
    (e.g. below ``load_back_threshold``) is not a hit; ``storage_hit_tokens`` are the host hits
    fetched from L3. ``load_back_no_room_tokens``: host hits recomputed for want of device room.
    Failed copies move no bytes and no time."""

    matched_attempts: int = 0
    device_hit_tokens: int = 0
    host_hit_tokens: int = 0
    storage_hit_tokens: int = 0
    backed_up_tokens: int = 0
    loaded_tokens: int = 0
    load_back_no_room_tokens: int = 0
    evicted_device_tokens: int = 0
    evicted_host_tokens: int = 0
    d2h_copies: int = 0
    h2d_copies: int = 0
    d2h_bytes: int = 0
    h2d_bytes: int = 0
    d2h_copy_time_s: float = 0.0
    h2d_copy_time_s: float = 0.0
    d2h_failed_copies: int = 0
    h2d_failed_copies: int = 0

    def record_match(
        self, device_hit_tokens: int, host_hit_tokens: int, storage_hit_tokens: int = 0
    ) -> None:
        self.matched_attempts += 1
        self.device_hit_tokens += device_hit_tokens
        self.host_hit_tokens += host_hit_tokens
        self.storage_hit_tokens += storage_hit_tokens

    def record_backup(self, tokens: int) -> None:
        self.backed_up_tokens += tokens

    def record_load(self, tokens: int) -> None:
        self.loaded_tokens += tokens

    def record_load_back_no_room(self, tokens: int) -> None:
        self.load_back_no_room_tokens += tokens

    def record_evict_device(self, tokens: int) -> None:
        self.evicted_device_tokens += tokens

    def record_evict_host(self, tokens: int) -> None:
        self.evicted_host_tokens += tokens

    def record_copy(self, direction: str, nbytes: int, seconds: float) -> None:
        for counter, amount in (("copies", 1), ("bytes", nbytes), ("copy_time_s", seconds)):
            self._add(direction, counter, amount)

    def record_copy_failure(self, direction: str) -> None:
        self._add(direction, "failed_copies", 1)

    def _add(self, direction: str, counter: str, amount: float) -> None:
        if direction not in DIRECTIONS:
            raise ValueError(f"direction must be one of {DIRECTIONS}, got {direction!r}")
        name = f"{direction}_{counter}"
        setattr(self, name, getattr(self, name) + amount)

    def as_dict(self) -> dict[str, int | float]:
        """Every counter plus derived bandwidths (GB/s, 0 when no time was recorded)."""
        out: dict[str, int | float] = dataclasses.asdict(self)
        for d in DIRECTIONS:
            secs = getattr(self, f"{d}_copy_time_s")
            out[f"{d}_gbps"] = getattr(self, f"{d}_bytes") / secs / 1e9 if secs else 0.0
        return out
