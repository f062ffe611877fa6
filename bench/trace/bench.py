"""``python -m bench.trace``: a Mooncake-format trace through the project's tree and tiers.

Writes ``trace.json``, ``trace.md``, ``trace_hit_rate.png``: LRU hit rate against capacity vs the
paper; hit rates per tier and pages per write policy on a grid of capacities (on this CPU); TTFT
modelled from GPU profiles; the tree's cost beside SGLang's. Quick: the first ``QUICK_REQUESTS``.
"""

from __future__ import annotations

import argparse
import json
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np

from bench.common import positive
from bench.profile import GpuProfile, load_profile
from bench.trace.cost import tree_cost
from bench.trace.replay import BLOCK, UNBOUNDED, Tiers, load_trace, lru_hits, replay_tiers

DEFAULT_TRACE = Path(__file__).parents[1] / "data/mooncake_fast25/conversation_trace.jsonl"
QUICK_REQUESTS, Mi, UTIL = 2000, 2**20, 0.8
DEV = Mi  # about an H200's KV for the profiles' model: (141 - 16) GB at 128 KiB a token
CURVE = [int(float(c)) for c in "1e4 3e4 1e5 3e5 1e6 3e6 1e7 3e7 5e7 1e8 1e9".split()]
QUICK_CURVE = [10**5, 10**6, 3 * 10**6, 10**7, 10**9]
GRID = [Tiers(DEV // 4), Tiers(DEV), Tiers(4 * DEV), Tiers(DEV, 4 * Mi), Tiers(DEV, 16 * Mi)]
GRID += [Tiers(DEV, 4 * Mi, 32 * Mi), Tiers(DEV, 4 * Mi, UNBOUNDED), Tiers(DEV, 16 * Mi, UNBOUNDED)]
QUICK_GRID = [Tiers(DEV), Tiers(DEV, 4 * Mi), Tiers(DEV, 4 * Mi, UNBOUNDED)]
POLICY_TIERS = Tiers(DEV, 4 * Mi)
POLICIES = ("write_through", "write_through_selective", "write_back")
Arr = np.ndarray
PAPER = {"table2_cache_ratio": 0.40, "readme_block_lru_unbounded": 0.374}
PAPER["figure9"] = "LRU, capacity 1e4..1e9 tokens: 3M well under the maximum, about 50M reach it"


def ttft(at: Arr, n: Arr, hits: dict, prof: GpuProfile, l3_gbps: float, scale: float) -> dict:
    """Mean / P50 / P90 TTFT and mean prefill GPU time (s) of one FIFO prefill server: request
    ``i`` arrives at ``scale * at[i]``, starts when the server is free and its L3 pages are read at
    ``l3_gbps``, and holds the server for its load back (``copy_s("h2d")``) and forward."""
    free, per_token = 0.0, prof.kv_bytes_per_token / (l3_gbps * 1e9)
    out, gpu = np.empty(len(n)), np.empty(len(n))
    for i, length in enumerate(n):
        dev, host, l3 = (int(hits[k][i]) for k in ("device", "host", "l3"))
        cached, arrive = dev + host + l3, scale * float(at[i])
        load = prof.copy_s("h2d", host + l3) if host + l3 else 0.0
        gpu[i] = load + prof.forward_s(int(length) - cached, cached)
        free = max(free, arrive + l3 * per_token) + gpu[i]
        out[i] = free - arrive
    p50, p90 = (float(x) for x in np.percentile(out, [50, 90]))
    res = {"ttft_mean_s": float(out.mean()), "ttft_p50_s": p50, "ttft_p90_s": p90}
    return res | {"prefill_gpu_mean_s": float(gpu.mean())}


def run(
    quick: bool = True,
    out_dir: Path = Path("bench-out"),
    trace: Path | str = DEFAULT_TRACE,
    profiles: tuple[str, ...] = ("h200", "h100"),
    sglang_site: str | None = None,
    l3_gbps: float = 10.0,
    limit: int | None = None,
) -> dict[str, Any]:
    """Replay ``trace``, print the tables, write the files under ``out_dir``; the result dict."""
    t0 = time.perf_counter()
    limit = limit or (QUICK_REQUESTS if quick else None)
    reqs = load_trace(trace, limit)
    n, at = (np.array([getattr(r, f) for r in reqs]) for f in ("input_length", "arrival_s"))
    total, unbounded = int(n.sum()), lru_hits(reqs, None, BLOCK)
    res: dict[str, Any] = {"trace": str(trace), "requests": len(reqs), "prompt_tokens": total}
    res["subset"] = f"first {limit} requests" if limit else "whole trace"
    res.update(paper=PAPER, measured="hit rates, tree costs: on this CPU; TTFT: modelled")
    res["hit_rate_unbounded_capacity"] = float(unbounded.sum() / total)
    res["hit_rate_unbounded_capacity_request_mean"] = float(np.mean(unbounded / n))
    curve = QUICK_CURVE if quick else CURVE
    res["lru_curve"] = [
        {"capacity_tokens": c, "hit_rate": lru_hits(reqs, c, BLOCK).sum() / total} for c in curve
    ]
    dev, res["tiers"], res["ttft"] = [], [], {}  # dev: (label, policy, hits) at device DEV
    grid = [(t, "write_through") for t in (QUICK_GRID if quick else GRID)]
    for t, p in dict.fromkeys(grid + [(POLICY_TIERS, p) for p in POLICIES]):
        r = replay_tiers(reqs, t, p, BLOCK)
        print(f"[trace] {t.label()} {p}: {r['wall_s']:.1f} s", flush=True)
        rate = {k: float(v.sum() / total) for k, v in r["hits"].items()}
        row = {"tokens": vars(t), "label": t.label(), "policy": p if t.host else "-"}
        res["tiers"].append({**row, "hit_rate": rate, "pages": r["pages"], "wall_s": r["wall_s"]})
        if t.device == DEV:
            dev.append((row["label"], row["policy"], r["hits"]))
    span = float(at.max() - at.min())
    for prof in map(load_profile, profiles):  # arrivals scaled so no cache loads the GPU to UTIL
        s = sum(prof.forward_s(int(x), 0) for x in n) / (UTIL * span) if span > 0 else 1.0
        rows = [{"tiers": lb, "policy": p} | ttft(at, n, h, prof, l3_gbps, s) for lb, p, h in dev]
        src = f"modelled from profile {prof.name} ({prof.kind}: {prof.gpu}, {prof.model})"
        res["ttft"][prof.name] = {"source": src, "time_scale": s, "l3_gbps": l3_gbps, "rows": rows}
    res["tree_cost"] = tree_cost(trace, limit, DEV, BLOCK, sglang_site)
    res["integrity"] = {"leaked_slots": 0}  # every replay ended with check_integrity()
    res["wall_s"] = round(time.perf_counter() - t0, 1)
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    fmt = lambda x: (f"{x:.3f}" if abs(x) < 10 else f"{x:.1f}") if isinstance(x, float) else str(x)
    md = [f"# Trace replay: {res['subset']} of `{Path(trace).name}`"]
    for title, head, rows in _tables(res):
        cells = [head] + [[fmt(x) for x in r] for r in rows]
        widths = [max(map(len, col)) for col in zip(*cells, strict=True)]
        print(f"\n{title}\n" + "\n".join("  ".join(map(str.rjust, c, widths)) for c in cells))
        md += [f"\n{title}\n", "| " + " | ".join(head) + " |", "|---" * len(head) + "|"]
        md += ["| " + " | ".join(c) + " |" for c in cells[1:]]
    (out / "trace.md").write_text("\n".join(md) + "\n")
    res["plot"] = _plot(res, out / "trace_hit_rate.png")
    (out / "trace.json").write_text(json.dumps(res, indent=2))
    print(f"\n[trace] wrote {out / 'trace.json'} in {res['wall_s']} s; plot: {res['plot']}")
    return res


def _tables(res: dict[str, Any]) -> Iterator[tuple[str, list[str], list[list[Any]]]]:
    u, mean = res["hit_rate_unbounded_capacity"], res["hit_rate_unbounded_capacity_request_mean"]
    curve = [(f"{c['capacity_tokens']:.0e}", c["hit_rate"]) for c in res["lru_curve"]]
    t = "LRU prefix hit rate, measured on this CPU (paper: Table 2 cache ratio 40%; the mean of"
    rows = [[c, 100 * h, 100 * h / u] for c, h in curve + [("unbounded", u)]]
    head = ["capacity (tokens)", "hit rate %", "of unbounded %"]
    yield f"{t} per-request ratios here {100 * mean:.1f}%)", head, rows
    head = ["tiers", "policy", "device %", "host %", "L3 %", "total %", *res["tiers"][0]["pages"]]
    rows = []
    for r in res["tiers"]:
        rate = r["hit_rate"].values()
        cells = [*(100 * x for x in rate), 100 * sum(rate), *r["pages"].values(), r["wall_s"]]
        rows.append([r["label"], r["policy"], *cells])
    t = "hit rate per tier (% of prompt tokens) and pages (512 tokens) by write policy; capacities"
    yield f"{t} device/host/L3 in tokens; measured on this CPU", [*head, "wall s"], rows
    for m in res["ttft"].values():
        t = f"{m['source']}; arrivals x{m['time_scale']:.3f} (no-cache load {UTIL:.0%})"
        t = f"TTFT and prefill GPU time per request (s), {t}, L3 read {m['l3_gbps']} GB/s"
        yield t, list(m["rows"][0]), [list(r.values()) for r in m["rows"]]
    tc = res["tree_cost"]
    title = f"tree bookkeeping at {tc['capacity_tokens']} device tokens, measured {tc['measured']}"
    rows = [[k, *tc[k].values()] for k in ("project", "sglang_python", "sglang_rust") if k in tc]
    yield f"{title}; SGLang: {tc['sglang']}", ["tree", *tc["project"]], rows


def _plot(res: dict[str, Any], path: Path) -> str:
    try:
        import matplotlib.pyplot as plt
    except ImportError as exc:
        return f"skipped: matplotlib not importable ({exc})"
    plt.switch_backend("Agg")
    fig, (a, b) = plt.subplots(1, 2, figsize=(12, 4.5))
    curve = res["lru_curve"]
    a.semilogx([c["capacity_tokens"] for c in curve], [100 * c["hit_rate"] for c in curve], "o-")
    a.axhline(100 * res["hit_rate_unbounded_capacity"], ls=":", c="k", label="unbounded")
    a.axhline(40, ls="--", c="r", label="paper Table 2 (40%)")
    for x, txt in ((3e6, "Fig. 9: 3M well under max"), (5e7, "Fig. 9: ~50M reach max")):
        a.axvline(x, ls=":", c="grey")
        a.text(x, 2, txt, rotation=90, fontsize=7)
    a.set(xlabel="capacity (tokens)", ylabel="hit rate (% of prompt tokens)", title="LRU, CPU")
    rates = np.array([[100 * x for x in r["hit_rate"].values()] for r in res["tiers"]])
    for i, k in enumerate(res["tiers"][0]["hit_rate"]):  # device, host, l3 stacked
        b.bar(range(len(rates)), rates[:, i], bottom=rates[:, :i].sum(1), label=k)
    names = [f"{r['label']}\n{r['policy']}" for r in res["tiers"]]
    b.set_xticks(range(len(names)), names, fontsize=6, rotation=60)
    b.set(ylabel="hit rate (% of prompt tokens)", title="per tier (device/host/L3 tokens), CPU")
    for ax in (a, b):
        ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return str(path)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser("python -m bench.trace", description=__doc__.split("\n")[0])
    ap.add_argument("--quick", action="store_true", help=f"First {QUICK_REQUESTS} requests.")
    ap.add_argument("--out", type=Path, default=Path("bench-out/trace"), help="Output folder.")
    ap.add_argument("--trace", type=Path, default=DEFAULT_TRACE, help="Mooncake-format JSONL.")
    ap.add_argument(
        "--requests", type=positive(int), default=None, help="Only the first N requests."
    )
    ap.add_argument("--profile", action="append", help="GPU profile NAME|FILE (repeatable).")
    ap.add_argument(
        "--l3-gbps", type=positive(float), default=10.0, help="L3 read bandwidth (GB/s)."
    )
    ap.add_argument("--sglang-site", default=None, help="SGLang pin dir (bench.cache_ops).")
    a = ap.parse_args(argv)
    profiles = tuple(a.profile or ("h200", "h100"))
    run(a.quick, a.out, a.trace, profiles, a.sglang_site, a.l3_gbps, a.requests)
    return 0
