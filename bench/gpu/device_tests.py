"""Kernel and controller tests on the device (``python -m bench.gpu.device_tests --out DIR
[--dry-run]``): ``bench.gpu.plan``'s test files (xdist-sharded where installed) beside
``--variants``, which compiles every Triton variant later steps launch into ``TRITON_CACHE_DIR``;
each job's rc and summary go to ``DIR/device_tests.json``. ``--dry-run``: ``-m gpu`` only."""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import subprocess
import sys
import time
from pathlib import Path

from bench.gpu.plan import GPU_TESTS, KERNEL_TESTS


def pytest_cmd(files: tuple[str, ...], marker: str | None, workers: int) -> list[str]:
    """pytest on ``files`` (``-m marker`` if given), ``workers`` xdist workers if installed."""
    cmd = [sys.executable, "-m", "pytest", "-v", "-rfE", "-p", "no:cacheprovider", *files]
    cmd += ["--durations=10"] + (["-m", marker] if marker else [])
    return cmd + (["-n", str(workers)] if importlib.util.find_spec("xdist") else [])


def variants() -> list[str]:
    """Launch every kernel variant of the end-to-end pools and the transfer benchmark once."""
    import torch

    from bench.transfer.bench import GPU_QUICK as SZ
    from bench.transfer.bench import Pools
    from hicache_prefill.hicache.memory.device_pool import MHATokenToKVPool, MLATokenToKVPool
    from hicache_prefill.hicache.memory.host_pool import make_host_pool
    from hicache_prefill.kernels.sglang.warm_up import warm_up
    from hicache_prefill.server_args import ServerArgs

    done = []
    for preset, mla in (("llama3-8b-shape", False), ("deepseek-v2-lite-shape", True)):
        args = ServerArgs(model_preset=preset, use_mla=mla, dtype="bfloat16", max_total_tokens=256)
        dev = (MLATokenToKVPool if mla else MHATokenToKVPool).from_server_args(args)
        host = make_host_pool(dev, 2.0, 0, "page_first")  # as the end-to-end benchmarks' pools
        done.append(f"{preset}: {len(warm_up(host, dev).calls)} warm-up calls")
        host.destroy()
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    pools = Pools(device, SZ.item, SZ.layers, 64, SZ.page)
    try:
        for path in ("kernel", "registered") if pools.registered else ("kernel",):
            for direction in ("h2d", "d2h"):
                for bq in SZ.block_quotas:
                    pools.copy(direction, path, 64, bq=bq)[0]()
    finally:
        pools.close()
    return [*done, f"transfer: item {SZ.item} B, block_quota {SZ.block_quotas}"]


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench.gpu.device_tests", description=__doc__)
    p.add_argument("--out", type=Path, default=Path("bench-out"))
    p.add_argument("--dry-run", action="store_true", help="On a CPU: only -m gpu (they skip).")
    p.add_argument("--variants", action="store_true", help="Only the precompile job.")
    args = p.parse_args(argv)
    if args.variants:
        print("\n".join(f"[precompile] {line}" for line in variants()), flush=True)
        return 0
    jobs = {  # 12 of the device machine's 16 cores
        "kernel_tests": pytest_cmd(KERNEL_TESTS, "gpu" if args.dry_run else None, 8),
        "gpu_tests": pytest_cmd(GPU_TESTS, "gpu", 4),
        "precompile": [sys.executable, "-m", "bench.gpu.device_tests", "--variants"],
    }
    args.out.mkdir(parents=True, exist_ok=True)
    env, t0, procs, report = dict(os.environ, HICACHE_TEST_PROGRESS="1"), time.monotonic(), {}, {}
    for name, cmd in jobs.items():
        with open(args.out / f"{name}.log", "w") as log:
            procs[name] = subprocess.Popen(cmd, env=env, stdout=log, stderr=subprocess.STDOUT)
    while len(report) < len(procs):  # the step's limit kills this process group, jobs included
        for name, proc in procs.items():
            if name not in report and proc.poll() is not None:
                lines = (args.out / f"{name}.log").read_text().strip().splitlines() or [""]
                rc, took, summary = proc.returncode, round(time.monotonic() - t0, 1), lines[-1]
                report[name] = dict(rc=rc, seconds=took, summary=summary.strip("= "))
                (args.out / "device_tests.json").write_text(json.dumps(report, indent=2))
                print(f"[device_tests] {name}: rc={rc} in {took} s: {summary.strip('= ')}")
        time.sleep(0.2)
    return int(any(r["rc"] != 0 for r in report.values()))


if __name__ == "__main__":
    sys.exit(main())
