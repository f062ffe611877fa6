"""The scheduler thread's host time on the virtual clock: which calls are measured, how, and
what is charged for them.

``HostMeter.install(ex)`` replaces the methods of ``PHASES`` on one executor's delegates
(instance attributes only; nothing else changes): the executor's step and, inside it, the
cache's ack poll, the bootstrap and waiting queues, the chunk boundary, building the batch
(matches, locks, allocation, evictions, write_back backups), launching loads, running the batch
(inputs, publishing, sends) and the inflight queue with each request's release. Each call's own
time (``bench.common.call_timer``, the calibration's timer) is measured *exclusive* of the
phases nested in it and of the regions the virtual clock charges otherwise (``excluded``: the
model's forward, the real wait for a backup, the decode side's read of a send).

What each call charges to the clock, at its end (``mode``):

- ``model`` (the default of a calibrated run): ``HostCosts.seconds(phase, features)``, the fit
  of the calibration trace: deterministic, replayable;
- ``measured`` (the calibration trace itself): the time just measured;
- ``off``: nothing (what the virtual clock did before host time was charged).

``record=True`` keeps every call's ``(features, seconds)`` for ``fit_host_costs``. Totals per
phase, measured and charged, are kept either way (``as_dict``). Under tensor parallelism only
``model`` and ``off`` keep the ranks' clocks equal (the features are the same on every rank;
measured times are not).
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

from bench.clock.host_cost import HostCosts, Sample, fit_host_costs
from bench.clock.trace_copies import CopyRecorder, fit_trace_copies

logger = logging.getLogger(__name__)

__all__ = ["FEATURES", "HOST_MODES", "PHASES", "HostMeter", "Phase", "fit_meters"]

HOST_MODES = ("model", "measured", "off")


@dataclass(frozen=True)
class Phase:
    """A method ``owner.method`` of the executor (``owner`` "": the executor itself)."""

    name: str
    owner: str
    method: str
    features: tuple[str, ...]


PHASES = (
    Phase("step", "", "_step", ()),
    Phase("acks", "tree", "check_hicache_events", ("acks",)),
    Phase("bootstrap_queue", "admission", "pop_bootstrapped", ("queue",)),
    Phase("waiting_queue", "admission", "resolve_waiting_bootstrap", ("queue",)),
    Phase("chunk_boundary", "chunked", "process_chunked_req", ("chunked",)),
    Phase("new_batch", "chunked", "get_new_batch", ("requests", "evicted", "loaded", "backed_up")),
    Phase("load_launch", "tree", "ready_to_load_host_cache", ("ops",)),
    Phase("run_batch", "chunked", "run_batch", ("requests", "tokens", "backed_up")),
    Phase("inflight_queue", "inflight", "process_inflight_queue", ("queue",)),
    Phase("release", "kv", "release", ("slots",)),
)
FEATURES = {p.name: p.features for p in PHASES}


class _Counters:
    """Cumulative counters the features are differences of."""

    def __init__(self, ex: Any) -> None:
        self.stats = ex.cache.stats
        self.controller = getattr(ex.cache, "controller", None)

    def read(self) -> tuple[int, int, int, int]:
        s, c = self.stats, self.controller
        acks = 0 if c is None else len(c.ack_write_queue) + len(c.ack_load_queue)
        return acks, s.evicted_device_tokens, s.loaded_tokens, s.backed_up_tokens


class HostMeter:
    """Measures the host phases of one executor and charges them to ``clock`` (see the module
    docstring). ``timer``: a zero-argument clock (seconds)."""

    def __init__(
        self,
        clock: Any,
        timer: Callable[[], float],
        mode: str = "model",
        costs: HostCosts | None = None,
        record: bool = False,
    ) -> None:
        if mode not in HOST_MODES:
            raise ValueError(f"host time mode must be one of {HOST_MODES}, got {mode!r}")
        if mode == "model" and costs is None:
            raise ValueError("host time mode 'model' needs the calibration's host costs")
        self.clock = clock
        self.timer = timer
        self.mode = mode
        self.costs = costs
        self.record = record
        self.samples: dict[str, list[Sample]] = {p.name: [] for p in PHASES}
        self.measured_s = dict.fromkeys(FEATURES, 0.0)
        self.charged_s = dict.fromkeys(FEATURES, 0.0)
        self.calls = dict.fromkeys(FEATURES, 0)
        self.excluded_s = 0.0
        self.steps = 0
        self._stack: list[float] = []  # per open call: time of what it must not count

    # ------------------------------------------------------------------ regions
    @contextlib.contextmanager
    def excluded(self) -> Iterator[None]:
        """Time inside is not the enclosing phase's host time (charged otherwise)."""
        t0 = self.timer()
        try:
            yield
        finally:
            dt = self.timer() - t0
            self.excluded_s += dt
            if self._stack:
                self._stack[-1] += dt

    # ------------------------------------------------------------------ install
    def install(self, ex: Any) -> None:
        """Wrap ``PHASES`` on ``ex`` (instance attributes)."""
        counters = _Counters(ex)
        for phase in PHASES:
            owner = ex if not phase.owner else getattr(ex, phase.owner)
            original = getattr(owner, phase.method)
            setattr(owner, phase.method, self._wrap(phase, original, ex, counters))

    def _wrap(self, phase: Phase, original: Callable[..., Any], ex: Any,
              counters: _Counters) -> Callable[..., Any]:  # fmt: skip
        name = phase.name

        def measured(*args: Any, **kwargs: Any) -> Any:
            before = _before(name, ex, args, counters)
            t0 = self.timer()
            self._stack.append(0.0)
            try:
                result = original(*args, **kwargs)
            finally:
                dt = self.timer() - t0
                inner = self._stack.pop()
                if self._stack:
                    self._stack[-1] += dt
            own = max(0.0, dt - inner)
            x = _features(name, ex, args, result, before, counters)
            self._account(name, x, own)
            return result

        return measured

    def _account(self, name: str, x: dict[str, float], own: float) -> None:
        self.calls[name] += 1
        self.measured_s[name] += own
        self.steps += name == "step"
        if self.record and len(self.samples[name]) < 200_000:
            self.samples[name].append((tuple(x[f] for f in FEATURES[name]), own))
        if self.mode == "model":
            assert self.costs is not None
            charge = self.costs.seconds(name, x)
        elif self.mode == "measured":
            charge = own
        else:
            charge = 0.0
        if charge > 0:
            self.charged_s[name] += charge
            self.clock.advance(charge)

    # ------------------------------------------------------------------ results
    def as_dict(self) -> dict[str, Any]:
        return {
            "mode": self.mode,
            "steps": self.steps,
            "measured_s": sum(self.measured_s.values()),
            "charged_s": sum(self.charged_s.values()),
            "per_phase": {k: {"calls": self.calls[k], "measured_s": self.measured_s[k],
                              "charged_s": self.charged_s[k]} for k in FEATURES},
            "excluded_s": self.excluded_s,
        }  # fmt: skip


def _before(name: str, ex: Any, args: tuple[Any, ...], counters: _Counters) -> Any:
    if name == "bootstrap_queue":
        return len(ex.admission.bootstrap_queue)
    if name == "waiting_queue":
        return len(ex.admission.waiting_queue)
    if name == "inflight_queue":
        return len(ex.inflight.inflight_queue)
    if name == "chunk_boundary":
        return int(ex.chunked.chunked_req is not None)
    if name == "load_launch":
        return 0 if counters.controller is None else len(counters.controller.load_queue)
    if name == "release":
        slots = args[0].slots if args else None
        return 0 if slots is None else int(slots.numel())
    if name in ("acks", "new_batch", "run_batch"):
        return counters.read()
    return None


def _features(name: str, ex: Any, args: tuple[Any, ...], result: Any, before: Any,
              counters: _Counters) -> dict[str, float]:  # fmt: skip
    if name == "step":
        return {}
    if name in ("bootstrap_queue", "waiting_queue", "inflight_queue"):
        return {"queue": float(before)}
    if name == "chunk_boundary":
        return {"chunked": float(before)}
    if name == "load_launch":
        return {"ops": float(before)}
    if name == "release":
        return {"slots": float(before)}
    after = counters.read()
    if name == "acks":
        return {"acks": float(max(0, before[0] - after[0]))}
    delta = [float(a - b) for a, b in zip(after, before, strict=True)]
    if name == "new_batch":
        return {"requests": float(len(result)), "evicted": delta[1], "loaded": delta[2],
                "backed_up": delta[3]}  # fmt: skip
    batch = args[0]  # run_batch(batch)
    return {"requests": float(len(batch)), "tokens": float(sum(n for _, n in batch)),
            "backed_up": delta[3]}  # fmt: skip


def fit_meters(
    meters: dict[str, list[HostMeter]], trace: dict[str, Any], timer_name: str,
    num_layers: int | None = None,
    copies: CopyRecorder | None = None,
) -> HostCosts:
    """The host costs of the samples the meters recorded (``record=True``), one profile per
    key of ``meters`` (a configuration) and pooled; with ``num_layers`` and ``copies``, also
    the fits of the real copies recorded on the trace's wall-clock runs (``HostCosts.copies``,
    ``bench.clock.trace_copies``)."""
    samples: dict[str, dict[str, list[Sample]]] = {}
    steps = 0
    for profile, ms in meters.items():
        by_phase = samples.setdefault(profile, {p.name: [] for p in PHASES})
        for m in ms:
            steps += m.steps
            for k, v in m.samples.items():
                by_phase[k].extend(v)
    costs = fit_host_costs(samples, FEATURES, timer_name, {**trace, "steps": steps})
    if num_layers is not None and copies is not None:
        costs.copies = fit_trace_copies(copies.samples, num_layers)
    return costs
