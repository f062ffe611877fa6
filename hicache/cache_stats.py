"""The KV cache's counters (:class:`CacheStats`), device-only or hierarchical, read by benches and
logs. Prefix hits are recorded by whoever admits a request, once per admitted attempt (never by
``match_prefix``, which also re-locks after inserts); the tree records backups, loads and
evictions, the controller bytes and copy time at each ack. Only the scheduler thread records.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

DIRECTIONS = ("d2h", "h2d")


@dataclass
class CacheStats:
    """Counters since construction or the last ``reset()``. Tokens are token slots; bytes are
    K and V of all layers; copy time is seconds from a copy's start event to its finish event
    (on CPU streams this includes queueing and any injected delay).

    ``matched_attempts``: admitted attempts that recorded their prefix hit (one per attempt, so a
    request that yields and retries counts again, its retry hitting what it inserted).
    ``device_hit_tokens`` / ``host_hit_tokens``: tokens those attempts reused from the device and
    loaded back from the host (a host hit recomputed, e.g. below ``load_back_threshold``, is not
    a hit); ``storage_hit_tokens``: of the host hits, tokens fetched from L3 storage for that
    attempt. ``load_back_no_room_tokens``: host hits recomputed because their load back found
    no device room even after device eviction (the rest of the pool locked by requests in
    flight). ``d2h_failed_copies`` / ``h2d_failed_copies``: copies whose launch failed or that
    failed while they ran (``hicache.transfer.errors``); they move no bytes and no time."""

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

    # --- recorders -----------------------------------------------------------------------------
    def record_match(
        self, device_hit_tokens: int, host_hit_tokens: int, storage_hit_tokens: int = 0
    ) -> None:
        """One admitted attempt's prefix: device-resident tokens reused, host tokens loaded back
        (``storage_hit_tokens`` of them fetched from L3 storage)."""
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
        """One completed copy: ``direction`` is ``"d2h"`` or ``"h2d"``."""
        if direction == "d2h":
            self.d2h_copies += 1
            self.d2h_bytes += nbytes
            self.d2h_copy_time_s += seconds
        elif direction == "h2d":
            self.h2d_copies += 1
            self.h2d_bytes += nbytes
            self.h2d_copy_time_s += seconds
        else:
            raise ValueError(f"direction must be one of {DIRECTIONS}, got {direction!r}")

    def record_copy_failure(self, direction: str) -> None:
        """One copy that failed (at its launch or while it ran)."""
        if direction not in DIRECTIONS:
            raise ValueError(f"direction must be one of {DIRECTIONS}, got {direction!r}")
        name = f"{direction}_failed_copies"
        setattr(self, name, getattr(self, name) + 1)

    # --- readers -------------------------------------------------------------------------------
    def as_dict(self) -> dict[str, int | float]:
        """Every counter plus derived bandwidths (GB/s, 0 when no time was recorded)."""
        out: dict[str, int | float] = dataclasses.asdict(self)
        for d in DIRECTIONS:
            secs = getattr(self, f"{d}_copy_time_s")
            out[f"{d}_gbps"] = getattr(self, f"{d}_bytes") / secs / 1e9 if secs else 0.0
        return out

    def reset(self) -> None:
        for f in dataclasses.fields(self):
            setattr(self, f.name, f.default)
