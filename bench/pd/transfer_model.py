"""The transfer cost ``bench.pd`` measures, as the simulated decode peer's transfer model: what
feeds the virtual clock of the deterministic benchmarks (``python -m bench.optimistic
--transfer-model results/bench_pd.json``).

The simulated peer charges each send ``transfer_latency_s + bytes / transfer_bandwidth``
(``prefill.disagg.sim_config.PeerConfig``); Mooncake costs a fixed time per item plus bytes over a
bandwidth (the fit of ``bench.pd.engine_rate``), and a send carries ``items_per_send`` items (one
per layer buffer and run of pages contiguous on both sides), so a send's latency is
``items_per_send * latency_per_item_s``.
"""

from __future__ import annotations

import json
import logging
import math
from pathlib import Path
from typing import Any

logger = logging.getLogger(__name__)


def virtual_clock_fields(model: dict[str, Any], row: dict[str, Any]) -> dict[str, Any]:
    """The simulated decode peer's transfer fields (``ServerArgs`` names) from the fitted
    per-item cost ``model`` and the items a send of a run's workload carried (``row``):
    ``disaggregation_transfer_latency_s = items_per_send * latency_per_item_s``,
    ``disaggregation_transfer_bandwidth_gbps = bandwidth / 1e9``."""
    lat, bw = model["latency_per_item_s"], model["bandwidth_Bps"]
    items = row["transfer_items_per_send"]
    return {
        "disaggregation_transfer_latency_s": None if lat is None else items * lat,
        "disaggregation_transfer_bandwidth_gbps": None if bw is None else bw / 1e9,
        "items_per_send": items, "bytes_per_send": row["sent_bytes_per_send"],
        "from": f"bench.pd optimistic row {row['config']!r} and the fitted transfer_model",
    }  # fmt: skip


def peer_transfer_kwargs(path: Path | str) -> dict[str, float]:
    """``PeerConfig`` keyword arguments (``transfer_latency_s``, ``transfer_bandwidth`` in bytes
    per second) from the ``virtual_clock_transfer`` section of a ``bench_pd.json`` at ``path``.

    Raises ``ValueError`` naming ``path`` when it is missing, not JSON, or has no usable
    section (a coefficient the fit could not give is left at the peer's default: no latency,
    infinite bandwidth)."""
    try:
        payload = json.loads(Path(path).read_text())
    except (OSError, ValueError) as e:
        raise ValueError(f"--transfer-model {path}: not a readable bench_pd.json ({e})") from None
    fields = payload.get("virtual_clock_transfer") if isinstance(payload, dict) else None
    if not isinstance(fields, dict):
        raise ValueError(f"--transfer-model {path}: no virtual_clock_transfer section "
                         "(written by python -m bench.pd)")  # fmt: skip
    lat = fields.get("disaggregation_transfer_latency_s")
    gbps = fields.get("disaggregation_transfer_bandwidth_gbps")
    out: dict[str, float] = {}
    if lat is not None:
        if not (isinstance(lat, (int, float)) and math.isfinite(lat) and lat >= 0):
            raise ValueError(f"--transfer-model {path}: latency {lat!r} is not a time >= 0")
        out["transfer_latency_s"] = float(lat)
    if gbps is not None:
        if not (isinstance(gbps, (int, float)) and math.isfinite(gbps) and gbps > 0):
            raise ValueError(f"--transfer-model {path}: bandwidth {gbps!r} GB/s is not > 0")
        out["transfer_bandwidth"] = float(gbps) * 1e9
    return out
