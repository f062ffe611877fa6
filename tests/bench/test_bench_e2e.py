"""The end-to-end benchmarks' deterministic mode and the suite's command line.

- ``bench.clock.calibrate``: the forward table interpolates what it measured; the copy fit recovers
  a per-call cost and a bandwidth; a calibration survives its file and a replay refuses one of
  another model.
- ``bench.clock.virtual_cost``: what the virtual clock is charged for a forward that waits for
  layers still loading or overlaps a copy, for a wait on a backup, and when acks are popped;
  ``bench.clock.host_cost`` recovers a linear host cost.
- A multi-turn and an optimistic configuration, each run twice on a virtual clock with the same
  calibration (host time charged from its model): the same schedule to the last TTFT sample,
  integrity all zero, the strict audit checking every sampled request; one wrong vector in a
  decode-side row is a strict mismatch.
- ``python -m bench --only``: an unknown name is an error listing the valid ones; a partial run
  merges its section into the summary file and keeps the others.
- ``bench/gpu_check.sh`` without a CUDA torch stops at once with one line.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import os
import random
import statistics
import subprocess
import sys
import types
from pathlib import Path
from typing import Any

import pytest
import torch

from bench import __main__ as suite
from bench.clock.calibrate import (
    Calibration,
    CopyFit,
    ForwardTable,
    HostCosts,
    fit_copy,
    forward_grid,
    table_from,
)
from bench.clock.calibration_file import load_calibration, write_calibration
from bench.clock.corun import CorunSlowdown, corun_shapes, measure_corun
from bench.clock.host_cost import PhaseFit, fit_phase
from bench.clock.streams_model import CopyTimeline
from bench.clock.trace_copies import CopyRecorder, fit_trace_copies
from bench.clock.transport import TransferModel
from bench.clock.virtual_cost import CostAccountant
from bench.e2e import setup as e2e
from bench.e2e.calibrated import charge_trace_copies
from bench.e2e.workload import poisson_arrivals
from bench.multiturn import single as mt_single
from bench.multiturn import trace as bm
from bench.optimistic import bench as bo
from bench.optimistic import run as orun
from bench.summary import git_commit, run_info
from hicache.transfer.streams import CpuStreams
from prefill.clock import VirtualClock

ROOT = Path(__file__).resolve().parents[2]
TINY = dict(num_layers=2, num_attention_heads=4, head_num=2, head_dim=16, hidden_size=64,
            intermediate_size=128, vocab_size=512, dtype="float32")  # fmt: skip


def linear_calibration(layers: int = 2, host: bool = False) -> Calibration:
    """A made-up calibration: 1 ms + 10 us per new token + 0.1 us per (new x prefix) pair;
    ``host``: 50 us a step, 20 us a release and 5 us per request in a batch."""
    ns, ps = [16, 64, 256], [0, 128, 512]
    single = [[1e-3 + 1e-5 * n + 1e-7 * n * p for p in ps] for n in ns]
    costs = HostCosts({"step": PhaseFit(5e-5, {}), "release": PhaseFit(2e-5, {}),
                       "run_batch": PhaseFit(0.0, {"requests": 5e-6})}, "cpu")  # fmt: skip
    return Calibration(
        ForwardTable(ns, ps, single, pair_saving_s=5e-4),
        CopyFit("h2d", 1e-5, 1e9),
        CopyFit("d2h", 2e-5, 5e8),
        num_layers=layers,
        transfer=TransferModel.measured(CopyFit("transfer", 1e-4, 1e9)),
        host=costs if host else None,
    )


# ------------------------------------------------------------------------------ calibration
def test_forward_table_interpolates_and_extrapolates_linearly() -> None:
    cal = linear_calibration()
    f = cal.forward
    for n in (16, 40, 64, 100, 256):
        for p in (0, 64, 128, 300, 512):
            want = 1e-3 + 1e-5 * n + 1e-7 * n * p  # bilinear: exact for this function
            assert f.one(n, p) == pytest.approx(want)
    assert f.one(512, 1024) == pytest.approx(1e-3 + 1e-5 * 512 + 1e-7 * 512 * 1024)
    assert f.one(1, 0) == f.one(16, 0)  # below the grid: the smallest n's time
    two = f.cost([(64, 128), (16, 0)])
    assert two == pytest.approx(f.one(64, 128) + f.one(16, 0) - 5e-4)
    assert f.cost([]) == 0.0


def test_table_from_medians_and_pair_saving() -> None:
    grid = forward_grid(64, 256, 16)
    assert [b for b in grid if len(b) == 1] == [[(n, p)] for n in (16, 32, 64)
                                               for p in (0, 64, 128, 256)]  # fmt: skip
    measured = []
    for batch in grid:
        t = sum(1e-3 + 1e-5 * n + 1e-8 * n * p for n, p in batch) - 2e-4 * (len(batch) - 1)
        measured.append((batch, [t * 1.5, t, t * 0.9]))  # median is t
    table = table_from(measured)
    assert table.ns == [16, 32, 64] and table.ps == [0, 64, 128, 256]
    assert table.one(32, 128) == pytest.approx(1e-3 + 3.2e-4 + 1e-8 * 32 * 128)
    assert table.pair_saving_s == pytest.approx(2e-4)
    assert all(pt["median_s"] == pytest.approx(pt["model_s"]) for pt in table.points)
    with pytest.raises(ValueError, match="lacks single-request shapes"):
        table_from([m for m in measured if m[0] != [(32, 64)]])


def test_copy_fit_recovers_per_call_and_bandwidth() -> None:
    points = [(b, 4, 4 * 3e-5 + b / 2e9) for b in (1 << 16, 1 << 20, 1 << 24)]
    fit = fit_copy("h2d", points)
    assert fit.per_call_s == pytest.approx(3e-5, rel=1e-6)
    assert fit.bytes_per_s == pytest.approx(2e9, rel=1e-6)
    with pytest.raises(ValueError):
        fit_copy("h2d", points[:1])


# ------------------------------------------------------------------------------ virtual cost
class _Op:
    def __init__(self, n: int) -> None:
        self.host_indices = torch.arange(n)


class _Event:
    def synchronize(self) -> None:
        pass


class _Ack:
    def __init__(self, node_ids: list[int]) -> None:
        self.node_ids = node_ids
        self.finish_event = _Event()


class _Controller:
    """Just what ``CostAccountant.install`` wraps: every copy is finished at once."""

    def __init__(self) -> None:
        self.host_pool = types.SimpleNamespace(size_per_token=1000)
        self.streams = None  # CUDA-like: the two streams copy side by side
        self.load_queue: list[_Op] = []
        self.ack_write_queue: list[_Ack] = []
        self.ack_load_queue: list[_Ack] = []
        self.waited: list[Any] = []

    def write(self, device_indices: torch.Tensor, node_id: int = -1) -> torch.Tensor:
        self.ack_write_queue.append(_Ack([node_id]))
        return device_indices.clone()

    def wait_write(self, node_ids: list[int] | None = None) -> list[int]:
        self.waited.append(node_ids)
        done = [a for a in self.ack_write_queue if node_ids is None or a.node_ids[0] in node_ids]
        for a in done:
            self.ack_write_queue.remove(a)
        return [a.node_ids[0] for a in done]

    def start_loading(self) -> int:
        if self.load_queue:
            self.ack_load_queue.append(_Ack([-1]))
        self.load_queue = []
        return 0

    def count_finished_writes(self) -> int:
        return len(self.ack_write_queue)

    def count_finished_loads(self) -> int:
        return len(self.ack_load_queue)


def test_forward_waits_for_layers_still_loading() -> None:
    cal = linear_calibration(layers=2)
    clock = VirtualClock()
    model = types.SimpleNamespace(last_shapes=[(64, 0)])
    acct = CostAccountant(cal, clock, model)  # type: ignore[arg-type]
    ctl = _Controller()
    acct.install(ctl)
    compute = cal.forward.one(64, 0)  # 1.64 ms, 0.82 ms per layer
    assert acct(64, 0) == pytest.approx(compute)
    ctl.load_queue = [_Op(4000)]  # 4 MB: 2 MB per layer = 10 us + 2 ms each
    ctl.start_loading()
    per_layer_load = 1e-5 + 2e6 / 1e9
    # layer 0 starts when loaded; layer 1 is loaded after 2 loads, later than layer 0's end
    want = per_layer_load + max(compute / 2, per_layer_load) + compute / 2
    assert acct(64, 0) == pytest.approx(want)
    assert acct.load_wait_s == pytest.approx(want - compute)
    assert acct(64, 0) == pytest.approx(compute)  # the next forward finds nothing loading


def test_on_cpu_streams_a_load_starts_at_its_forward() -> None:
    """Host time between the launch and the forward hides layer 0's copy behind it on CUDA
    streams; on CPU streams (the stream thread waits for the interpreter) it does not."""
    waits = {}
    for name, streams in (("cuda", None), ("cpu", CpuStreams())):
        cal = linear_calibration(layers=2)
        clock = VirtualClock()
        acct = CostAccountant(cal, clock, types.SimpleNamespace(last_shapes=[(64, 0)]))
        ctl = _Controller()
        ctl.streams = streams
        acct.install(ctl)
        ctl.load_queue = [_Op(4000)]  # 2 MB per layer: 10 us + 2 ms each
        ctl.start_loading()
        clock.advance(1e-3)  # the scheduler's host time before the forward
        acct(64, 0)
        waits[name] = acct.load_wait_s
    per_layer = 1e-5 + 2e6 / 1e9
    assert waits["cuda"] == pytest.approx(per_layer - 1e-3 + max(0.0, per_layer - 0.82e-3))
    assert waits["cpu"] == pytest.approx(per_layer + max(0.0, per_layer - 0.82e-3))
    # A load cancelled before its forward (its ack gone) is not the next forward's to wait for.
    ctl.load_queue = [_Op(4000)]
    ctl.start_loading()
    ctl.ack_load_queue.clear()
    before = acct.load_wait_s
    clock.advance(1e-3)
    acct(64, 0)
    assert acct.load_wait_s == before


def test_wait_for_a_backup_advances_the_clock_to_its_end() -> None:
    clock = VirtualClock(start=1.0)
    acct = CostAccountant(linear_calibration(), clock, types.SimpleNamespace(last_shapes=[]))
    ctl = _Controller()
    acct.install(ctl)
    ctl.write(torch.arange(100), node_id=7)  # 100 KB at 0.5 GB/s + 20 us = 220 us
    ctl.write(torch.arange(100), node_id=8)  # queued behind it: ends at 440 us
    assert clock.now() == 1.0  # a backup alone does not block
    assert ctl.wait_write([8]) == [8]
    assert clock.now() == pytest.approx(1.0 + 2 * (2e-5 + 1e5 / 5e8))
    assert acct.write_wait_s == pytest.approx(2 * (2e-5 + 1e5 / 5e8))
    assert ctl.waited == [[8]]


def test_acks_are_popped_at_their_modelled_time() -> None:
    """Two backups finished for real at once; the ack poll sees each only once the clock passed
    its modelled end, and ``next_ack_time`` says when that is."""
    clock = VirtualClock()
    acct = CostAccountant(linear_calibration(), clock, types.SimpleNamespace(last_shapes=[]))
    ctl = _Controller()
    acct.install(ctl)
    one = 2e-5 + 1e5 / 5e8  # 220 us per backup, FIFO on the write stream
    ctl.write(torch.arange(100), node_id=1)
    ctl.write(torch.arange(100), node_id=2)
    assert ctl.count_finished_writes() == 0
    assert acct.next_ack_time() == pytest.approx(one)
    clock.wait_until(acct.next_ack_time())
    assert ctl.count_finished_writes() == 1
    clock.wait_until(2 * one)
    assert ctl.count_finished_writes() == 2 and acct.acks_held == 2
    acct.release_acks()
    assert acct.next_ack_time() is None


def test_compute_and_copies_beside_each_other_are_slowed() -> None:
    tl = CopyTimeline()
    assert _span(tl.occupy("write", 1.0, 2.0)) == (1.0, 3.0)
    assert _span(tl.occupy("write", 0.0, 1.0)) == (3.0, 4.0)  # FIFO behind the first
    assert _span(tl.occupy("load", 6.0, 1.0)) == (6.0, 7.0)
    assert tl.busy_intervals() == [(1.0, 4.0), (6.0, 7.0)]
    assert tl.compute_end(0.0, 5.0, 1.0) == 5.0
    # 1 s free, 3 s busy at half speed (1.5 s of work), then free until 6: 4.5 s done at 6
    assert tl.compute_end(0.0, 3.0, 2.0) == pytest.approx(4.5)
    assert tl.compute_end(0.0, 4.0, 2.0) == pytest.approx(5.5)
    assert tl.compute_end(0.0, 5.0, 2.0) == pytest.approx(7.0)  # the last 0.5 s in (6, 7)
    tl.trim(4.0)
    assert tl.busy_intervals() == [(6.0, 7.0)]
    # Compute over [1, 1.5) slows the first backup by 0.5 s x (3 - 1); the second starts later.
    tl = CopyTimeline()
    first, second = tl.occupy("write", 0.0, 2.0), tl.occupy("write", 0.0, 1.0)
    tl.stretch_copies(1.0, 1.5, 3.0)
    assert (_span(first), _span(second)) == ((0.0, 3.0), (3.0, 4.0))
    assert tl.free_at("write") == 4.0 and tl.free_at("load") == 0.0
    shared = CopyTimeline(shared=True)  # CPU streams: one lock, one FIFO
    shared.occupy("write", 0.0, 2.0)
    assert _span(shared.occupy("load", 1.0, 1.0)) == (2.0, 3.0)
    assert _span(CopyTimeline().occupy("load", 1.0, 1.0, after=2.5)) == (2.5, 3.5)


def test_corun_slowdown_interpolates_over_the_forward_cost() -> None:
    c = CorunSlowdown(1.4, "measured", {}, 1.3, ((0.005, 1.4, 1.3), (0.05, 1.0, 1.1)))
    assert c.factor_at(0.001) == 1.4 and c.factor_at(0.5) == 1.0  # clamped at both ends
    assert c.factor_at(math.sqrt(0.005 * 0.05)) == pytest.approx(1.2)  # linear in log(cost)
    assert c.copy_factor_at(0.05) == pytest.approx(1.1)
    assert CorunSlowdown.from_dict(c.as_dict()) == c
    flat = CorunSlowdown.from_dict({"factor": 1.2, "copy_factor": 1.1, "source": "flag"})
    assert flat.factor_at(0.001) == flat.factor_at(1.0) == 1.2 and flat.copy_factor_at(9) == 1.1
    with pytest.raises(ValueError, match="sorted"):
        CorunSlowdown(1.4, "measured", {}, 1.3, ((0.05, 1.0, 1.1), (0.005, 1.4, 1.3)))
    with pytest.raises(ValueError, match=">= 1"):
        CorunSlowdown(1.4, "measured", {}, 1.3, ((0.005, 0.9, 1.3),))
    assert corun_shapes([16, 32, 64], [0, 128, 256]) == [(16, 256), (32, 256), (64, 0)]
    assert corun_shapes([16], [0, 16]) == [(16, 16), (16, 0)]


def test_a_short_forward_beside_a_load_is_charged_its_own_slowdown() -> None:
    """The co-run factor follows the forward's cost: a short forward overlapping a backup is
    slowed by the short end's factor, a long one by the long end's; the load a forward consumes
    is resized to that forward's copy factor."""
    base = linear_calibration(layers=2)
    short, long_ = base.forward.one(16, 0), base.forward.one(256, 0)
    corun = CorunSlowdown(2.0, "measured", {}, 1.5, ((short, 2.0, 1.5), (long_, 1.0, 1.0)))
    cal = dataclasses.replace(base, corun=corun)
    extra = {}
    for n in (16, 256):
        clock = VirtualClock()
        acct = CostAccountant(cal, clock, types.SimpleNamespace(last_shapes=[(n, 0)]))
        ctl = _Controller()
        acct.install(ctl)
        ctl.write(torch.arange(10_000), node_id=1)  # 10 MB at 0.5 GB/s: 20 ms beside compute
        compute = cal.forward.one(n, 0)
        extra[n] = acct(n, 0) - compute
        assert acct.corun_extra_s == pytest.approx(extra[n])
    assert extra[16] == pytest.approx(short)  # wholly overlapped at x2: twice as long
    assert extra[256] == pytest.approx(0.0)
    clock = VirtualClock()
    acct = CostAccountant(cal, clock, types.SimpleNamespace(last_shapes=[(16, 0)]))
    ctl = _Controller()
    acct.install(ctl)
    ctl.load_queue = [_Op(4000)]  # 2 MB per layer: 10 us + 2 ms each
    ctl.start_loading()
    per_layer = 1e-5 + 2e6 / 1e9
    acct(16, 0)
    assert acct.h2d_busy_s == pytest.approx(per_layer * (1 + 1.5))  # layer 1 beside compute
    assert acct.next_ack_time() == pytest.approx(per_layer * 2.5)


def test_trace_copy_fit_charges_what_the_copies_cost_in_sum() -> None:
    """Most backups take their op's time, one in ten three times as long (the stream thread
    waiting for the interpreter): the trace fit's total is the trace's total."""
    op = CopyFit("d2h", 4e-4, 5e8)
    samples = [("d2h", n, op.seconds(n) * (3.0 if i % 10 == 0 else 1.0))
               for i, n in enumerate([64_000, 256_000, 1_024_000] * 40)]  # fmt: skip
    samples += [("h2d", 64_000, 1e-3)]  # one size only: no h2d fit
    fits = fit_trace_copies(samples, num_layers=4)
    assert set(fits) == {"d2h"}
    summary = fits["d2h"].points[0]
    assert summary["samples"] == 120
    assert summary["fit_total_s"] == pytest.approx(summary["total_s"], rel=1e-6)


def test_calibration_charges_the_trace_copy_fits() -> None:
    """The trace's copy fit replaces the op timed alone (kept beside it); the copies' co-run
    slowdown is then in the fit (copy factor 1), compute's stays as measured."""
    base = linear_calibration()
    measured = CorunSlowdown(1.3, "measured", {}, 1.2, ((0.005, 1.3, 1.2), (0.05, 1.0, 1.1)))
    host = HostCosts({}, "cpu", copies={"h2d": CopyFit("h2d", 3e-4, 4e8)})
    cal = charge_trace_copies(dataclasses.replace(base, corun=measured, host=host))
    assert cal.h2d.per_call_s == 3e-4 and cal.d2h == base.d2h  # d2h: no trace fit, as measured
    assert cal.h2d.points[-1]["op_alone"]["per_call_s"] == base.h2d.per_call_s
    assert cal.corun.factor_at(0.001) == 1.3 and cal.corun.factor_at(1.0) == 1.0
    assert cal.corun.copy_factor_at(0.001) == 1.0 and cal.corun.copy_factor == 1.0
    assert cal.corun.measured["copy_factor_measured"] == 1.2
    assert charge_trace_copies(base) is base  # no trace: nothing to charge


def test_fidelity_takes_the_wall_runs_in_turn_and_reports_their_mean() -> None:
    from bench.fidelity import bench as fid

    calls: list[tuple[str, str]] = []
    ttft = {"a": iter([0.010, 0.030]), "b": iter([0.020, 0.040])}

    def run_one(label: str, clock: str) -> dict[str, Any]:
        calls.append((label, clock))
        return {"ttft_mean_s": next(ttft[label]) if clock == "wall" else 0.5}

    out = fid._clocks(["a", "b"], run_one, True, lambda: 1.0, "test")
    walls = [c for c in calls if c[1] == "wall"]
    assert walls == [("a", "wall"), ("b", "wall")] * fid.WALL_REPEATS  # in turn
    assert calls[len(walls):] == [("a", "virtual"), ("a", "virtual_uncharged"),
                                  ("b", "virtual"), ("b", "virtual_uncharged")]  # fmt: skip
    assert out["a"]["wall"]["ttft_mean_s"] == pytest.approx(0.020)
    assert out["b"]["wall"]["ttft_mean_s_runs"] == [0.020, 0.040]
    assert out["a"]["wall"]["speed_vs_calibration"] == [1.0] * (2 * fid.WALL_REPEATS)


def test_resizing_a_booking_moves_the_copies_behind_it() -> None:
    tl = CopyTimeline()
    first, second = tl.occupy("load", 0.0, 1.0), tl.occupy("load", 0.5, 1.0)
    tl.resize(first, 3.0)
    assert (_span(first), _span(second)) == ((0.0, 3.0), (3.0, 4.0))
    assert tl.free_at("load") == 4.0
    tl.resize(first, 3.0, start=0.5)  # started later (CPU streams: at its forward)
    assert (_span(first), _span(second)) == ((0.5, 3.5), (3.5, 4.5))
    with pytest.raises(ValueError, match="start"):
        tl.resize(first, 1.0, start=0.0)
    with pytest.raises(ValueError, match="seconds"):
        tl.resize(first, -1.0)


def _span(b: Any) -> tuple[float, float]:
    return (b.start, b.end)


def test_host_cost_fit_recovers_a_linear_cost_and_drops_negative_slopes() -> None:
    samples = [((q, 2 * q % 5), 3e-5 + 7e-6 * q) for q in range(20)]
    fit = fit_phase(("queue", "noise"), samples)
    assert fit.intercept_s == pytest.approx(3e-5, rel=1e-6)
    assert fit.slopes["queue"] == pytest.approx(7e-6, rel=1e-6)
    assert abs(fit.slopes.get("noise", 0.0)) < 1e-12
    falling = [((q,), 1e-4 - 1e-6 * q) for q in range(10)]
    fit = fit_phase(("queue",), falling)
    assert fit.slopes == {} and fit.intercept_s == pytest.approx(statistics.fmean(
        s for _, s in falling))  # fmt: skip
    assert fit_phase(("queue",), []).seconds({"queue": 3.0}) == 0.0


def test_host_cost_fit_leaves_a_stall_out() -> None:
    """One call of 200 that took a second (the process descheduled) is not charged to every
    call of its phase; the measured mean still counts it."""
    rng = random.Random(0)
    samples = [((q % 7,), 3e-4 + 2e-5 * (q % 7) + rng.uniform(0, 2e-5)) for q in range(200)]
    clean = fit_phase(("queue",), samples)
    stalled = samples[:100] + [((3,), 1.0)] + samples[101:]
    fit = fit_phase(("queue",), stalled)
    assert fit.dropped == 1 and clean.dropped == 0
    assert fit.seconds({"queue": 3}) == pytest.approx(clean.seconds({"queue": 3}), rel=0.02)
    assert fit.mean_s > 5e-3  # what was measured, stall included
    exact = fit_phase(("queue",), [((q,), 1e-4 + 1e-6 * q) for q in range(50)])
    assert exact.dropped == 0  # rounding residuals of an exact fit are no stalls


def test_transfer_model_flags() -> None:
    measured = TransferModel.measured(CopyFit("transfer", 1e-4, 2e9))
    assert measured.blocking and measured.seconds(2000) == pytest.approx(1e-4 + 1e-6)
    assert measured.peer_fields()["transfer_latency_s"] == 0.0
    flagged = measured.with_flags(25.0, 10.0)
    assert not flagged.blocking and flagged.fit is measured.fit
    assert flagged.peer_fields() == {"transfer_latency_s": 1e-5, "transfer_bandwidth": 25e9}
    assert measured.with_flags(None, None) is measured
    with pytest.raises(ValueError, match="transfer-gbps"):
        measured.with_flags(0.0, None)


def test_calibration_file_replays_and_refuses_another_model(tmp_path: Path) -> None:
    cal = linear_calibration(host=True)
    cal.model = {"num_layers": 2, "hidden_size": 64}
    write_calibration(tmp_path, "multiturn", cal)
    write_calibration(tmp_path, "optimistic", linear_calibration())
    path = tmp_path / "calibration.json"
    back = load_calibration(path, "multiturn", {"num_layers": 2, "hidden_size": 64})
    assert back.source == str(path)
    assert {k: v for k, v in back.as_dict().items() if k != "source"} == {
        k: v for k, v in cal.as_dict().items() if k != "source"}  # fmt: skip
    assert back.forward.cost([(40, 100)]) == cal.forward.cost([(40, 100)])
    with pytest.raises(ValueError, match="another model geometry"):
        load_calibration(path, "multiturn", {"hidden_size": 128})
    with pytest.raises(ValueError, match=r"no calibration of 'soak' \(it holds \['multiturn', "
                       r"'optimistic'\]"):  # fmt: skip
        load_calibration(path, "soak")


# ------------------------------------------------------------------------------ determinism
@pytest.fixture
def tiny_model(monkeypatch: pytest.MonkeyPatch) -> None:
    """The benchmarks' CPU model shrunk to :data:`TINY`."""
    monkeypatch.setattr(e2e, "CPU_MODEL", TINY)


def _multiturn_opts() -> argparse.Namespace:
    return bm.parse_args(
        ["--num-clients", "4", "--num-rounds", "3", "--request-length", "64",
         "--sub-question-input-length", "16", "--working-set-ratio", "3", "--chunked-prefill-size",
         "64", "--kv-sample-every", "2", "--seeds", "5"], quick=True,
    )  # fmt: skip


def _charged(vc: dict[str, Any]) -> dict[str, Any]:
    """The virtual clock's accounting less what was measured (host times vary run to run)."""
    host = vc["host"]
    per_phase = {k: v["charged_s"] for k, v in host["per_phase"].items()}
    return {**vc, "host": {"charged_s": host["charged_s"], "per_phase": per_phase}}


VIOLATIONS = ("leaked_slots", "leaked_locks", "kv_mismatches", "kv_strict_mismatches",
              "aborted_sends", "integrity_errors", "speculative_l2_pages")  # fmt: skip


@pytest.mark.usefixtures("tiny_model")
@pytest.mark.parametrize("name", ["device_only", "write_back", "write_through"])
def test_multiturn_on_the_virtual_clock_repeats_exactly(name: str) -> None:
    opts = _multiturn_opts()
    _, device_tokens = bm.pool_sizes(opts)
    cal = linear_calibration(host=True)
    rate = bm.request_rate(opts, cal)
    model = e2e.shared_model(bm.server_args_for(name, device_tokens, opts))
    runs = [mt_single.run_config(name, 5, device_tokens, rate, opts, model, cal) for _ in range(2)]
    a, b = runs
    assert a["successes"] == 12
    assert a["ttft_samples_s"] == b["ttft_samples_s"]
    assert _charged(a["virtual_clock"]) == _charged(b["virtual_clock"])
    assert {k: a["integrity"][k] for k in VIOLATIONS} == dict.fromkeys(VIOLATIONS, 0)
    assert a["integrity"]["kv_checked_requests"] == 6 == a["integrity"]["kv_strict_checked"]
    vc = a["virtual_clock"]
    assert vc["host"]["charged_s"] > 0 and vc["transfer_s"] > 0
    assert vc["host"]["per_phase"]["step"]["charged_s"] == pytest.approx(
        5e-5 * vc["host"]["per_phase"]["step"]["calls"])  # fmt: skip
    if name != "device_only":
        assert a["host_hit_tokens"] > 0 and vc["h2d_busy_s"] > 0


@pytest.mark.usefixtures("tiny_model")
def test_a_wall_clock_run_records_every_real_copy() -> None:
    """The host trace's wall-clock runs record the cache's copies (``CopyRecorder``): every
    backup's bytes, as the run's stats count them, and the fit of them."""
    opts = _multiturn_opts()
    _, device_tokens = bm.pool_sizes(opts)
    cal = linear_calibration()
    model = e2e.shared_model(bm.server_args_for("write_through", device_tokens, opts))
    rec = CopyRecorder()
    res = mt_single.run_config("write_through", 5, device_tokens, bm.request_rate(opts, cal),
                               opts, model, cal, False, quiet=True, copies=rec)  # fmt: skip
    d2h = [s for s in rec.samples if s[0] == "d2h"]
    assert d2h and sum(b for _, b, _ in d2h) == res["d2h_bytes"]
    assert sum(b for d, b, _ in rec.samples if d == "h2d") == res["h2d_bytes"]
    assert all(secs > 0 for _, _, secs in rec.samples)
    if len({b for _, b, _ in d2h}) >= 2:
        assert fit_trace_copies(rec.samples, 2)["d2h"].points[0]["samples"] == len(d2h)


@pytest.mark.usefixtures("tiny_model")
def test_cpu_corun_runs_beside_the_cache_s_own_backups_and_gives_their_slots_back() -> None:
    """On a CPU the co-run is measured beside backups queued through the cache's controller
    (its write stream's worker runs them); afterwards the cache is as it was: no ack queued,
    every host slot free, integrity holds."""
    from hicache.builder import build_kv_cache
    from hicache.memory.device_pool import device_pool_from_server_args

    opts = _multiturn_opts()
    _, device_tokens = bm.pool_sizes(opts)
    args = bm.server_args_for("write_back", device_tokens, opts)
    model = e2e.shared_model(args)
    cache = build_kv_cache(args)
    try:
        free = cache.controller.host_allocator.available_size()
        c = measure_corun(model, lambda n: device_pool_from_server_args(args, size=n), cache,
                          [(16, 32), (64, 0)], rounds=2, job_tokens=32)  # fmt: skip
        shapes = c.measured["shapes"]
        assert [s["shape"] for s in shapes] == [[16, 32], [64, 0]]
        assert all(s["job_tokens"] == 32 and s["backups"] >= 2 for s in shapes)
        assert "backups of 32 tokens" in c.measured["copy"]
        assert len(c.points) == 2 and all(f >= 1.0 and cf >= 1.0 for _, f, cf in c.points)
        assert not cache.controller.ack_write_queue
        assert cache.controller.host_allocator.available_size() == free
        cache.check_integrity()
    finally:
        cache.close()
        cache.host_pool.destroy()


@pytest.mark.usefixtures("tiny_model")
def test_strict_audit_catches_one_ulp_in_one_vector() -> None:
    """A request's decode-side KV replays bit for bit; one float of one 16-byte vector moved
    by one ulp (well inside the loose check's tolerance) is a strict mismatch."""
    from bench.e2e.strict_audit import replay_matches
    from prefill.disagg.sim_config import PeerConfig

    opts = _multiturn_opts()
    _, device_tokens = bm.pool_sizes(opts)
    args = bm.server_args_for("write_back", device_tokens, opts)
    model = e2e.shared_model(args)
    cal = linear_calibration()
    convs = bm.conversations_for(opts, args.vocab_size, 5)
    ex, cost = e2e.new_executor(args, PeerConfig(seed=5), bm.decode_tokens_for(convs, opts),
                                model, cal)  # fmt: skip
    run = bm.drive_trace(ex, cost, convs, bm.request_rate(opts, cal), 5, "wb", opts, quiet=True)
    rid = run.sampled[-1]  # a later round: part of its prompt came from the cache
    assert run.forward_log.chunks[rid][0].lo > 0
    assert replay_matches(ex, rid, run.forward_log) is True
    peer = ex.decode.peers[rid]
    k = ex.decode.pool.k_buffer[1]
    slot = int(peer.decode_slots[peer.num_tokens - 1])
    k[slot, 0, 0] = torch.nextafter(k[slot, 0, 0], torch.tensor(float("inf")))
    assert replay_matches(ex, rid, run.forward_log) is False
    e2e.release_executor(ex)


def _optimistic_setup(
    num_requests: int, kv_sample_every: int, seeds: int
) -> tuple[argparse.Namespace, Calibration, Any]:
    """bench_optimistic's options (prompts of 128 tokens, chunks of 16), the made-up calibration
    and the shared model (build it under ``tiny_model``)."""
    opts = bo.parse_args(
        ["--num-requests", str(num_requests), "--input-len", "128", "--chunked-prefill-size",
         "16", "--kv-sample-every", str(kv_sample_every), "--seeds", str(seeds)], quick=True,
    )  # fmt: skip
    model = e2e.shared_model(orun.Trace.server_args(opts, 0, 0.0, "write_back"))
    return opts, linear_calibration(), model


@pytest.mark.usefixtures("tiny_model")
def test_optimistic_on_the_virtual_clock_repeats_exactly() -> None:
    opts, cal, model = _optimistic_setup(8, kv_sample_every=2, seeds=3)
    prefill_s = orun.calibrate_prefill_s(opts, model, cal)
    assert prefill_s == orun.calibrate_prefill_s(opts, model, cal)
    delay = orun.DelayDistribution("uniform", 0.5 * prefill_s, 1.5 * prefill_s)
    arrivals = poisson_arrivals(8, 0.5 / prefill_s, 3)
    trace = orun.make_trace(opts, 3, arrivals, delay, 0.0)
    a, b = (orun.run_config(trace, 2, "write_back", model, cal) for _ in range(2))
    assert a["successes"] == 8 and a["ttft_samples_s"] == b["ttft_samples_s"]
    assert a["optimistic_admissions"] > 0 and a["parks"] + a["yields"] > 0
    assert a["recomputed_tokens"] == b["recomputed_tokens"]
    assert not any(a["integrity"][k] for k in VIOLATIONS)
    assert a["integrity"]["kv_strict_checked"] == a["integrity"]["kv_checked_requests"] == 4


@pytest.mark.usefixtures("tiny_model")
def test_write_through_retries_recompute_what_write_back_keeps() -> None:
    """Forced retries on one trace: under write_back a retry recomputes only the last page (the
    yield published the rest); under write_through it recomputes what the yield dropped."""
    if "write_through" not in orun.available_policies():
        pytest.skip("ServerArgs has no optimistic_prefill_write_through")
    opts, cal, model = _optimistic_setup(6, kv_sample_every=1, seeds=1)
    delay = orun.DelayDistribution("fixed", 1.0)  # peers ready long after any prefill
    trace = orun.make_trace(opts, 1, [0.01 * i for i in range(6)], delay, 0.0, 1.0)
    per_yield = {}
    for policy in ("write_back", "write_through"):
        res = orun.run_config(trace, 2, policy, model, cal)
        assert res["successes"] == 6 and res["yields"] == 6  # every first attempt yields
        assert not any(res["integrity"][k] for k in VIOLATIONS)
        assert res["integrity"]["kv_strict_checked"] == 6
        assert res["integrity"]["speculative_l2_pages"] == 0
        assert res["recomputed_tokens"] == res["executor_yield_recomputed_tokens"]
        per_yield[policy] = res["recomputed_tokens_per_yield"]
    assert per_yield["write_back"] == 16  # the last page: a match leaves one token to compute
    uncached = 128 - int(128 * 0.8) // 16 * 16  # what each first attempt computed
    assert per_yield["write_through"] == uncached == 32


def test_compute_ledger_counts_positions_computed_twice() -> None:
    ex = types.SimpleNamespace(batch_runner=types.SimpleNamespace(forward=lambda batch: batch))
    ledger = orun.ComputeLedger(ex)

    def req(rid: str, computed: int) -> Any:
        return types.SimpleNamespace(rid=rid, computed_len=computed)

    ex.batch_runner.forward([(req("a", 0), 32), (req("b", 0), 16)])
    ex.batch_runner.forward([(req("a", 32), 16)])  # a yields; its retry starts at 16 (one page)
    ex.batch_runner.forward([(req("a", 16), 48)])  # recomputes [16, 48)
    assert ledger.recomputed("a") == 32
    assert ledger.recomputed("b") == 0
    assert ledger.total_recomputed(["a", "b", "c"]) == 32


# ------------------------------------------------------------------------------ suite CLI
def test_only_rejects_an_unknown_name_and_lists_the_valid_ones(
    capsys: pytest.CaptureFixture[str],
) -> None:
    with pytest.raises(SystemExit) as exc:
        suite.main(["--only", "multiturn", "bogus"])
    assert exc.value.code == 2
    err = capsys.readouterr().err
    assert "unknown benchmark bogus" in err
    assert "valid names: transfer, cache_ops, multiturn, optimistic" in err


def test_partial_run_merges_its_section_into_the_summary(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    fake = types.ModuleType("fake_bench")
    fake.run = lambda quick, out_dir: {"value": 2, "integrity": {"leaked_slots": 0}}  # type: ignore[attr-defined]
    monkeypatch.setitem(sys.modules, "fake_bench", fake)
    monkeypatch.setattr(suite, "SUITE", [("fake_bench", "cache_ops"), ("fake_bench", "transfer")])
    path = tmp_path / "summary.json"
    path.write_text(json.dumps({"cache_ops": {"value": 1}, "multiturn": {"kept": True},
                                "integrity": {"leaked_slots": 5}}))  # fmt: skip
    assert suite.main(["--only", "cache_ops", "--out", str(tmp_path)]) == 0
    data = json.loads(path.read_text())
    assert data["cache_ops"] == {"value": 2, "integrity": {"leaked_slots": 0}}
    assert data["multiturn"] == {"kept": True}
    assert "transfer" not in data
    assert data["integrity"]["leaked_slots"] == 0  # recomputed from the sections present
    assert data["run"]["commit"] and "timestamp" in data["run"]


def test_run_info_outside_a_repository(tmp_path: Path) -> None:
    assert git_commit(tmp_path) == {"commit": "unknown", "dirty": None}
    info = run_info()
    assert len(info["loadavg_1_5_15"]) == 3 and info["timestamp"][:2] == "20"


# ------------------------------------------------------------------------------ gpu_check.sh
@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the path without a CUDA torch")
def test_gpu_check_without_cuda_torch_stops_with_one_line(tmp_path: Path) -> None:
    env = {**os.environ, "PYTHON": sys.executable}
    proc = subprocess.run(["bash", str(ROOT / "bench" / "gpu_check.sh"), str(tmp_path / "out")],
                          capture_output=True, text=True, timeout=120, env=env)  # fmt: skip
    assert proc.returncode == 3
    lines = proc.stdout.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("gpu_check: STOP: torch ")
    assert "not a CUDA build" in lines[0]
    assert (tmp_path / "out" / "status.txt").read_text() == "probe rc=3\n"


def test_compare_reports_the_largest_ratio_difference(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    from bench import compare

    def summary(wb: float, a2: float) -> dict[str, Any]:
        return {
            "multiturn": {"device_only": {"ttft_mean_speedup_vs_device_only": 1.0},
                          "write_back": {"ttft_mean_speedup_vs_device_only": wb}},
            "optimistic": {"attempts_0": {"ttft_mean_speedup_vs_0": 1.0},
                           "attempts_0_with_failures": {"ttft_mean_speedup_vs_0": 1.0},
                           "attempts_2": {"ttft_mean_speedup_vs_0": a2}, "seeds": [0]},
        }  # fmt: skip

    a, b = tmp_path / "a.json", tmp_path / "b.json"
    a.write_text(json.dumps(summary(3.0, 1.6)))
    b.write_text(json.dumps(summary(3.06, 1.6)))
    assert compare.main([str(a), str(b)]) == 0
    out = capsys.readouterr().out
    assert "multiturn/write_back" in out and "2.00%" in out and "attempts_0" not in out
    assert compare.main([str(a), str(b), "--tolerance", "0.01"]) == 1
    b.write_text(json.dumps({"transfer": {}}))
    assert compare.main([str(a), str(b)]) == 2


def test_aggregate_over_the_seeds_each_configuration_ran() -> None:
    from bench.e2e.report import aggregate_seeds

    def row(ttft: float, ratio: float | None) -> dict[str, Any]:
        return {"ttft_mean_s": ttft, "r": ratio, "yields": 2, "integrity": {"leaked_slots": 0}}

    per_seed = {
        0: {"base": row(2.0, 1.0), "fast": row(1.0, 2.0)},
        1: {"base": row(3.0, 1.0), "fast": row(1.0, 3.0)},
        2: {"base": row(4.0, 1.0)},  # cut short by a deadline
    }
    out = aggregate_seeds(per_seed, ("ttft_mean_s", "yields", "r"), "r")
    assert out["base"]["seeds"] == [0, 1, 2] and out["fast"]["seeds"] == [0, 1]
    assert out["fast"]["r"] == 2.5
    assert out["fast"]["r_spread"] == {"mean": 2.5, "min": 2.0, "max": 3.0,
                                       "stdev": pytest.approx(0.7071, abs=1e-4),
                                       "per_seed": [2.0, 3.0]}  # fmt: skip
    assert out["base"]["ttft_mean_s"] == 3.0 and out["base"]["yields"] == 2.0
    assert out["base"]["integrity"] == {"leaked_slots": 0}


def test_suite_passes_the_e2e_flags_and_runs_fidelity_without_them(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    seen: dict[str, Any] = {}

    def fake_run(key: str) -> Any:
        def run(quick: bool, out_dir: Path, argv: list[str]) -> dict[str, Any]:
            seen[key] = argv
            return {"integrity": {}}

        return run

    for key in ("e2e", "fid"):
        mod = types.ModuleType(f"fake_{key}")
        mod.run = fake_run(key)  # type: ignore[attr-defined]
        monkeypatch.setitem(sys.modules, f"fake_{key}", mod)
    monkeypatch.setattr(suite, "SUITE", [("fake_e2e", "multiturn"), ("fake_fid", "fidelity")])
    cal = tmp_path / "calibration.json"
    assert suite.main(["--out", str(tmp_path), "--calibration", str(cal), "--no-sweeps"]) == 0
    assert seen == {"e2e": ["--calibration", str(cal), "--no-sweeps"], "fid": []}


def test_end_to_end_benchmarks_default_to_the_wall_clock_on_cuda(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    from bench.e2e import report

    assert bm.parse_args([], quick=True).clock == "virtual"  # this machine: no CUDA
    for mod in (report, bm, bo):
        monkeypatch.setattr(mod, "on_cuda", lambda: True)
    for parse in (bm.parse_args, bo.parse_args):
        opts = parse([], quick=True)
        assert opts.clock == "wall" and not opts.sweeps
        assert parse(["--clock", "virtual"], quick=True).clock == "virtual"


def test_optimistic_ceiling_is_set_by_the_delay_distribution() -> None:
    from bench.optimistic.sweep import ceiling, delay_for

    p = 0.01
    assert ceiling(delay_for(1.0, p), p) == pytest.approx(16 / 9)  # E[B+P] = 2P, E[max] = 9P/8
    assert ceiling(delay_for(0.25, p), p) == pytest.approx(1.25)  # B < P always: E[max] = P
    assert ceiling(delay_for(2.0, p), p) == pytest.approx(1.5)  # B > P always: E[max] = E[B]


def test_compare_covers_the_sweeps() -> None:
    from bench import compare

    sweeps = {"configs": ["device_only", "write_back"],
              "load": [{"load": 0.5, "ratios": {"write_back": 2.0}}],
              "working_set": [{"working_set_ratio": 8.0, "ratios": {"write_back": 3.0}}]}
    summary = {"multiturn": {"device_only": {"ttft_mean_speedup_vs_device_only": 1.0},
                             "sweeps": sweeps}}  # fmt: skip
    assert compare.headline_ratios(summary) == {
        "multiturn/sweep/load=0.5/write_back": 2.0,
        "multiturn/sweep/working_set=8.0/write_back": 3.0,
    }


def test_optimistic_run_order_and_attempts_flag(monkeypatch: pytest.MonkeyPatch) -> None:
    """The headline pair runs first in each seed; ``--attempts`` keeps only the counts asked for
    (the CPU quick size: 2 and 0) and must include the baseline 0."""
    base = ("", 0.0, 0.25, 0.0, ["write_back", "write_through"])
    forced = ("_forced_retry", 0.0, 0.25, 0.5, ["write_back"])
    full = bo.run_order([0], [base, forced])
    assert [(v[0], p, a) for _, v, p, a in full] == [
        ("", "write_back", 2), ("", "write_back", 0), ("", "write_through", 2),
        ("", "write_through", 0), ("", "write_back", 1), ("", "write_through", 1),
        ("_forced_retry", "write_back", 2), ("_forced_retry", "write_back", 0),
        ("_forced_retry", "write_back", 1)]  # fmt: skip
    pair = bo.run_order([0, 1], [base, forced], (0, 2))
    assert {a for *_, a in pair} == {0, 2} and len(pair) == 12
    assert [a for *_, a in pair[:4]] == [2, 0, 2, 0]
    monkeypatch.setattr(bo, "on_cuda", lambda: False)
    assert bo.parse_args([], quick=True).attempts == [2, 0]
    assert bo.parse_args([], quick=False).attempts == [2, 0, 1]
    with pytest.raises(ValueError, match="--attempts"):
        bo.parse_args(["--attempts", "1", "2"], quick=True)
