"""The virtual clock's gap to the wall clock on the same workload, from two runs of an end-to-end
benchmark (issue 20's ``fidelity`` entries: ``virtual``, ``wall``, ``gap`` per headline ratio):
``python -m bench.gpu.fidelity WALL.json VIRTUAL.json OUT.json`` (``bench/gpu_check.sh`` runs it
on the multi-turn benchmark's ``multiturn.json`` of its wall-clock step and its virtual point).

``gap`` = virtual / wall - 1 (positive: the virtual clock flatters the configuration). A ratio
missing from either run (skipped for time) is reported as ``null`` with the reason.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

RATIOS = {"multiturn": "ttft_mean_speedup_vs_device_only", "optimistic": "ttft_mean_speedup_vs_0"}


def _configs(path: Path) -> tuple[str, dict[str, Any]]:
    """``(benchmark, {config: summary})`` of one result file (``multiturn.json`` /
    ``optimistic.json``)."""
    doc = json.loads(path.read_text())
    name = path.stem
    summary = doc.get("summary") or {}
    if name == "optimistic":
        summary = summary.get("optimistic", {})
    return name, {k: v for k, v in summary.items() if isinstance(v, dict) and RATIOS[name] in v}


def fidelity(wall: Path, virtual: Path) -> dict[str, dict[str, Any]]:
    """Per headline ratio of the benchmark: ``{"virtual", "wall", "gap"}``."""
    name, w = _configs(wall)
    _, v = _configs(virtual)
    key = RATIOS[name]
    out: dict[str, dict[str, Any]] = {}
    for config in sorted(set(w) | set(v)):
        wv, vv = w.get(config, {}).get(key), v.get(config, {}).get(key)
        if wv == 1.0 and vv == 1.0:  # the baseline itself
            continue
        entry: dict[str, Any] = {"virtual": vv, "wall": wv, "gap": None}
        if wv and vv:
            entry["gap"] = vv / wv - 1
        else:
            entry["note"] = "not measured on both clocks (skipped for time or not run)"
        out[f"{name}/{config}"] = entry
    return out


def main(argv: list[str] | None = None) -> int:
    args = sys.argv[1:] if argv is None else argv
    if len(args) != 3:
        print("usage: python -m bench.gpu.fidelity WALL.json VIRTUAL.json OUT.json")
        return 2
    wall, virtual, out = (Path(a) for a in args)
    missing = [str(p) for p in (wall, virtual) if not p.exists()]
    if missing:
        print(f"[fidelity] not computed: {', '.join(missing)} missing")
        return 1
    result = fidelity(wall, virtual)
    out.write_text(json.dumps({"fidelity": result}, indent=2))
    for name, e in result.items():
        gap = "-" if e["gap"] is None else f"{e['gap']:+.1%}"
        print(f"[fidelity] {name}: virtual {e['virtual']}, wall {e['wall']}, gap {gap}")
    print(f"[fidelity] wrote {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
