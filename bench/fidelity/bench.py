"""Is the virtual clock right? One small trace of each end-to-end benchmark, run on the virtual
clock and on wall time with the same workload, compared ratio by ratio.

For each benchmark: a calibration measured now with the **wall** timer (``perf_counter``, what
the wall-clock runs are timed with; the headline calibrations use the CPU time of the calling
thread on a CPU), its host costs from the benchmark's own host calibration trace, and the
workload fixed from it (multi-turn: the arrival rate at ``--load`` of capacity; optimistic: the
prefill time on the virtual clock, which sets the bootstrap delays and the arrival rate). Then
each configuration runs on three clocks:

- ``wall``: real time, ``WALL_REPEATS`` runs, the configurations taken in turn (so a drift of
  the machine's speed touches each alike), each between two speed probes (``SpeedProbe``: a
  forward of one table shape timed now over the table's value; a shared machine's other jobs,
  and this one's own jitter, change its speed by tens of percent within minutes; recorded, not
  corrected for); the entry is their mean;
- ``virtual``: the virtual clock with everything it charges (forward, copies and their co-run
  slowdown, host time, the transfer, acks at their modelled time);
- ``virtual_uncharged``: the same, as the virtual clock was before host time, the transfer, the
  co-run slowdown and modelled acks were charged (no host time, a free transfer, acks popped at
  the end of the step), to show what each headline gained from the missing costs.

Per headline ratio (``multiturn/<config>``: device-only / config; ``optimistic/attempts_2`` and
``optimistic_write_through/attempts_2``: 0 attempts / 2) the entry holds ``virtual``, ``wall``,
``gap = (virtual - wall) / wall``, and the uncharged ratio and its gap. Wall numbers move with
the machine's load (the run's load average is recorded); the target is a gap within 15% on a
CPU. Results: ``fidelity.json`` and the ``fidelity`` section of the suite summary; the two
calibrations are kept in the output folder's ``calibration.json`` as ``fidelity_multiturn`` and
``fidelity_optimistic``.

    python -m bench.fidelity [--out results] [--no-uncharged] [--corun-from FILE]
                             [--transfer-gbps G --transfer-latency-us L]
"""

from __future__ import annotations

import argparse
import dataclasses
import math
import os
import statistics
import time
from pathlib import Path
from typing import Any

import torch

from bench.clock.calibrate import Calibration, describe, forward_curve
from bench.clock.calibration_file import write_calibration
from bench.clock.corun import CorunSlowdown
from bench.clock.transport import TransferModel
from bench.common import call_timer, sync_device
from bench.e2e.calibrated import obtain_calibration
from bench.e2e.report import sum_integrity, write_result
from bench.e2e.setup import cpu_note, device_kind, free_memory, shared_model
from bench.e2e.workload import poisson_arrivals
from bench.multiturn import single as mt
from bench.multiturn import trace as mtt
from bench.optimistic import bench as ob
from bench.optimistic import run as orun
from bench.optimistic.sweep import delay_for

__all__ = ["GAP_TARGET", "run", "uncharged"]

GAP_TARGET = 0.15
CONFIGS = ["--seeds", "0", "--configs", "device_only", "write_through", "write_back"]
MULTITURN = {"cpu": ["--num-clients", "16", "--num-rounds", "4", "--kv-sample-every", "16"],
             "cuda": ["--num-clients", "6", "--num-rounds", "3", "--kv-sample-every", "6"]}
OPTIMISTIC = {"cpu": ["--num-requests", "80", "--kv-sample-every", "20"],
              "cuda": ["--num-requests", "16", "--kv-sample-every", "8"]}  # fmt: skip
"""The small traces, per device (the GPU's model is Llama-3-8B-shaped, its prompts long)."""
CAL_ROUNDS = 7
WALL_REPEATS = 2
"""Wall runs per configuration, the configurations taken in turn (``_clocks``)."""
OUT = [Path("results")]
"""Where ``run`` writes: the calibrations go to its ``calibration.json`` as ``fidelity_<bench>``
(kept, so a run's virtual side can be replayed: ``load_calibration(path, "fidelity_...")``)."""


def uncharged(cal: Calibration) -> Calibration:
    """``cal`` charging what the virtual clock charged before: forward and copies only."""
    return dataclasses.replace(cal, host=None, transfer=TransferModel(0.0, math.inf, "flag"),
                               corun=CorunSlowdown(1.0, "flag"))  # fmt: skip


def _entry(v: float, w: float, u: float | None) -> dict[str, float | None]:
    gap_u = None if u is None else (u - w) / w
    return {"virtual": v, "wall": w, "gap": (v - w) / w, "virtual_uncharged": u,
            "gap_uncharged": gap_u}  # fmt: skip


class SpeedProbe:
    """The machine's speed now against the calibration's: a forward of one mid-table shape,
    timed as the calibration timed it (median of 7), over the table's value for it. Taken before
    and after every wall run, so a reader sees how far the machine's load drifted (1.0: as
    calibrated; 2.0: twice as slow); nothing is corrected by it."""

    def __init__(self, cal: Calibration, model: Any, args: Any) -> None:
        from hicache.memory.device_pool import device_pool_from_server_args
        from prefill.model.paged import ExtendInput

        f = cal.forward
        self.n = f.ns[len(f.ns) // 2]
        self.table_s = f.one(self.n, 0)
        page = args.page_size
        self.pool = device_pool_from_server_args(args, size=self.n + 2 * page)  # MHA or MLA
        ids = torch.arange(1, self.n + 1) % model.config.vocab_size
        self.batch = [ExtendInput(ids, torch.arange(page, page + self.n), 0)]
        self.model = model
        self.clock = call_timer(self.pool.device, cal.timer)

    def __call__(self) -> float:
        times = []
        for _ in range(7):
            sync_device(self.pool.device)
            t0 = self.clock()
            self.model.forward_extend(self.pool, self.batch)
            sync_device(self.pool.device)
            times.append(self.clock() - t0)
        return statistics.median(times) / self.table_s


def _clocks(
    labels: list[str], run_one: Any, with_uncharged: bool, probe: SpeedProbe, kind: str
) -> dict[str, dict[str, dict[str, Any]]]:
    """Per label: ``WALL_REPEATS`` wall runs, the labels taken in turn (a shared machine's
    speed drifts by tens of percent within minutes: in turn, every label sees the same drift),
    each between two speed probes (recorded, not corrected for); the wall entry is their mean
    TTFT (each run's kept in ``ttft_mean_s_runs``). Then the virtual runs on the calibration as
    measured. ``run_one(label, clock)``."""
    walls: dict[str, list[dict[str, Any]]] = {label: [] for label in labels}
    for _ in range(WALL_REPEATS):
        for label in labels:
            before = probe()
            res = run_one(label, "wall")
            res["speed_vs_calibration"] = [before, probe()]
            walls[label].append(res)
    out: dict[str, dict[str, dict[str, Any]]] = {}
    for label in labels:
        runs = walls[label]
        wall = dict(runs[0])
        wall["ttft_mean_s_runs"] = [r["ttft_mean_s"] for r in runs]
        wall["ttft_mean_s"] = statistics.fmean(wall["ttft_mean_s_runs"])
        wall["speed_vs_calibration"] = [x for r in runs for x in r["speed_vs_calibration"]]
        out[label] = {"wall": wall}
        for clock in ("virtual",) + (("virtual_uncharged",) if with_uncharged else ()):
            out[label][clock] = run_one(label, clock)
        line = ", ".join(f"{c} {r['ttft_mean_s'] * 1e3:.2f} ms" for c, r in out[label].items())
        each = " / ".join(f"{t * 1e3:.2f}" for t in wall["ttft_mean_s_runs"])
        speeds = " ".join(f"x{x:.2f}" for x in wall["speed_vs_calibration"])
        print(f"    {kind} {label}: TTFT mean {line} (wall runs {each} ms; machine {speeds} as "
              "slow as calibrated around them)", flush=True)  # fmt: skip
    return out


def _brief(res: dict[str, Any]) -> dict[str, Any]:
    vc = res.get("virtual_clock") or {}
    host = vc.get("host") or {}
    return {"ttft_mean_s": res["ttft_mean_s"], "successes": res["successes"],
            "host_hit_tokens": res.get("host_hit_tokens"), "wall_s": res["wall_s"],
            "clock_span_s": res["clock_span_s"], "compute_s": vc.get("compute_s"),
            "host_charged_s": host.get("charged_s"), "host_measured_s": host.get("measured_s"),
            "transfer_s": vc.get("transfer_s"), "corun_extra_s": vc.get("corun_extra_s"),
            "acks_held": vc.get("acks_held"),
            "speed_vs_calibration": res.get("speed_vs_calibration"),
            "ttft_mean_s_runs": res.get("ttft_mean_s_runs")}  # fmt: skip


def multiturn(flags: list[str], with_uncharged: bool) -> dict[str, Any]:
    trace_args = MULTITURN[device_kind()] + CONFIGS
    opts = mtt.parse_args(trace_args + ["--no-sweeps"] + flags, quick=True)
    _, device_tokens = mtt.pool_sizes(opts)
    args = mtt.server_args_for("write_back", device_tokens, opts)
    model = shared_model(args)
    cal = obtain_calibration("multiturn", opts, args, model, opts.chunked_prefill_size,
                             mtt.longest_prompt(opts), None,
                             mt.host_trace(opts, model), timer="wall",
                             rounds=CAL_ROUNDS)  # fmt: skip
    print(f"[fidelity] multiturn calibration: {describe(cal)}", flush=True)
    write_calibration(OUT[0], "fidelity_multiturn", cal)
    rate = mtt.request_rate(opts, cal)
    seed = opts.seeds[0]
    probe = SpeedProbe(cal, model, args)

    def one(name: str, clock: str) -> dict[str, Any]:
        c = uncharged(cal) if clock == "virtual_uncharged" else cal
        res = mt.run_config(name, seed, device_tokens, rate, opts, model, c,
                            clock != "wall", quiet=True,
                            acks_at_step_end=clock == "virtual_uncharged")  # fmt: skip
        free_memory()
        return res

    runs = _clocks(list(opts.configs), one, with_uncharged, probe, "multiturn")
    entries = {}
    for name in opts.configs:
        if name == "device_only":
            continue
        r = {c: runs["device_only"][c]["ttft_mean_s"] / runs[name][c]["ttft_mean_s"]
             for c in runs[name]}  # fmt: skip
        entries[f"multiturn/{name}"] = _entry(r["virtual"], r["wall"], r.get("virtual_uncharged"))
    free_memory()
    return {"entries": entries, "calibration": _cal_brief(cal), "request_rate_per_s": rate,
            "trace": trace_args, "runs": {n: {c: _brief(x) for c, x in v.items()}
                                          for n, v in runs.items()},
            "integrity": sum_integrity({f"{n}/{c}": x for n, v in runs.items()
                                        for c, x in v.items()})}  # fmt: skip


def optimistic(flags: list[str], with_uncharged: bool) -> dict[str, Any]:
    trace_args = OPTIMISTIC[device_kind()] + ["--seeds", "0"]
    opts = ob.parse_args(trace_args + ["--no-sweeps"] + flags, quick=True)
    policies = [p for p in orun.available_policies() if p in opts.policies]
    args = orun.Trace.server_args(opts, 0, 0.0, "write_back")
    model = shared_model(args)
    cal = obtain_calibration("optimistic", opts, args, model, opts.chunk, opts.input_len, None,
                             ob.host_trace(opts, model, policies), timer="wall",
                             rounds=CAL_ROUNDS)  # fmt: skip
    print(f"[fidelity] optimistic calibration: {describe(cal)}", flush=True)
    write_calibration(OUT[0], "fidelity_optimistic", cal)
    prefill_s = orun.calibrate_prefill_s(opts, model, cal, True)
    delay = delay_for(opts.delay_scale, prefill_s)
    seed = opts.seeds[0]
    arrivals = poisson_arrivals(opts.num_requests, opts.utilization / prefill_s, seed)
    trace = orun.make_trace(opts, seed, arrivals, delay, 0.0)
    probe = SpeedProbe(cal, model, args)

    def one(key: str, clock: str) -> dict[str, Any]:
        policy, attempts = key.split("/attempts_")
        c = uncharged(cal) if clock == "virtual_uncharged" else cal
        res = orun.run_config(trace, int(attempts), policy, model, c, clock != "wall",
                              acks_at_step_end=clock == "virtual_uncharged")  # fmt: skip
        free_memory()
        return res

    keys = [f"{policy}/attempts_{a}" for policy in policies for a in (0, 2)]
    runs = _clocks(keys, one, with_uncharged, probe, "optimistic")
    entries = {}
    for policy in policies:
        b, a = runs[f"{policy}/attempts_0"], runs[f"{policy}/attempts_2"]
        r = {c: b[c]["ttft_mean_s"] / a[c]["ttft_mean_s"] for c in a}
        name = f"{ob.SECTIONS[policy]}/attempts_2"
        entries[name] = _entry(r["virtual"], r["wall"], r.get("virtual_uncharged"))
    free_memory()
    return {"entries": entries, "calibration": _cal_brief(cal), "prefill_s": prefill_s,
            "bootstrap_delay": {"low_s": delay.a, "high_s": delay.b}, "trace": trace_args,
            "runs": {n: {c: _brief(x) for c, x in v.items()} for n, v in runs.items()},
            "integrity": sum_integrity({f"{n}/{c}": x for n, v in runs.items()
                                        for c, x in v.items()})}  # fmt: skip


def _cal_brief(cal: Calibration) -> dict[str, Any]:
    return {"timer": cal.timer, "forward_curve": forward_curve(cal.forward),
            "h2d_gb_per_s": cal.h2d.bytes_per_s / 1e9, "transfer": cal.transfer.as_dict(),
            "corun": cal.corun.as_dict(), "host": None if cal.host is None else
            {k: v.as_dict() for k, v in cal.host.phases.items()}}  # fmt: skip


def run(quick: bool = True, out_dir: Path = Path("results"), argv: list[str] | None = None) -> dict:
    """Both benchmarks' fidelity; returns the ``fidelity`` summary section."""
    p = argparse.ArgumentParser(prog="python -m bench.fidelity", description=__doc__)
    p.add_argument("--uncharged", action=argparse.BooleanOptionalAction, default=True,
                   help="Also run the virtual clock without the newly charged costs.")
    p.add_argument("--corun-from", type=Path, default=None, metavar="FILE",
                   help="Charge the co-run slowdown of the GPU check's bench_transfer_sweep.json "
                   "instead of measuring it.")
    p.add_argument("--transfer-gbps", type=float, default=None)
    p.add_argument("--transfer-latency-us", type=float, default=None)
    opts = p.parse_args(argv or [])
    flags = [] if opts.corun_from is None else ["--corun-from", str(opts.corun_from)]
    for name in ("transfer_gbps", "transfer_latency_us"):
        if getattr(opts, name) is not None:
            flags += ["--" + name.replace("_", "-"), str(getattr(opts, name))]
    note = cpu_note()
    OUT[0] = out_dir
    t0 = time.perf_counter()
    load0 = os.getloadavg()
    parts = {"multiturn": multiturn(flags, opts.uncharged),
             "optimistic": optimistic(flags, opts.uncharged)}
    entries = {k: v for part in parts.values() for k, v in part["entries"].items()}
    summary = {
        "entries": entries,
        "gap_target": GAP_TARGET,
        "within_target": all(abs(e["gap"]) <= GAP_TARGET for e in entries.values()),
        "loadavg_before": [round(x, 2) for x in load0],
        "loadavg_after": [round(x, 2) for x in os.getloadavg()],
        "wall_s": time.perf_counter() - t0,
        "integrity": sum_integrity(parts),
        "note": note,
    }
    print("\n[fidelity] ratio                              virtual     wall      gap"
          "  uncharged    gap")  # fmt: skip
    for name, e in entries.items():
        u = e["virtual_uncharged"]
        print(f"  {name:<36} {e['virtual']:>7.3f}  {e['wall']:>7.3f}  {e['gap']:>+7.1%}  "
              + ("" if u is None else f"{u:>9.3f}  {e['gap_uncharged']:>+6.1%}"))
    print(f"[fidelity] every gap within {GAP_TARGET:.0%}: {summary['within_target']}; load "
          f"average {summary['loadavg_before']} -> {summary['loadavg_after']}")  # fmt: skip
    path = write_result(out_dir, "fidelity", {"summary": summary, **parts})
    print(f"[fidelity] wrote {path}")
    return summary
