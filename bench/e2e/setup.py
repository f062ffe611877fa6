"""How the end-to-end benchmarks build an executor, on one of two kinds of clock:

- wall: real time, the copies on their real streams (thread streams on a CPU); what is
  measured is this machine's time.
- a GPU profile (``bench.profile``): a ``VirtualClock`` charged through the product's seams,
  the executor's cost model (``ProfileTiming.forward``) and the controller's copy timer (each
  ack ready at its modelled end); the decode peers' transfer time from the profile's KV path.
  The real model still computes every forward and the cache moves every byte (so integrity and
  KV content are checked), but time is the profile's model's, token for token.
"""

from __future__ import annotations

import dataclasses
import gc
from typing import Any

import torch

from bench.profile import GpuProfile
from hicache_prefill.hicache.builder import KVCache, build_kv_cache
from hicache_prefill.hicache.transfer.controller import HiCacheController
from hicache_prefill.prefill.clock import VirtualClock, WallClock
from hicache_prefill.prefill.disagg.simulated import PeerConfig
from hicache_prefill.prefill.executor import OptimisticPrefillExecutor
from hicache_prefill.prefill.model.factory import build_model
from hicache_prefill.prefill.model.paged import PagedTransformer
from hicache_prefill.server_args import ServerArgs
from tests.support.harness import make_executor

# The CPU model: small enough for minutes on 2 cores. On CUDA the Llama-3-8B shape in bf16.
CPU_MODEL = dict(
    num_layers=4,
    num_attention_heads=8,
    head_num=4,
    head_dim=32,
    hidden_size=256,
    intermediate_size=768,
    vocab_size=1024,
    dtype="float32",
)
GPU_MODEL = dict(model_preset="llama3-8b-shape", dtype="bfloat16", vocab_size=32000)
CPU_MLA = dict(
    use_mla=True, kv_lora_rank=512, qk_rope_head_dim=64, qk_nope_head_dim=32, v_head_dim=32
)
GPU_MLA_MODEL = dict(
    model_preset="deepseek-v2-lite-shape", use_mla=True, dtype="bfloat16", vocab_size=32000
)


def on_cuda() -> bool:
    return torch.cuda.is_available()


def model_args(use_mla: bool = False) -> dict[str, Any]:
    """``ServerArgs`` fields of the benchmarks' model on this device."""
    if on_cuda():
        return dict(GPU_MLA_MODEL if use_mla else GPU_MODEL)
    return {**CPU_MODEL, **CPU_MLA} if use_mla else dict(CPU_MODEL)


def mode_label(profile: GpuProfile | None) -> tuple[str, str]:
    """(key, what the numbers are) of a run on ``profile`` (``None``: the wall clock)."""
    if profile is None:
        device = torch.cuda.get_device_name() if on_cuda() else "a CPU"
        return ("wall_gpu" if on_cuda() else "wall_cpu"), f"measured on {device} (wall clock)"
    return f"{profile.kind}_{profile.name}", f"{profile.kind} from GPU profile {profile.name}"


class ProfileTiming:
    """A ``GpuProfile`` as the executor's cost model and the controller's ``CopyTimer``.
    A forward that starts while a timed copy is still ahead is slowed by the profile's
    co-run slowdown."""

    def __init__(self, profile: GpuProfile, clock: VirtualClock, copy_path: str) -> None:
        self.profile = profile
        self.clock = clock
        self.copy_path = copy_path
        self.controller: HiCacheController | None = None  # set once the cache exists
        self.forward_s = 0.0  # charged so far

    def now(self) -> float:
        return self.clock.now()

    def wait_until(self, t: float) -> None:
        self.clock.wait_until(t)

    def copy_seconds(self, direction: str, tokens: int) -> float:
        return self.profile.copy_s(direction, tokens, self.copy_path)

    def forward(self, new: int, cached: int) -> float:
        cost = self.profile.forward_s(new, cached)
        if self.controller is not None and self.controller.next_ack_time() is not None:
            cost *= 1.0 + self.profile.corun_slowdown
        self.forward_s += cost
        return cost


class SharedHostPool:
    """One host pool for every cache of a benchmark (a pinned pool of the 8B shape is ~13 GB
    and registering it costs seconds): allocated by the first hierarchical cache, handed to
    each later one with a fresh allocator, destroyed by ``release``."""

    def __init__(self) -> None:
        self.pool: Any = None

    def build(self, args: ServerArgs, **kwargs: Any) -> KVCache:
        if not args.enable_hierarchical_cache:
            return build_kv_cache(args, **kwargs)
        if self.pool is not None:
            return build_kv_cache(args, host_pool=self.pool, **kwargs)
        cache = build_kv_cache(args, **kwargs)
        self.pool = cache.host_pool
        return cache

    def release(self) -> None:
        if self.pool is not None:
            self.pool.destroy()
            self.pool = None


def new_executor(
    args: ServerArgs,
    peer: PeerConfig,
    decode_tokens: int,
    model: PagedTransformer,
    profile: GpuProfile | None,
    host: SharedHostPool,
) -> tuple[OptimisticPrefillExecutor, ProfileTiming | None]:
    """An executor whose decode side keeps received KV (``decode_tokens`` of pool), on the wall
    clock (``profile`` None) or charged by ``profile`` (its ``ProfileTiming`` returned). On a
    profile the copies run inline (a copy is done when launched), so which acks are popped
    when depends on the modelled times only."""
    common = dict(keep_received=True, send_log_size=None, decode_pool_size=decode_tokens)
    if profile is None:
        ex = make_executor(
            args, model=model, peer_config=peer, clock=WallClock(), cache=host.build(args), **common
        )
        return ex, None
    clock = VirtualClock()
    timing = ProfileTiming(
        profile, clock, "kernel" if args.hicache_io_backend == "kernel" else "direct"
    )
    cache = host.build(args, streams="inline", copy_timer=timing)
    timing.controller = cache.controller
    per_token = cache.device_pool.get_size_per_token()  # this model's KV bytes per token
    transfer = profile.kv_transfer
    peer = dataclasses.replace(
        peer,
        transfer_latency_s=transfer.latency_s,
        transfer_bandwidth=transfer.gbps * 1e9 * per_token / profile.kv_bytes_per_token,
    )
    ex = make_executor(
        args,
        model=model,
        peer_config=peer,
        clock=clock,
        cache=cache,
        cost_model=timing.forward,
        **common,
    )
    return ex, timing


def release_executor(ex: OptimisticPrefillExecutor, host: SharedHostPool) -> None:
    """Finish the cache's copies; unregister its host pool unless it is ``host``'s."""
    ex.cache.close()
    pool = ex.cache.host_pool
    if pool is not None and pool is not host.pool:
        pool.destroy()
    gc.collect()
    if on_cuda():
        torch.cuda.empty_cache()


def shared_model(args: ServerArgs) -> PagedTransformer:
    """The model every configuration of a benchmark runs (same geometry, dtype and seed)."""
    return build_model(args)
