"""Compile every Triton variant the later steps of ``bench/gpu_check.sh`` launch, in parallel, into
Triton's cache (``TRITON_CACHE_DIR``, ``$OUT/triton_cache`` in the check), so no later step spends
its time limit compiling: ``python -m bench.gpu.precompile OUT_DIR``.

Two kinds of job run at once, each in its own process:

- the kernel tests (``bench.gpu.plan.KERNEL_TEST_FILES``) in ``--shards`` pytest shards
  (``HICACHE_TEST_SHARD=i/N``, ``tests/conftest.py``): their own launches are what compiles their
  variants, so the set is exact; each shard logs every test as it starts
  (``HICACHE_TEST_PROGRESS=1``) to ``precompile_tests_<i>.log``, so a shard cut short by the
  step's limit names its test;
- the benchmarks' variants (``--bench-only``, this module in another process): their pools'
  geometry (the end-to-end benchmarks' device and page_first host pools, MHA and MLA, through
  ``kernels.sglang.warm_up`` with index tensors of ``-1``: every launch compiles its variant and
  copies nothing; the decode side's table-to-table copies; ``bench.transfer``'s item sizes,
  layouts and warps per program).

Prints one line per finished job and the number of compiled kernels in the cache before and after;
exits non-zero when a test shard failed or a job did not finish. Needs CUDA.
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import time
from pathlib import Path

from bench.gpu.plan import KERNEL_TEST_FILES, PRECOMPILE_SHARDS


def cached_kernels(cache_dir: str | None = None) -> int:
    """Compiled kernels (``*.cubin``) in Triton's cache directory (0 when it does not exist)."""
    root = Path(cache_dir or os.environ.get("TRITON_CACHE_DIR")
                or Path.home() / ".triton" / "cache")  # fmt: skip
    return sum(1 for _ in root.rglob("*.cubin")) if root.exists() else 0


def bench_variants(device_name: str = "cuda") -> list[str]:
    """Launch every kernel variant the benchmarks use on ``device_name``, copying nothing (the
    transfer bench's methods copy 16 slots of zeros); returns what ran."""
    import torch

    import kernels
    from bench.e2e.setup import model_args
    from bench.transfer.bench import GPU_QUICK
    from bench.transfer.methods import Indices, Pools, d2h_methods, h2d_methods, pool_slots
    from hicache.memory.device_pool import MHATokenToKVPool, MLATokenToKVPool
    from hicache.memory.host_pool_factory import make_host_pool
    from kernels.sglang.warm_up import warm_up
    from server_args import ServerArgs

    done = []
    device = torch.device(device_name)
    for mla in (False, True):
        extra = dict(use_mla=True, kv_lora_rank=512, qk_rope_head_dim=64) if mla else {}
        args = ServerArgs(**model_args(), page_size=16, max_total_tokens=256,
                          enable_hierarchical_cache=True, hicache_mem_layout="page_first",
                          hicache_io_backend="kernel", **extra)  # fmt: skip
        cls = MLATokenToKVPool if mla else MHATokenToKVPool
        dev, decode = cls.from_server_args(args), cls.from_server_args(args)
        host = make_host_pool(dev, 2.0, 0, "page_first")
        report = warm_up(host, dev)
        none = torch.full((16,), -1, dtype=torch.int64, device=device)
        if mla:  # the simulated decode side's copy (prefill/disagg/sim_peer.py)
            kernels.transfer_kv_all_layer_mla(dev.kv_data_ptrs, decode.kv_data_ptrs, none, none,
                                              host.item_size, dev.layer_num)  # fmt: skip
        else:
            kernels.transfer_kv_all_layer(dev.k_data_ptrs, decode.k_data_ptrs, dev.v_data_ptrs,
                                          decode.v_data_ptrs, none, none, host.item_size,
                                          dev.layer_num)  # fmt: skip
        kind = "MLA" if mla else "MHA"
        done.append(f"e2e {kind}: {len(report.calls)} warm-up calls, the decode-side copy")
        host.destroy()
    cfg = GPU_QUICK
    for item in sorted({*cfg.items, *cfg.side_items}):
        pools = Pools.allocate(device, item, pool_slots(64))
        idx = Indices.make(pools, 16, 1, seed=0)
        for layout in ("layer_first", "page_first"):
            warps = cfg.warps if layout == "page_first" and item == 2048 else (32,)
            for w in warps:
                h2d_methods(pools, layout, idx, 1, 1, 2, None, w)["triton"]()
            d2h_methods(pools, layout, idx, 1, 2, None)["triton"]()
        done.append(f"bench.transfer item {item} B")
        del pools
    if device.type == "cuda":
        torch.cuda.synchronize()
    return done


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench.gpu.precompile", description=__doc__)
    p.add_argument("out", type=Path, nargs="?", default=Path("results"))
    p.add_argument("--shards", type=int, default=PRECOMPILE_SHARDS)
    p.add_argument("--bench-only", action="store_true", help="Only the benchmarks' variants.")
    args = p.parse_args(argv)
    if args.bench_only:
        for line in bench_variants():
            print(f"[precompile] {line}", flush=True)
        return 0
    args.out.mkdir(parents=True, exist_ok=True)
    before = cached_kernels()
    t0 = time.monotonic()
    env = dict(os.environ, HICACHE_TEST_PROGRESS="1")
    jobs: dict[str, subprocess.Popen] = {}
    logs = []
    bench_log = open(args.out / "precompile_bench.log", "w")  # noqa: SIM115 - closed below
    logs.append(bench_log)
    jobs["benchmarks"] = subprocess.Popen(
        [sys.executable, "-m", "bench.gpu.precompile", "--bench-only"], env=env,
        stdout=bench_log, stderr=subprocess.STDOUT,
    )  # fmt: skip
    for i in range(args.shards):
        log = open(args.out / f"precompile_tests_{i}.log", "w")  # noqa: SIM115 - closed below
        logs.append(log)
        cmd = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-rfE",
               *KERNEL_TEST_FILES]  # fmt: skip
        jobs[f"tests {i}/{args.shards}"] = subprocess.Popen(
            cmd, env=dict(env, HICACHE_TEST_SHARD=f"{i}/{args.shards}"), stdout=log,
            stderr=subprocess.STDOUT,
        )  # fmt: skip
    status = 0
    try:
        pending = dict(jobs)
        while pending:
            for name, proc in list(pending.items()):
                rc = proc.poll()
                if rc is None:
                    continue
                del pending[name]
                print(f"[precompile] {name}: rc={rc} after {time.monotonic() - t0:.1f} s",
                      flush=True)  # fmt: skip
                status = status or (rc != 0)
            time.sleep(0.2)
    finally:  # the step's limit ends this process: its jobs go with it
        for proc in jobs.values():
            if proc.poll() is None:
                proc.kill()
                status = 1
        for log in logs:
            log.close()
    print(f"[precompile] compiled kernels in the cache: {before} -> {cached_kernels()} "
          f"in {time.monotonic() - t0:.1f} s", flush=True)  # fmt: skip
    return int(status)


if __name__ == "__main__":
    sys.exit(main())
