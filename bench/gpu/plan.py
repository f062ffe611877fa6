"""The plan of ``bench/gpu_check.sh`` and the headline of what it measured (stdlib only).
``python bench/gpu/plan.py [--dry-run] [--scale S] (--render | --steps | --headline DIR)``. A step
ends within ``limit + GRACE_S`` plus ``OVERHEAD_S`` of archiving, all under ``DEVICE_LIMIT_S``; its
benchmark's deadline is ``start + limit - margin``."""

from __future__ import annotations

import argparse
import json
import math
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

DEVICE_LIMIT_S, GRACE_S, OVERHEAD_S, DRY_SCALE = 600, 5, 2, 0.4
FILES_BACK = tuple("results.tar.gz status.txt headline.txt profile.json plan.txt".split())
KT = """kernels kernels_gpu kernels_oracle kernel_index_errors kernels_surface launch_plans
    sgl_kernel_kvcacheio_port"""
GT = """bench/test_cuda_paths_gpu hicache/memory/test_host_pool hicache/transfer/test_controller
    hicache/transfer/test_streams hicache/tree/test_hiradix_cache prefill/test_executor_mla"""
KERNEL_TESTS = tuple(f"tests/kernels/test_{n}.py" for n in KT.split())
GPU_TESTS = tuple(f"tests/{n}.py" for n in GT.split())
PY, E2E = '"$PY" -m', "--clock wall --seeds 0 --no-sweeps"
MT = f'{PY} bench.multiturn {E2E} --configs device_only write_through --out "$RES/mt"'
MT_GPU = "--num-clients 8 --num-rounds 3 --request-length 2048 --sub-question-input-length 256"
MT_DRY = "--num-clients 2 --num-rounds 2 --request-length 64"
OPT = f'{PY} bench.optimistic {E2E} --attempts 2 0 --out "$RES/opt"'
OPT_GPU = "--num-requests 16 --input-len 4096 --chunked-prefill-size 512"  # a 6.4 GB host pool
OPT_DRY = "--num-requests 6 --input-len 64 --chunked-prefill-size 32"
PROFILE = f'{PY} bench.gpu.measure_profile --results "$RES" --out "$RES/profile.json"'


@dataclass(frozen=True)
class Step:
    """A step: its command on the GPU and the arguments the dry run appends (later flags win)."""

    name: str
    limit_s: int
    margin_s: int  # the benchmark's deadline is this far before the limit
    cmd: str
    dry: str = ""

    def command(self, dry: bool) -> str:
        return f"{self.cmd} {self.dry}" if dry and self.dry else self.cmd


# Probe; kernel and controller tests beside the precompile; the transfer headline; the GEMM co-run
# and block_quota sweep; the end-to-end pairs (the second is the headline); a measured profile.
STEPS = (
    Step("probe", 60, 0, f'{PY} bench.gpu.probe --out "$RES/probe.json"', "--cpu"),
    Step("device_tests", 80, 5, f'{PY} bench.gpu.device_tests --out "$RES"', "--dry-run"),
    Step("transfer", 60, 4, f'{PY} bench.transfer --quick --part headline --out "$RES"'),
    Step("corun", 60, 4, f'{PY} bench.transfer --quick --part corun --out "$RES"'),
    Step("multiturn", 95, 6, f"{MT} {MT_GPU}", MT_DRY),
    Step("optimistic", 95, 6, f"{OPT} {OPT_GPU}", OPT_DRY),
    Step("profile", 40, 4, PROFILE, "--tiny"),
)


def steps(dry: bool = False, scale: float = DRY_SCALE) -> list[Step]:
    """The steps, with the dry run's limits and margins scaled by ``scale``."""
    c = lambda x: math.ceil(x * scale)
    return [replace(s, limit_s=c(s.limit_s), margin_s=c(s.margin_s)) if dry else s for s in STEPS]


def total_s(plan: list[Step]) -> int:
    """Seconds the check takes at most: every step at its limit, grace and archiving."""
    return sum(s.limit_s + GRACE_S + OVERHEAD_S for s in plan)


def render(plan: list[Step], dry: bool) -> str:
    lines = [
        f"gpu_check plan{' (dry run)' if dry else ''}: {len(plan)} steps, {total_s(plan)} s "
        f"at most (each + {GRACE_S} s kill grace + {OVERHEAD_S} s archiving) of the "
        f"{DEVICE_LIMIT_S} s a device command may run"
    ]
    for i, s in enumerate(plan, 1):
        t = total_s(plan[:i])
        lines.append(f"  {i}. {s.name:<13}{s.limit_s:4d} s (done by {t:3d} s)  {s.command(dry)}")
    return "\n".join([*lines, f"files back in OUT (at most 8): {', '.join(FILES_BACK)}"])


def _e2e(doc: Any) -> str:
    """``config TTFT ms (ratio)`` of every configuration summary found in an end-to-end JSON."""
    found: dict[str, str] = {}

    def walk(x: Any, key: str) -> None:
        if isinstance(x, dict):
            if "ttft_mean_s" in x and key not in found:
                ratios = [v for k, v in x.items() if k.startswith("ttft_mean_speedup_vs")]
                found[key] = f"{key} {x['ttft_mean_s'] * 1e3:.1f} ms"
                found[key] += "".join(f" (x{r:.3f})" for r in ratios if isinstance(r, float))
            for k, v in x.items():
                if "seed" not in k and "spread" not in k:
                    walk(v, k)

    walk(doc, "")
    return ", ".join(list(found.values())[:4]) or "no configuration finished"


def _transfer(doc: dict[str, Any]) -> str:
    label = "CPU" if doc["cpu_note"] else doc["device"]
    if doc["partial"]:
        return f"({label}, partial: {len(doc.get('rows', doc.get('corun', [])))} rows)"
    return f"({label}): " + ", ".join(f"{k}: {v}" for k, v in doc["headline"].items())


def _profile(p: dict[str, Any]) -> str:
    fw, h2d = p["forward"], p["h2d"]["kernel"]["gbps"]
    return (
        f"({p['gpu']}): forward {fw['per_token_s'] * 1e6:.2f} us/token + "
        f"{fw['base_s'] * 1e3:.2f} ms, h2d kernel {h2d:.1f} GB/s, co-run "
        f"+{p['corun_slowdown']:.1%}"
    )


LINES = {
    "probe.json": lambda p: (
        f"{p.get('torch', {}).get('device', 'no device')}; 4 GB register "
        f"{p.get('register_4gb_s', '-')} s; RAM {p.get('meminfo_gb', '-')}"
    ),
    "device_tests.json": lambda t: "; ".join(
        f"{k} rc {v['rc']}: {v['summary'][:60]}" for k, v in t.items()
    ),
    "bench_transfer.json": _transfer,
    "bench_transfer_corun.json": _transfer,
    "mt/multiturn.json": _e2e,
    "opt/optimistic.json": _e2e,
    "profile.json": _profile,
}


def headline(res: Path) -> list[str]:
    """A short line of the key numbers of each result file in the results folder ``res``."""
    out = []
    for name, line in LINES.items():
        try:
            out.append(f"{name}: {line(json.loads((res / name).read_text()))}")
        except (OSError, json.JSONDecodeError):  # not written (yet)
            pass
        except (KeyError, TypeError, ValueError, AttributeError) as exc:
            out.append(f"{name}: unreadable ({exc!r})")
    return out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench.gpu.plan", description=__doc__.split("\n")[0])
    p.add_argument("--dry-run", action="store_true", help="The dry run's commands and limits.")
    p.add_argument("--scale", type=float, default=DRY_SCALE, help="Dry run: limits x this.")
    what = p.add_mutually_exclusive_group(required=True)
    what.add_argument("--render", action="store_true", help="Print the plan.")
    what.add_argument("--steps", action="store_true", help="name, limit, margin, grace, command.")
    what.add_argument("--headline", type=Path, metavar="DIR", help="Key numbers in DIR.")
    args = p.parse_args(argv)
    plan = steps(args.dry_run, args.scale)
    if args.headline:
        print("\n".join(headline(args.headline)))
    elif args.steps:
        for s in plan:
            print(f"{s.name}\t{s.limit_s}\t{s.margin_s}\t{GRACE_S}\t{s.command(args.dry_run)}")
    else:
        print(render(plan, args.dry_run))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
