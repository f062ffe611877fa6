"""The cache's real copies on the calibration trace: recorded on wall-clock runs of the
benchmark's own workload, and fitted (``HostCosts.copies``), so the virtual clock charges a
copy what it takes in a run.

On a CPU a copy job (index moves, the op, the stream's hand-off) runs on the stream's worker
thread beside the scheduler's Python and the forward, sharing the interpreter and the two cores
with them, and takes longer than it does alone; on a virtual-clock run it takes less (the
driver waits for the copies between steps, ``bench.e2e.driver.settle``, so they run beside
nothing). The trace's copies are therefore recorded on wall-clock runs of its configurations
(``CopyRecorder.install`` on each run's controller), where they contend as in the wall-clock
runs the fidelity step compares with.

Each sample is one ack's copy-start to finish event, as the controller's ``stats`` records it
when the ack is popped: ``(direction, bytes, seconds)``. A load back is ``num_layers`` calls
(one per layer), a backup one call.
"""

from __future__ import annotations

from typing import Any

import torch

from bench.clock.copy_fit import CopyFit, fit_copy

__all__ = ["CopyRecorder", "fit_absolute", "fit_trace_copies"]

MAX_SAMPLES = 200_000


class CopyRecorder:
    """Collects ``samples`` (``(direction, bytes, seconds)``) of every controller it was
    installed on (instance attributes only: the controller's ``stats.record_copy`` is wrapped,
    still recording)."""

    def __init__(self) -> None:
        self.samples: list[tuple[str, int, float]] = []

    def install(self, controller: Any) -> None:
        record_copy = controller.stats.record_copy
        samples = self.samples

        def recorded(direction: str, nbytes: int, seconds: float) -> None:
            record_copy(direction, nbytes, seconds)
            if len(samples) < MAX_SAMPLES:
                samples.append((direction, int(nbytes), float(seconds)))

        controller.stats.record_copy = recorded


def fit_trace_copies(samples: list[tuple[str, int, float]], num_layers: int) -> dict[str, Any]:
    """``{"h2d": CopyFit, "d2h": CopyFit}`` of the trace's copies; a direction without two
    sizes of samples is left out.

    Least squares of the seconds themselves (``fit_absolute``), not of relative errors as for
    the ops timed alone: the copies' times are charged in sum, and a few slow copies (the
    stream thread waiting for the interpreter) weigh what they cost."""
    fits: dict[str, Any] = {}
    for direction, calls in (("h2d", num_layers), ("d2h", 1)):
        rows = [(b, calls, s) for d, b, s in samples if d == direction and s > 0]
        if len({b for b, _, _ in rows}) >= 2:
            fit = fit_absolute(direction, rows)
            errors = sorted(abs(fit.seconds(b, c) - s) / s for b, c, s in rows)
            fit.points = [{"source": "wall trace", "samples": len(rows),  # a summary, no points
                           "total_s": sum(s for _, _, s in rows),
                           "fit_total_s": sum(fit.seconds(b, c) for b, c, _ in rows),
                           "median_abs_rel_err": errors[len(errors) // 2]}]  # fmt: skip
            fits[direction] = fit
    return fits


def fit_absolute(direction: str, rows: list[tuple[int, int, float]]) -> CopyFit:
    """``calls * per_call + bytes / bw`` by least squares of the seconds (both terms >= 0;
    ``fit_copy``'s relative fit where one comes out negative)."""
    x = torch.tensor([[c, b] for b, c, _ in rows], dtype=torch.float64)
    t = torch.tensor([[s] for _, _, s in rows], dtype=torch.float64)
    per_call, per_byte = torch.linalg.lstsq(x, t).solution[:, 0].tolist()
    if per_call < 0 or per_byte <= 0:
        return fit_copy(direction, rows)
    return CopyFit(direction, per_call, 1.0 / per_byte)
