"""How the end-to-end benchmarks build and give back an executor: the model geometry per device
(``model_args``, ``shared_model``), ``new_executor`` on a virtual or a wall clock, and between
configurations ``release_executor`` then ``free_memory`` (on CUDA every configuration of a
benchmark shares one model, the 8B-shaped model is ~14.5 GB, and what a configuration allocated
is given back before the next one is built). Every cache of one benchmark (its calibrations and
every configuration) takes its host pool from one ``SharedHostPool``: a pinned pool of the
8B-shaped quick run is 12.9 GB, and registering it costs seconds each time.

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
from bench.clock.trace_copies import CopyRecorder
from bench.clock.virtual_cost import CostAccountant, RecordingModel
from bench.common import call_timer
from hicache.tp.group import TPGroup
from prefill.clock import VirtualClock, WallClock
from prefill.disagg.sim_config import PeerConfig
from prefill.executor import OptimisticPrefillExecutor
from prefill.model.factory import build_model
from prefill.model.paged import PagedTransformer
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
# --use-mla: DeepSeek's latent (kv_lora_rank 512 + qk_rope_head_dim 64: the KV geometry the cache
# and its copies see, 2304 B per token and layer in fp32) on the CPU model's layers, heads and
# hidden size, with per-head widths narrowed as the hidden size is; on CUDA DeepSeek-V2-Lite's
# shape (server_args.MLA_PRESETS).
CPU_MLA = dict(use_mla=True, kv_lora_rank=512, qk_rope_head_dim=64, qk_nope_head_dim=32,
               v_head_dim=32)  # fmt: skip
GPU_MLA_MODEL = dict(model_preset="deepseek-v2-lite-shape", use_mla=True, dtype="bfloat16")

CLOCKS = ("virtual", "wall")

def model_args(use_mla: bool = False) -> dict[str, Any]:
    """``ServerArgs`` fields of the end-to-end benchmarks' model: the Llama-3-8B-shaped preset
    in bf16 on CUDA, ``CPU_MODEL`` on a CPU; with ``use_mla`` (``--use-mla``) the DeepSeek-V2-
    Lite-shaped preset on CUDA, ``CPU_MODEL`` with ``CPU_MLA``'s attention on a CPU.
    ``vocab_size`` is always present."""
    if on_cuda():
        return {**(GPU_MLA_MODEL if use_mla else GPU_MODEL), "vocab_size": 32000}
    return {**CPU_MODEL, **CPU_MLA} if use_mla else dict(CPU_MODEL)


def shared_model(args: ServerArgs) -> PagedTransformer:
    """The model every configuration of a benchmark runs (same geometry, dtype and seed; MLA
    with ``--use-mla``: ``prefill.model.factory.build_model``)."""
    return build_model(args)


class SharedHostPool:
    """One host pool for every cache a benchmark builds: allocated (and on CUDA registered) by
    the first hierarchical cache, handed to each later one with a fresh allocator
    (``build_kv_cache(..., host_pool=...)``), destroyed by ``release``. Every configuration of a
    benchmark asks for the same pool (same device pool, ratio and layout); one that asks for
    another raises ``ValueError`` naming what differs. ``allocations``: pools allocated."""

    def __init__(self) -> None:
        self.pool: Any = None
        self.allocations = 0

    def build(self, args: ServerArgs) -> Any:
        """``build_kv_cache(args)`` over the shared host pool (the previous cache must be
        closed)."""
        from hicache.builder import build_kv_cache

        if not args.enable_hierarchical_cache:
            return build_kv_cache(args)
        if self.pool is not None:
            return build_kv_cache(args, host_pool=self.pool)
        cache = build_kv_cache(args)
        self.pool = cache.host_pool
        self.allocations += 1
        return cache

    def release(self) -> None:
        """Unregister and drop the pool (its memory returns with ``free_memory``)."""
        if self.pool is not None:
            self.pool.destroy()
            self.pool = None


def release_executor(ex: OptimisticPrefillExecutor, host: SharedHostPool | None = None) -> None:
    """Finish the cache's copies and unregister its pinned host pool, unless it is ``host``'s
    shared one (the executor is unusable afterwards). The memory itself returns once the last
    reference is gone: ``free_memory``."""
    ex.cache.close()
    pool = ex.cache.host_pool
    if pool is not None and (host is None or pool is not host.pool):
        pool.destroy()


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
    host: SharedHostPool | None = None,
    copies: CopyRecorder | None = None,
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
    rank reads rank 0's time). ``host``: the benchmark's ``SharedHostPool`` (one rank).
    ``copies``: records the cache's real copies, on either clock (the calibration trace's
    wall-clock runs, ``bench.clock.trace_copies``)."""
    virtual = calibration is not None if virtual is None else virtual
    if virtual and calibration is None:
        raise ValueError("calibration: a virtual clock needs one")
    if calibration is not None:
        peer = dataclasses.replace(peer, **calibration.transfer.peer_fields())
    clock = VirtualClock() if virtual else WallClock()
    if group is not None:
        clock = agreed_clock(clock, group, None)
    common = dict(peer_config=peer, clock=clock, keep_received=True, send_log_size=None,
                  decode_pool_size=decode_pool_tokens, group=group,
                  cache=None if host is None else host.build(args))  # fmt: skip
    if not virtual:
        ex = make_executor(args, model=model, **common)
        if copies is not None and ex.cache.controller is not None:
            copies.install(ex.cache.controller)
        return ex, None
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
        if copies is not None:
            copies.install(ex.cache.controller)
    cost.install_decode(ex.decode)
    meter.install(ex)
    if acks_at_step_end:
        cost.release_acks()
    return ex, cost
