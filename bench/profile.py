"""A GPU profile: what one GPU and model shape cost, as a small JSON the simulator charges.

A profile is either ``modelled`` (built from data-sheet figures, ``bench/profiles/*.json`` say
where each number comes from) or ``measured`` (written by ``bench/gpu_check.sh`` on a device).
Every cost is a function of tokens, so a run of the small CPU model can be charged as the
profile's model: a copy of ``n`` tokens costs ``latency + n * kv_bytes_per_token / bandwidth``.
"""

from __future__ import annotations

import json
import math
from dataclasses import asdict, dataclass, field
from pathlib import Path

__all__ = ["CopyPath", "ForwardCost", "GpuProfile", "PROFILE_DIR", "load_profile"]

PROFILE_DIR = Path(__file__).parent / "profiles"
KINDS = ("modelled", "measured")
COPY_PATHS = ("kernel", "copy_engine", "direct")


@dataclass(frozen=True)
class CopyPath:
    """A fixed cost per copy and a sustained bandwidth (``gbps``: 1e9 bytes per second)."""

    latency_s: float
    gbps: float

    def __post_init__(self) -> None:
        if not (math.isfinite(self.latency_s) and self.latency_s >= 0):
            raise ValueError(f"latency_s must be finite and >= 0, got {self.latency_s!r}")
        if not (math.isfinite(self.gbps) and self.gbps > 0):
            raise ValueError(f"gbps must be finite and > 0, got {self.gbps!r}")

    def seconds(self, nbytes: float) -> float:
        return self.latency_s + nbytes / (self.gbps * 1e9)


@dataclass(frozen=True)
class ForwardCost:
    """Seconds of one prefill forward, a roofline:
    ``base_s + max(floor_s, per_token_s * new + per_pair_s * pairs)``, where
    ``pairs = new * cached + new * (new + 1) / 2`` counts the attention's (query, key) pairs of
    ``new`` tokens over ``cached`` ones (causal) and ``floor_s`` is the weights' read from HBM."""

    base_s: float
    per_token_s: float
    per_pair_s: float
    floor_s: float = 0.0

    def seconds(self, new: int, cached: int) -> float:
        if new <= 0:
            return 0.0
        pairs = new * cached + new * (new + 1) / 2
        return self.base_s + max(self.floor_s, self.per_token_s * new + self.per_pair_s * pairs)


@dataclass(frozen=True)
class GpuProfile:
    """One GPU and model shape. ``h2d`` / ``d2h`` map a copy path (``COPY_PATHS``) to its
    cost; ``kv_transfer`` is the prefill-to-decode KV path; ``corun_slowdown`` the fraction a
    forward is slowed while a host copy runs beside it (``0.03``: 3% slower)."""

    name: str
    kind: str
    gpu: str
    model: str
    num_layers: int
    kv_bytes_per_token: int  # all layers
    forward: ForwardCost
    h2d: dict[str, CopyPath]
    d2h: dict[str, CopyPath]
    kv_transfer: CopyPath
    corun_slowdown: float
    sources: dict[str, str] = field(default_factory=dict)

    def __post_init__(self) -> None:
        if self.kind not in KINDS:
            raise ValueError(f"kind must be one of {KINDS}, got {self.kind!r}")
        for name, paths in (("h2d", self.h2d), ("d2h", self.d2h)):
            unknown = set(paths) - set(COPY_PATHS)
            if not paths or unknown:
                raise ValueError(f"{name}: copy paths must be among {COPY_PATHS}, got {paths}")
        if self.num_layers < 1 or self.kv_bytes_per_token < 1:
            raise ValueError("num_layers and kv_bytes_per_token must be >= 1")
        if not (math.isfinite(self.corun_slowdown) and self.corun_slowdown >= 0):
            raise ValueError(f"corun_slowdown must be finite and >= 0, got {self.corun_slowdown}")

    def forward_s(self, new: int, cached: int) -> float:
        """Seconds of a forward of ``new`` tokens over ``cached`` ones."""
        return self.forward.seconds(new, cached)

    def copy_s(self, direction: str, tokens: int, path: str = "kernel") -> float:
        """Seconds to copy ``tokens`` tokens of KV (all layers) ``h2d`` or ``d2h``."""
        paths = {"h2d": self.h2d, "d2h": self.d2h}[direction]
        cost = paths.get(path) or next(iter(paths.values()))
        return cost.seconds(tokens * self.kv_bytes_per_token)

    def transfer_s(self, tokens: int) -> float:
        """Seconds to send ``tokens`` tokens of KV to a decode instance."""
        return self.kv_transfer.seconds(tokens * self.kv_bytes_per_token)

    def to_json(self) -> dict:
        return asdict(self)

    @classmethod
    def from_json(cls, data: dict) -> GpuProfile:
        data = dict(data)
        data["forward"] = ForwardCost(**data["forward"])
        data["h2d"] = {k: CopyPath(**v) for k, v in data["h2d"].items()}
        data["d2h"] = {k: CopyPath(**v) for k, v in data["d2h"].items()}
        data["kv_transfer"] = CopyPath(**data["kv_transfer"])
        return cls(**data)

    def save(self, path: Path) -> None:
        path.write_text(json.dumps(self.to_json(), indent=2) + "\n")


def load_profile(name_or_path: str | Path) -> GpuProfile:
    """A profile by file path, or by name from ``bench/profiles`` (``h100``, ``h200``)."""
    path = Path(name_or_path)
    if not path.exists():
        path = PROFILE_DIR / f"{name_or_path}.json"
    if not path.exists():
        names = sorted(p.stem for p in PROFILE_DIR.glob("*.json"))
        raise ValueError(f"profile: {name_or_path!r} is neither a file nor one of {names}")
    return GpuProfile.from_json(json.loads(path.read_text()))
