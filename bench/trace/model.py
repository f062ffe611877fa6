"""TTFT of a replayed trace on one prefill GPU, modelled from a ``GpuProfile``.

One FIFO prefill server, whole requests. Request ``i`` arrives at ``scale * arrival_i``; its L3
pages are read (at ``l3_gbps``) from its arrival on, overlapping its wait in the queue; it starts
when the server is free and its L3 read is done; it holds the server for its load back
(``copy_s("h2d", host + L3 tokens)``, not overlapped with compute) plus its forward
(``forward_s(new, cached)``). TTFT = finish - arrival. ``time_scale`` picks the scale at which
the prefill work with no cache at all fills ``util`` of the scaled span, so every cache
configuration is a load the profile's GPU can serve.
"""

from __future__ import annotations

import numpy as np

from bench.profile import GpuProfile

UTIL = 0.8


def time_scale(arrival_s: np.ndarray, lengths: np.ndarray, profile: GpuProfile) -> float:
    busy = sum(profile.forward_s(int(n), 0) for n in lengths)
    span = float(arrival_s.max() - arrival_s.min())
    return busy / (UTIL * span) if span > 0 else 1.0


def ttft(
    arrival_s: np.ndarray,
    lengths: np.ndarray,
    hits: dict[str, np.ndarray],
    profile: GpuProfile,
    l3_gbps: float,
    scale: float,
) -> dict[str, float]:
    """Mean / P50 / P90 TTFT and mean prefill GPU time per request, in seconds."""
    free = 0.0
    out, gpu = np.empty(len(lengths)), np.empty(len(lengths))
    per_token = profile.kv_bytes_per_token / (l3_gbps * 1e9)
    for i, n in enumerate(lengths):
        dev, host, l3 = (int(hits[k][i]) for k in ("device", "host", "l3"))
        cached = dev + host + l3
        arrive = scale * float(arrival_s[i])
        load = profile.copy_s("h2d", host + l3) if host + l3 else 0.0
        gpu[i] = load + profile.forward_s(int(n) - cached, cached)
        free = max(free, arrive + l3 * per_token) + gpu[i]
        out[i] = free - arrive
    return {
        "ttft_mean_s": float(out.mean()),
        "ttft_p50_s": float(np.percentile(out, 50)),
        "ttft_p90_s": float(np.percentile(out, 90)),
        "prefill_gpu_mean_s": float(gpu.mean()),
    }
