"""How the end-to-end benchmarks build and give back an executor: the model geometry per device
(``model_args``, ``shared_model``), ``new_executor`` on a virtual or a wall clock, and between
configurations ``release_executor`` then ``free_memory`` (on CUDA every configuration of a
benchmark shares one model, the 8B-shaped model is ~14.5 GB, and what a configuration allocated
is given back before the next one is built).

Two clocks (``--clock``):

- ``virtual`` (the default on a CPU): the executor's ``VirtualClock``, charged by
  ``bench.clock.virtual_cost.CostAccountant`` (forward, copies, co-run slowdown, transfer) and
  ``bench.clock.host_meter.HostMeter`` (host time) from a calibration measured in the same run
  or replayed (``bench.clock.calibrate``). The real model computes every forward and the cache
  moves every byte; after each scheduler step the driver waits for the cache's real copies
  (``CostAccountant.settle``) and acks are popped at their modelled time, so what happens
  depends only on the trace's seed and the calibration, never on thread timing or other jobs
  on the machine.
- ``wall`` (the default on CUDA): monotonic wall time; copies overlap for real, and results
  move with the machine's load.
"""

from __future__ import annotations

import dataclasses
import gc
import logging
from typing import Any

import torch

from bench.clock.calibrate import Calibration
from bench.clock.host_meter import HostMeter
from bench.clock.virtual_cost import CostAccountant, RecordingModel
from bench.common import call_timer
from hicache.tp.group import TPGroup
from prefill.clock import VirtualClock, WallClock
from prefill.disagg.sim_config import PeerConfig
from prefill.executor import OptimisticPrefillExecutor
from prefill.model.paged import ModelConfig, PagedTransformer
from prefill.testing.harness import make_executor
from prefill.tp.driver import agreed_clock
from server_args import ServerArgs

logger = logging.getLogger(__name__)

# Model geometry of the CPU runs: small enough for minutes on 2 cores, heavy enough that a
# prefill costs more than copying its KV back from host memory (as on a GPU with a real model:
# on this CPU recomputing a token costs ~10x loading its 4 KiB of KV back, measured in the run).
CPU_MODEL = dict(num_layers=4, num_attention_heads=8, head_num=4, head_dim=32, hidden_size=256,
                 intermediate_size=768, vocab_size=1024, dtype="float32")  # fmt: skip
GPU_MODEL = dict(model_preset="llama3-8b-shape", dtype="bfloat16")

CLOCKS = ("virtual", "wall")

def model_args() -> dict[str, Any]:
    """``ServerArgs`` fields of the end-to-end benchmarks' model: the Llama-3-8B-shaped preset
    in bf16 on CUDA, ``CPU_MODEL`` on a CPU. ``vocab_size`` is always present."""
    if on_cuda():
        return {**GPU_MODEL, "vocab_size": 32000}
    return dict(CPU_MODEL)


def shared_model(args: ServerArgs) -> PagedTransformer:
    """The model every configuration of a benchmark runs (same geometry, dtype and seed)."""
    return PagedTransformer(ModelConfig.from_server_args(args), args.resolved_device())


def release_executor(ex: OptimisticPrefillExecutor) -> None:
    """Finish the cache's copies and unregister its pinned host pool (the executor is unusable
    afterwards). The memory itself returns once the last reference is gone: ``free_memory``."""
    ex.cache.close()
    if ex.cache.host_pool is not None:
        ex.cache.host_pool.destroy()


def free_memory() -> None:
    """Collect reference cycles (decode peers and their side point at each other, holding the
    device and decode pools) and return cached CUDA blocks, between configurations."""
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats()


def on_cuda() -> bool:
    return torch.cuda.is_available()


def device_kind() -> str:
    """``cuda`` or ``cpu``: the key of per-device sizes."""
    return "cuda" if on_cuda() else "cpu"


def cpu_note() -> str | None:
    """What a reader must know about CPU numbers, or None on CUDA."""
    if on_cuda():
        return None
    return (
        "CPU run: the model and all copies run on the CPU; the kernel io backend uses the torch "
        "reference of the kvcacheio ops (Triton kernels are timed on CUDA only). Times are CPU "
        "times, not GPU times."
    )


def new_executor(
    args: ServerArgs,
    peer: PeerConfig,
    decode_pool_tokens: int,
    model: PagedTransformer,
    calibration: Calibration | None = None,
    group: TPGroup | None = None,
    virtual: bool | None = None,
    host_mode: str = "model",
    record_host: bool = False,
    acks_at_step_end: bool = False,
    host_profile: str | None = None,
) -> tuple[OptimisticPrefillExecutor, CostAccountant | None]:
    """An executor whose decode side keeps received KV (sampled, see ``Driver``) in a pool of
    ``decode_pool_tokens``.

    ``virtual`` (default: whether a ``calibration`` is given): on a ``VirtualClock`` charged by
    a ``CostAccountant`` (returned) from ``calibration``, with the host phases measured and
    charged by a ``HostMeter``; else on wall time (``None`` returned). ``host_mode``:
    ``model`` (the calibration's host costs, the ``host_profile`` of this configuration;
    ``off`` when it has none), ``measured`` or ``off``; ``record_host`` keeps the samples, for
    ``fit_host_costs``; ``acks_at_step_end``: acks are not held to their modelled time but
    popped once the real copy finished, i.e. at the next step after the driver's wait (what the
    virtual clock did before acks were modelled). On either clock the calibration's transfer
    model sets the simulated peers' own wait (``TransferModel``). ``group``: the
    tensor-parallel cache group (this rank's cache and decode side; the clock wrapped so every
    rank reads rank 0's time)."""
    virtual = calibration is not None if virtual is None else virtual
    if virtual and calibration is None:
        raise ValueError("calibration: a virtual clock needs one")
    if calibration is not None:
        peer = dataclasses.replace(peer, **calibration.transfer.peer_fields())
    clock = VirtualClock() if virtual else WallClock()
    if group is not None:
        clock = agreed_clock(clock, group, None)
    common = dict(peer_config=peer, clock=clock, keep_received=True, send_log_size=None,
                  decode_pool_size=decode_pool_tokens, group=group)  # fmt: skip
    if not virtual:
        return make_executor(args, model=model, **common), None
    assert calibration is not None
    if host_mode == "model" and calibration.host is None:
        host_mode = "off"
    device = torch.device(args.resolved_device())
    costs = None if calibration.host is None else calibration.host.profile(host_profile)
    meter = HostMeter(clock, call_timer(device, calibration.timer), host_mode, costs,
                      record=record_host)  # fmt: skip
    recording = RecordingModel(model, meter)
    cost = CostAccountant(calibration, clock, recording, meter)
    ex = make_executor(args, model=recording, cost_model=cost, modelled_copies=cost, **common)
    if ex.cache.controller is not None:
        cost.install(ex.cache.controller)
    cost.install_decode(ex.decode)
    meter.install(ex)
    if acks_at_step_end:
        cost.release_acks()
    return ex, cost
