"""Multi-turn conversations through the prefill executor: device cache only vs the L2 cache under
each write policy, on one trace per seed (SGLang ``bench_multiturn`` style, output length 1).

Each client starts with a ``--request-length`` prompt; every later round appends a
``--sub-question-input-length`` question to the whole history. Requests leave a ready queue at
Poisson times, at most ``--max-parallel`` in flight. The rate is ``--load`` times the rate at
which a device-only server could prefill the trace's prompts from scratch (from the calibrated
forward cost), so the offered load does not depend on how fast this machine is. The device pool
is sized so the working set is ``--working-set-ratio`` times the pool, so history spills to L2.

Headline: mean TTFT of device-only / mean TTFT of each configuration, per seed, reported as
mean and spread over ``--seeds``; on the virtual clock (the default on a CPU) it depends only on
the seeds and the calibration, measured at the start and written to ``calibration.json``, or
replayed with ``--calibration FILE`` (``bench.e2e.driver``, ``bench.clock.calibrate``). TTFT
runs from the client's send (after a ``--max-parallel`` slot freed) to the transfer's Success.
With ``--sweeps`` (the default on a CPU) the ratio is also measured against the load and the
working set (``bench.multiturn.sweep``).

    python -m bench.multiturn [--quick] [--out results] [--clock wall] [--seeds 0 1 2]
"""

from __future__ import annotations

from pathlib import Path

from bench.multiturn.single import run_single
from bench.multiturn.tp import run_tp
from bench.multiturn.trace import parse_args


def run(quick: bool = True, out_dir: Path = Path("results"), argv: list[str] | None = None) -> dict:
    """Every configuration under every seed (``--tp N``: on N tensor-parallel ranks); returns
    the summary keyed by configuration."""
    opts = parse_args(argv or [], quick)
    return run_tp(opts, out_dir) if opts.tp > 1 else run_single(opts, out_dir)
