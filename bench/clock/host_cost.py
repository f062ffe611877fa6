"""What the scheduler thread's host work costs on the virtual clock: one linear fit per phase of
a scheduler step (``bench.clock.host_meter`` names the phases, measures them and charges them).

A phase's cost is ``intercept_s + sum(slope[f] * x[f])`` over its features ``x`` (queue lengths,
tokens evicted, requests in the batch, ...), fitted by least squares on ``(features, measured
seconds)`` samples that ``HostMeter`` recorded over a calibration trace (``fit_host_costs``). A
slope that comes out negative is dropped and the rest refitted (host work never gets cheaper
with more of it), so a phase's mean cost over the samples is what was measured.

A stall (the process descheduled, a garbage collection, a page-fault storm) makes one call take
hundreds of times its fit; charged as a mean, one such sample would add milliseconds to every
call of its phase. After the fit, samples whose residual exceeds ``STALL_RESIDUALS`` robust
standard deviations of the residuals (1.4826 x their median absolute value, at least 1 us) are
dropped, at most ``STALL_SHARE`` of a phase's samples, and the phase refitted;
``PhaseFit.dropped`` counts them and ``mean_s`` / ``total_s`` stay those of every sample
measured.

The trace also times the cache's real copies, on wall-clock runs of its configurations
(``bench.clock.trace_copies``): ``copies`` holds their fits, which a measured calibration
charges instead of the copy ops timed alone (``bench.e2e.calibrated``): a copy job on the
cache's stream costs more than the bare op (index moves, the kernel's index record, the
stream's hand-off) and, on a CPU, runs beside the scheduler's own Python and the forward, which
it shares the interpreter and the cores with.
"""

from __future__ import annotations

import logging
import statistics
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from bench.clock.copy_fit import CopyFit

logger = logging.getLogger(__name__)

__all__ = ["HostCosts", "PhaseFit", "fit_host_costs", "fit_phase"]

STALL_RESIDUALS = 20.0
STALL_SHARE = 0.02

Sample = tuple[tuple[float, ...], float]
"""``(feature values, measured seconds)`` of one call of a phase."""


@dataclass(frozen=True)
class PhaseFit:
    """One phase: ``seconds(x) = max(0, intercept_s + sum(slopes[f] * x[f]))``."""

    intercept_s: float
    slopes: dict[str, float]
    samples: int = 0
    mean_s: float = 0.0  # measured mean over the samples
    total_s: float = 0.0  # measured total over the samples
    dropped: int = 0  # samples left out of the fit as stalls

    def seconds(self, x: dict[str, float]) -> float:
        t = self.intercept_s + sum(s * x.get(f, 0.0) for f, s in self.slopes.items())
        return max(t, 0.0)

    def as_dict(self) -> dict[str, Any]:
        return {"intercept_s": self.intercept_s, "slopes_s": self.slopes,
                "samples": self.samples, "mean_s": self.mean_s,
                "total_s": self.total_s, "dropped": self.dropped}  # fmt: skip

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> PhaseFit:
        return cls(float(d["intercept_s"]), {k: float(v) for k, v in d["slopes_s"].items()},
                   int(d.get("samples", 0)), float(d.get("mean_s", 0.0)),
                   float(d.get("total_s", 0.0)), int(d.get("dropped", 0)))  # fmt: skip


def fit_phase(features: Sequence[str], samples: Sequence[Sample]) -> PhaseFit:
    """Least squares of ``seconds ~ intercept + features`` without the stalls (see the module
    docstring); a phase without samples costs 0."""
    if not samples:
        return PhaseFit(0.0, {})
    fit = _fit(features, samples)
    names = list(features)
    resid = [y - fit.seconds(dict(zip(names, x, strict=True))) for x, y in samples]
    scale = max(1.4826 * statistics.median(abs(r) for r in resid), 1e-6)  # >= 1 us
    worst = sorted(range(len(samples)), key=lambda i: -resid[i])
    stalls = {i for i in worst[: int(STALL_SHARE * len(samples))]
              if resid[i] > STALL_RESIDUALS * scale}  # fmt: skip
    if not stalls:
        return fit
    kept = [s for i, s in enumerate(samples) if i not in stalls]
    refit = _fit(features, kept)
    return PhaseFit(refit.intercept_s, refit.slopes, fit.samples, fit.mean_s, fit.total_s,
                    len(stalls))  # fmt: skip


def _fit(features: Sequence[str], samples: Sequence[Sample]) -> PhaseFit:
    """The least-squares fit of every sample (negative slopes and intercept dropped)."""
    y = torch.tensor([s for _, s in samples], dtype=torch.float64)
    cols = list(range(len(features)))
    xs = torch.tensor([list(x) for x, _ in samples], dtype=torch.float64).reshape(len(y), -1)
    intercept = True
    while True:
        parts = ([torch.ones_like(y)] if intercept else []) + [xs[:, c] for c in cols]
        if not parts:
            return PhaseFit(0.0, {}, len(y), float(y.mean()), float(y.sum()))
        a = torch.stack(parts, dim=1)
        sol = torch.linalg.lstsq(a, y[:, None]).solution[:, 0].tolist()
        b0 = sol[0] if intercept else 0.0
        slopes = sol[1:] if intercept else sol
        worst = min(range(len(cols)), key=lambda i: slopes[i], default=None)
        if worst is not None and slopes[worst] < 0:
            cols.pop(worst)
            continue
        if b0 < 0:
            intercept = False
            continue
        fit = {features[c]: s for c, s in zip(cols, slopes, strict=True)}
        return PhaseFit(b0, fit, len(y), float(y.mean()), float(y.sum()))


@dataclass
class HostCosts:
    """The host cost of every phase (``PhaseFit``), the timer that measured the samples and
    the trace they came from. ``seconds(phase, x)``: 0 for a phase without a fit.

    ``phases`` is fitted on every sample; ``profiles`` holds one fit per configuration of the
    calibration trace (a configuration's own mix of work: device-only has no copies, write_back
    waits for its backups), and ``profile(name)`` is the costs a run of that configuration is
    charged (the pooled fit for a configuration the trace did not run)."""

    phases: dict[str, PhaseFit]
    timer: str
    trace: dict[str, Any] = field(default_factory=dict)
    profiles: dict[str, dict[str, PhaseFit]] = field(default_factory=dict)
    name: str = "pooled"
    copies: dict[str, Any] = field(default_factory=dict)  # {"h2d"|"d2h": CopyFit} of the trace

    def seconds(self, phase: str, x: dict[str, float]) -> float:
        fit = self.phases.get(phase)
        return 0.0 if fit is None else fit.seconds(x)

    def profile(self, name: str | None) -> HostCosts:
        if name is None or name not in self.profiles:
            return self
        return HostCosts(self.profiles[name], self.timer, self.trace, self.profiles, name,
                         self.copies)  # fmt: skip

    def as_dict(self) -> dict[str, Any]:
        return {"timer": self.timer, "trace": self.trace,
                "phases": {k: v.as_dict() for k, v in self.phases.items()},
                "profiles": {p: {k: v.as_dict() for k, v in fits.items()}
                             for p, fits in self.profiles.items()},
                "copies": {k: v.as_dict() for k, v in self.copies.items()}}  # fmt: skip

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> HostCosts:
        try:
            phases = {k: PhaseFit.from_dict(v) for k, v in d["phases"].items()}
            profiles = {p: {k: PhaseFit.from_dict(v) for k, v in fits.items()}
                        for p, fits in (d.get("profiles") or {}).items()}  # fmt: skip
            copies = {k: CopyFit.from_dict(v) for k, v in (d.get("copies") or {}).items()}
            return cls(phases, str(d["timer"]), dict(d.get("trace") or {}), profiles,
                       copies=copies)  # fmt: skip
        except (KeyError, TypeError, AttributeError) as exc:
            raise ValueError(f"host costs: missing or bad field ({exc!r})") from None

    def describe(self) -> str:
        total = sum(f.total_s for f in self.phases.values())
        top = sorted(self.phases.items(), key=lambda kv: -kv[1].total_s)[:3]
        parts = ", ".join(f"{k} {f.mean_s * 1e6:.0f} us/call" for k, f in top)
        steps = self.trace.get("steps", "?")
        return (f"host {total * 1e3:.0f} ms over {steps} steps ({parts}; "
                f"{len(self.profiles)} profiles)")  # fmt: skip


def _fit_all(
    samples: dict[str, list[Sample]], features: dict[str, Sequence[str]]
) -> dict[str, PhaseFit]:
    phases = {name: fit_phase(features[name], samples.get(name, [])) for name in features}
    for name, fit in phases.items():
        if fit.samples:
            pred = statistics.fmean(fit.seconds(dict(zip(features[name], x, strict=True)))
                                    for x, _ in samples[name])  # fmt: skip
            logger.info("host phase %s: %d samples, mean %.1f us, fit mean %.1f us", name,
                        fit.samples, fit.mean_s * 1e6, pred * 1e6)  # fmt: skip
    return phases


def fit_host_costs(
    samples: dict[str, dict[str, list[Sample]]],
    features: dict[str, Sequence[str]],
    timer: str,
    trace: dict[str, Any],
) -> HostCosts:
    """One ``fit_phase`` per phase of ``features``: per profile (``samples[profile][phase]``)
    and over every profile's samples together."""
    pooled: dict[str, list[Sample]] = {name: [] for name in features}
    for by_phase in samples.values():
        for name, rows in by_phase.items():
            pooled[name].extend(rows)
    profiles = {p: _fit_all(by_phase, features) for p, by_phase in samples.items()}
    return HostCosts(_fit_all(pooled, features), timer, trace, profiles)
