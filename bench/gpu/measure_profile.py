"""A measured ``bench.profile.GpuProfile`` (``python -m bench.gpu.measure_profile --out FILE
[--results DIR] [--tiny]``): the forward fitted on the Llama-3-8B-shaped model; copy costs and the
co-run slowdown from ``bench.transfer``'s JSON in DIR; what that lacks and ``kv_transfer`` (one GPU
has no NIC) from the modelled h200 profile, ``sources`` says which. ``--tiny``: tiny sizes."""

from __future__ import annotations

import argparse
import json
import platform
from pathlib import Path
from typing import Any

import torch

from bench.common import time_ms
from bench.profile import CopyPath, ForwardCost, GpuProfile, load_profile
from hicache_prefill.hicache.memory.device_pool import MHATokenToKVPool
from hicache_prefill.kernels.ops.kernel_backend import DEFAULT_BLOCK_QUOTA
from hicache_prefill.prefill.model.factory import build_model
from hicache_prefill.prefill.model.paged import ExtendInput
from hicache_prefill.server_args import ServerArgs

SHAPES = {
    False: ((16, 0), (1024, 0), (4096, 0), (8192, 0), (2048, 6144), (1024, 15360)),
    True: ((4, 0), (32, 0), (64, 0), (128, 0), (32, 96), (16, 240)),
}
SOURCES = {"kernel": "gbps", "direct": "gbps", "copy_engine": "ceiling_gbps"}  # the rows' rate


def _load(path: Path) -> dict[str, Any]:
    return json.loads(path.read_text()) if path.exists() else {}


def forward_cost(args: ServerArgs, tiny: bool) -> tuple[ForwardCost, str]:
    """The fitted forward and its points (``new/cached: seconds``, median of three)."""
    model, page, shapes = build_model(args), 16, SHAPES[tiny]
    size = max(n + c for n, c in shapes) + page
    geometry = (args.torch_dtype(), args.head_num, args.head_dim, args.num_layers, model.device)
    pool = MHATokenToKVPool(size, page, *geometry)
    gen, pts = torch.Generator().manual_seed(0), []
    for new, cached in shapes:
        ids = torch.randint(0, args.vocab_size, (new,), generator=gen)
        batch = [ExtendInput(ids, torch.arange(page, page + cached + new), cached)]
        run = lambda b=batch: model.forward_extend(pool, b)
        pts.append((new, cached, time_ms(run, model.device, 0, 0).median / 1e3))
    rows = [[1.0, n, n * c + n * (n + 1) / 2] for n, c, _ in pts[1:]]
    a, y = torch.tensor(rows, dtype=torch.float64), torch.tensor([t for *_, t in pts[1:]])
    base, per_token, per_pair = torch.linalg.lstsq(a, y.double()).solution.clamp(min=0).tolist()
    points = "; ".join(f"{n}/{c}: {t:.6f}" for n, c, t in pts)
    return ForwardCost(base, per_token, per_pair, max(0.0, pts[0][2] - base)), points


def copy_paths(transfer: Path, layers: int, modelled: GpuProfile) -> tuple[dict, dict, str]:
    """``(h2d, d2h, source)``: a ``CopyPath`` per path fitted on the smallest and largest size of
    ``transfer``'s rows, the modelled one where they lack two sizes."""
    rows = _load(transfer).get("rows", [])
    kernel = "registered" if any(r["path"] == "registered" for r in rows) else "kernel"
    out, fitted = {"h2d": dict(modelled.h2d), "d2h": dict(modelled.d2h)}, []
    for (direction, paths), (name, rate) in ((d, s) for d in out.items() for s in SOURCES.items()):
        path = {"kernel": kernel, "copy_engine": "kernel"}.get(name, name)
        sel = [r for r in rows if r["direction"] == direction and r["path"] == path]
        if len({r["tokens"] for r in sel}) < 2:
            continue
        (b1, t1), (b2, t2) = ((r["bytes"], r["bytes"] / r[rate] / 1e9) for r in (sel[0], sel[-1]))
        gbps = (b2 - b1) / (t2 - t1) / 1e9 if t2 > t1 else b2 / t2 / 1e9
        lat = max(0.0, t1 - b1 / (gbps * 1e9))  # a load: a call per layer, a backup: one
        paths[name] = CopyPath(lat * (layers if direction == "h2d" else 1), gbps)
        fitted.append(f"{direction} {name}")
    how = f"kernel on {kernel} host memory, copy_engine the contiguous copy"
    return out["h2d"], out["d2h"], f"{transfer} ({how}): {fitted}; the rest modelled h200's"


def measure(tiny: bool, results: Path) -> GpuProfile:
    preset = "tiny" if tiny else "llama3-8b-shape"
    args = ServerArgs(model_preset=preset, dtype="float32" if tiny else "bfloat16")
    item = args.head_num * args.head_dim * torch.empty(0, dtype=args.torch_dtype()).element_size()
    modelled, layers = load_profile("h200"), args.num_layers
    forward, fw_points = forward_cost(args, tiny)
    transfer, corun = (results / f"bench_transfer{s}.json" for s in ("", "_corun"))
    h2d, d2h, copies = copy_paths(transfer, layers, modelled)
    slowdown, co_src = modelled.corun_slowdown, "the modelled h200 profile's (no co-run JSON)"
    for r in _load(corun).get("corun", []):
        if r["path"] == "kernel" and r["block_quota"] == DEFAULT_BLOCK_QUOTA:
            slowdown = max(0.0, r["slowdown"] - 1)
            co_src = f"{corun}: GEMM beside the kernel copy, block_quota {DEFAULT_BLOCK_QUOTA}"
    src = {
        "forward": f"prefill.model.factory.build_model, least squares; new/cached: s {fw_points}",
        "copies": copies,
        "corun_slowdown": co_src,
        "kv_transfer": "copied from the modelled h200 profile: a single GPU has no NIC",
    }
    cpu = f"CPU {platform.processor() or platform.machine()}"
    gpu, m = torch.cuda.get_device_name() if torch.cuda.is_available() else cpu, "measured"
    kv, model, kvt = 2 * item * layers, f"{preset} {args.dtype}", modelled.kv_transfer
    return GpuProfile(m, m, gpu, model, layers, kv, forward, h2d, d2h, kvt, slowdown, src)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench.gpu.measure_profile", description=__doc__)
    p.add_argument("--out", type=Path, default=Path("bench-out/profile.json"))
    p.add_argument(
        "--results", type=Path, default=Path("bench-out"), help="bench.transfer's --out."
    )
    p.add_argument("--tiny", action="store_true", help="Tiny sizes (a dry run on a CPU).")
    args = p.parse_args(argv)
    prof = measure(args.tiny, args.results)
    fw = prof.forward
    args.out.parent.mkdir(parents=True, exist_ok=True)
    prof.save(args.out)
    print(
        f"[profile] {prof.gpu}, {prof.model}: forward {fw.base_s * 1e3:.3f} ms + "
        f"{fw.per_token_s * 1e6:.3f} us/token + {fw.per_pair_s * 1e9:.4f} ns/pair (floor "
        f"{fw.floor_s * 1e3:.3f} ms); co-run +{prof.corun_slowdown:.1%}"
    )
    for direction, paths in (("h2d", prof.h2d), ("d2h", prof.d2h)):
        costs = (f"{k} {c.latency_s * 1e6:.1f} us + {c.gbps:.2f} GB/s" for k, c in paths.items())
        print(f"[profile] {direction}: {'; '.join(costs)}")
    print(f"[profile] wrote {args.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
