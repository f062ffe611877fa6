"""Host cost of one per-layer load call (``transfer_kv_per_layer_pf_lf``, the call a load-back makes
once per layer before the forward may read that layer), with and without the launch-plan cache
(``kernels.ops.plans``).

- ``cached``: the ops as they run (a repeated call over the same pool tensors checks only its
  indices);
- ``uncached``: the same path with the cache bypassed (every call validates the pool tensors
  and plans its launch, which is what every call did before the cache).

Both run over one pool of a Llama-3-8B-shaped layer (8 KV heads x 128, bf16: 2 KiB per token and
layer), ``--layers`` layers, ``--tokens`` random slots (16 by default: the host's cost does not
depend on the count, and on CUDA a copy this small keeps the GPU ahead of the host, so the time
measured is the host's, not the link's). On CUDA each call also launches the compiled kernel
(host time per call; the GPU queue is drained between rounds). Without CUDA the
Triton launch itself is replaced by a no-op (an interpreted launch is no measure of anything, and a
CPU benchmark run takes the torch reference instead, ``bench/__init__.py``): the number is the
project's own Python per call on the Triton path, and the index ranges are left to the kernel as
on CUDA without debug checks (``checks.device_range_checks``), so the host does not read them.

    python -m bench.transfer.launch_cost [--calls 3200] [--out results]
"""

from __future__ import annotations

import argparse
import contextlib
import statistics
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch

import kernels
from bench.common import write_json
from kernels.ops import checks, dispatch

HEADS, HEAD_DIM = 8, 128


@contextlib.contextmanager
def _mode(mode: str, cuda: bool) -> Iterator[None]:
    saved = dispatch.cached_plan, dispatch.launch_kv_copy, dispatch._runs_triton
    if mode == "uncached":
        dispatch.cached_plan = lambda call, bq, nw, make: make()  # type: ignore[assignment]
    if not cuda:
        dispatch.launch_kv_copy = lambda launch: None  # type: ignore[assignment]
        dispatch._runs_triton = lambda device: True  # type: ignore[assignment]
    try:
        with contextlib.nullcontext() if cuda else checks.device_range_checks():
            yield
    finally:
        dispatch.cached_plan, dispatch.launch_kv_copy, dispatch._runs_triton = saved


def measure(calls: int = 3200, layers: int = 32, tokens: int = 16, rounds: int = 7) -> dict:
    """Median microseconds per call over ``rounds`` rounds of ``calls`` calls (whole forwards
    of ``layers`` calls each), per mode."""
    cuda = torch.cuda.is_available()
    device = torch.device("cuda" if cuda else "cpu")
    slots = max(tokens * 2, 256)
    host = torch.zeros(2, slots, layers, HEADS, HEAD_DIM, dtype=torch.bfloat16,
                       pin_memory=cuda)  # fmt: skip
    dev = torch.zeros(2, layers, slots, HEADS, HEAD_DIM, dtype=torch.bfloat16, device=device)
    dev_k, dev_v = list(dev[0]), list(dev[1])
    gen = torch.Generator().manual_seed(0)
    h = torch.randperm(slots, generator=gen)[:tokens].to(device)
    d = torch.randperm(slots, generator=gen)[:tokens].to(device)
    item = HEADS * HEAD_DIM * 2

    def forward_of_loads(n: int) -> None:
        for i in range(n):
            layer = i % layers
            kernels.transfer_kv_per_layer_pf_lf(host[0], dev_k[layer], host[1], dev_v[layer],
                                                h, d, layer, item, item * layers)  # fmt: skip

    out: dict[str, Any] = {"calls_per_round": calls, "layers": layers, "tokens": tokens,
                           "device": str(device),
                           "launch": "real" if cuda else "no-op"}  # fmt: skip
    # CUDA: host wall time (the launch included); CPU: this thread's CPU time, which other jobs
    # on a shared machine do not inflate (as the calibration's timer, bench.common.call_timer).
    clock = time.perf_counter if cuda else time.thread_time
    out["timer"] = "perf_counter" if cuda else "thread_time"
    for mode in ("uncached", "cached"):
        with _mode(mode, cuda):
            forward_of_loads(layers)  # warm: compile (CUDA), first plans
            samples = []
            for _ in range(rounds):
                if cuda:
                    torch.cuda.synchronize()
                t0 = clock()
                forward_of_loads(calls)
                samples.append((clock() - t0) / calls * 1e6)
            if cuda:
                torch.cuda.synchronize()
        out[f"{mode}_us_per_call"] = statistics.median(samples)
        out[f"{mode}_us_per_call_min"] = min(samples)
    out["speedup"] = out["uncached_us_per_call"] / out["cached_us_per_call"]
    out["cached_us_per_forward"] = out["cached_us_per_call"] * layers
    out["uncached_us_per_forward"] = out["uncached_us_per_call"] * layers
    return out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench.transfer.launch_cost",
                                description=__doc__.split("\n")[0])  # fmt: skip
    p.add_argument("--calls", type=int, default=3200, help="Calls per timed round.")
    p.add_argument("--layers", type=int, default=32)
    p.add_argument("--tokens", type=int, default=16)
    p.add_argument("--out", type=Path, default=Path("results"))
    args = p.parse_args(argv)
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        res = measure(args.calls, args.layers, args.tokens)
    finally:
        torch.set_num_threads(threads)
    print(f"[launch_cost] per-layer load call ({res['launch']} launch, {res['device']}, "
          f"{res['tokens']} tokens, {res['layers']} layers): uncached "
          f"{res['uncached_us_per_call']:.1f} us/call, cached {res['cached_us_per_call']:.1f} "
          f"us/call ({res['speedup']:.1f}x); per forward of {res['layers']} loads "
          f"{res['uncached_us_per_forward']:.0f} -> "
          f"{res['cached_us_per_forward']:.0f} us")  # fmt: skip
    path = write_json("launch_cost", res, args.out)
    print(f"[launch_cost] wrote {path}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
