"""``calibration.json``: the calibrations a run measured (or replayed), one per benchmark, and
how ``--calibration FILE`` finds the one a benchmark replays.

File layout (JSON)::

    {"format": FILE_FORMAT, "benchmarks": {"multiturn": <Calibration.as_dict()>,
                                           "optimistic": ...}}

``write_calibration(out_dir, name, cal)`` merges ``name``'s entry into
``out_dir/calibration.json`` (entries of other benchmarks are kept; a file that is not one of
these is replaced). ``load_calibration(path, name, geometry)`` reads ``name``'s entry of such a
file (or a file holding one calibration alone) and refuses, with a ``ValueError`` naming the
difference, a calibration of another model geometry: its costs would say nothing about this
model.
"""

from __future__ import annotations

import json
import logging
from pathlib import Path
from typing import Any

from bench.clock.calibrate import Calibration

logger = logging.getLogger(__name__)

__all__ = ["FILE_FORMAT", "FILE_NAME", "load_calibration", "write_calibration"]

FILE_FORMAT = "hicache-bench-calibrations/1"
FILE_NAME = "calibration.json"


def _read(path: Path) -> dict[str, Any] | None:
    try:
        data = json.loads(Path(path).read_text())
    except (OSError, ValueError):
        return None
    return data if isinstance(data, dict) else None


def write_calibration(out_dir: Path, name: str, cal: Calibration) -> Path:
    """Merge ``name``'s calibration into ``out_dir/calibration.json``; returns the path."""
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    path = out_dir / FILE_NAME
    data = _read(path)
    if data is None or data.get("format") != FILE_FORMAT:
        data = {"format": FILE_FORMAT, "benchmarks": {}}
    data["benchmarks"][name] = cal.as_dict()
    path.write_text(json.dumps(data, indent=1, default=str))
    return path


def load_calibration(path: Path, name: str, geometry: dict[str, Any] | None = None) -> Calibration:
    """``name``'s calibration in ``path`` (see the module docstring)."""
    data = _read(path)
    if data is None:
        raise ValueError(f"--calibration {path}: not a readable JSON object")
    if data.get("format") == FILE_FORMAT:
        entries = data.get("benchmarks") or {}
        if name not in entries:
            raise ValueError(f"--calibration {path}: no calibration of {name!r} (it holds "
                             f"{sorted(entries) or 'none'})")  # fmt: skip
        entry = entries[name]
    else:
        entry = data
    cal = Calibration.from_dict(entry, source=str(path))
    if geometry:
        differ = {k: (cal.model.get(k), v) for k, v in geometry.items()
                  if k in cal.model and cal.model[k] != v}  # fmt: skip
        if differ:
            raise ValueError(f"--calibration {path}: measured on another model geometry "
                             f"(calibration, this run): {differ}")  # fmt: skip
    return cal
