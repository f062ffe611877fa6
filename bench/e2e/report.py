"""The end-to-end benchmarks' grid and report: every configuration under every clock mode
(wall, or a GPU profile) and seed, the ratio of each to its baseline per seed, means and spread
over seeds, one table per mode, and the result file rewritten after every run (a run cut short
keeps what it measured)."""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from bench.common import time_left
from bench.e2e.setup import mode_label, on_cuda
from bench.profile import GpuProfile, load_profile
from bench.summary import INTEGRITY_KEYS, machine_info, run_info

Column = tuple[str, str, float, str]  # header, key, scale, format
TTFT_COLUMNS: list[Column] = [
    ("TTFT mean ms", "ttft_mean_s", 1e3, ".2f"),
    ("p50 ms", "ttft_p50_s", 1e3, ".2f"),
    ("p90 ms", "ttft_p90_s", 1e3, ".2f"),
]


def new_parser(prog: str, doc: str | None) -> argparse.ArgumentParser:
    """A benchmark's parser with the flags every end-to-end benchmark shares (below)."""
    p = argparse.ArgumentParser(
        prog=prog, description=doc, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    add_common_args(p)
    return p


def add_common_args(p: argparse.ArgumentParser) -> None:
    """The clock flags, ``--seeds``, ``--kv-sample-every``, ``--use-mla``, ``--sweeps`` (the
    sizes' defaults apply to flags left ``None``)."""
    p.add_argument("--quick", action="store_true", help="Quick sizes (the suite's default).")
    p.add_argument(
        "--out",
        type=Path,
        default=None,
        help="Output folder (default bench-out; make bench writes results/).",
    )
    p.add_argument(
        "--clock",
        choices=("wall", "profile", "both"),
        default=None,
        help="wall: this machine's time; profile: a virtual clock charged by each "
        "--profile; both (default on a CPU; wall only on CUDA unless --profile).",
    )
    p.add_argument(
        "--profile",
        nargs="*",
        default=None,
        metavar="NAME|FILE",
        help="GPU profiles of the modelled runs (default h100 h200 on a CPU; none "
        "on CUDA, where the GPU check passes its measured one).",
    )
    p.add_argument("--seeds", type=int, nargs="+")
    p.add_argument(
        "--kv-sample-every",
        type=int,
        help="Every N-th success is checked against a full recompute.",
    )
    p.add_argument("--use-mla", action="store_true", help="MLA pools (DeepSeek's latent KV).")
    p.add_argument(
        "--sweeps",
        action=argparse.BooleanOptionalAction,
        default=False,
        help="Also sweep the load (multiturn) or the bootstrap delay (optimistic) on each "
        "modelled profile, one seed.",
    )


def modes(opts: argparse.Namespace) -> list[GpuProfile | None]:
    """The clock modes to run: ``None`` (wall) first, then each profile."""
    names = opts.profile if opts.profile is not None else ([] if on_cuda() else ["h100", "h200"])
    clock = opts.clock or ("both" if names else "wall")
    out: list[GpuProfile | None] = [] if clock == "profile" else [None]
    if clock != "wall":
        if not names:
            raise ValueError("--clock profile needs at least one --profile")
        out += [load_profile(n) for n in names]
    return out


def sized(
    opts: argparse.Namespace, fields: list[str], sizes: dict, quick: bool, modelled: bool
) -> argparse.Namespace:
    """``opts`` with each workload flag in ``fields`` that was not given filled from the size of
    this run: ``sizes[quick|full]`` holds one row for a CPU's wall clock, one for a CPU run on a
    GPU profile (the GPU workload cut to seconds of CPU model work) and one for CUDA."""
    row = sizes["quick" if quick else "full"][2 if on_cuda() else int(modelled)]
    missing = {k: v for k, v in zip(fields, row, strict=True) if getattr(opts, k) is None}
    return argparse.Namespace(**{**vars(opts), **missing})


def spread(values: list[float | None]) -> dict[str, Any] | None:
    """Mean, min, max, stdev (0 for one value) and the values; None if any is missing."""
    if not values or any(v is None for v in values):
        return None
    vals = [float(v) for v in values if v is not None]
    sd = statistics.stdev(vals) if len(vals) > 1 else 0.0
    return {
        "mean": statistics.fmean(vals),
        "min": min(vals),
        "max": max(vals),
        "stdev": sd,
        "per_seed": vals,
    }


class Grid:
    """Runs ``run_one(profile, seed, config) -> dict`` over modes x seeds x configs in that
    order (every mode's headline first when ``configs`` lists it first), skipping what the
    deadline (``HICACHE_BENCH_DEADLINE``) no longer allows, and keeps ``per_seed`` results.
    ``baseline(config)`` names the configuration a ratio divides by."""

    def __init__(
        self,
        name: str,
        out_dir: Path,
        ratio: str,
        baseline: Callable[[str], str],
        doc: dict[str, Any],
    ) -> None:
        self.name, self.out_dir, self.ratio, self.baseline = name, out_dir, ratio, baseline
        self.doc = doc
        self.per_seed: dict[str, dict[int, dict[str, dict[str, Any]]]] = {}
        self.labels: dict[str, str] = {}
        self.skipped: list[str] = []
        self._slowest = 0.0

    def run(
        self,
        profiles: list[GpuProfile | None],
        seeds: list[int],
        configs: list[str],
        run_one: Callable[[GpuProfile | None, int, str], dict[str, Any]],
        suffix: str = "",
    ) -> None:
        """``suffix``: appended to the mode's key (a sweep's point)."""
        for profile in profiles:
            key, label = mode_label(profile)
            key += suffix
            self.labels[key] = label + suffix.replace("_", " ")
            for seed in seeds:
                for config in configs:
                    tag = f"{key}/{config}/seed{seed}"
                    if time_left() < 1.5 * self._slowest + 5:
                        print(f"    {tag}: skipped, {time_left():.0f} s left", flush=True)
                        self.skipped.append(tag)
                        continue
                    t0 = time.perf_counter()
                    res = run_one(profile, seed, config)
                    self._slowest = max(self._slowest, time.perf_counter() - t0)
                    results = self.per_seed.setdefault(key, {}).setdefault(seed, {})
                    results[config] = res
                    self._ratios(results)
                    print(
                        f"    {tag}: {res['successes']} ok, TTFT mean "
                        f"{res['ttft_mean_s'] * 1e3:.2f} ms "
                        f"({time.perf_counter() - t0:.1f} s)",
                        flush=True,
                    )
                    self.write(partial=True)

    def _ratios(self, results: dict[str, dict[str, Any]]) -> None:
        for config, res in results.items():
            base = results.get(self.baseline(config), {}).get("ttft_mean_s")
            res[self.ratio] = base / res["ttft_mean_s"] if base and res["ttft_mean_s"] else None

    def summary(self, keys: Sequence[str]) -> dict[str, Any]:
        """Per mode and configuration: ``keys`` averaged over seeds, the ratio's spread."""
        out: dict[str, Any] = {}
        for mode, by_seed in self.per_seed.items():
            configs: dict[str, Any] = {}
            for config in dict.fromkeys(c for r in by_seed.values() for c in r):
                rows = [r[config] for r in by_seed.values() if config in r]
                entry = {k: _mean([r.get(k) for r in rows]) for k in keys}
                entry[self.ratio + "_spread"] = spread([r.get(self.ratio) for r in rows])
                entry["seeds"] = [s for s, r in by_seed.items() if config in r]
                configs[config] = entry
            out[mode] = {"what": self.labels[mode], "configs": configs}
        return out

    def result(self, summary: dict[str, Any], ratio: str, **extra: Any) -> dict[str, Any]:
        """The suite's section: the headline ratios per mode, their labels, the integrity."""
        return {
            "headline": headline(summary, ratio),
            "modes": self.labels,
            **extra,
            "integrity": self.integrity(),
        }

    def integrity(self) -> dict[str, int]:
        total = dict.fromkeys(INTEGRITY_KEYS, 0)
        for by_seed in self.per_seed.values():
            for results in by_seed.values():
                for res in results.values():
                    for k, v in res.get("integrity", {}).items():
                        if k in total:
                            total[k] += int(v)
        return total

    def write(self, partial: bool = False, **extra: Any) -> Path:
        self.out_dir.mkdir(parents=True, exist_ok=True)
        path = self.out_dir / f"{self.name}.json"
        body = {
            "benchmark": self.name,
            "machine": machine_info(),
            "run": run_info(),
            **self.doc,
            "partial": partial,
            "modes": self.labels,
            "skipped_for_time": self.skipped,
            "per_seed": self.per_seed,
            **extra,
        }
        path.write_text(json.dumps(body, indent=2, default=str))
        return path


def _mean(vals: list[Any]) -> float | None:
    return None if not vals or any(v is None for v in vals) else statistics.fmean(vals)


def print_tables(summary: dict[str, Any], cols: list[Column], ratio: str, label: str) -> None:
    """One table per mode, then each configuration's ratio and its spread over seeds."""
    for mode, body in summary.items():
        print(f"\n  {mode}: {body['what']}")
        configs = body["configs"]
        w = max(26, max(len(n) for n in configs) + 2)
        print(f"  {'config':<{w}}" + "".join(f"{c[0]:>14}" for c in cols))
        for name, res in configs.items():
            cells = [
                f"{'-':>14}" if res.get(k) is None else f"{res[k] * s:>14{f}}"
                for _, k, s, f in cols
            ]
            print(f"  {name:<{w}}" + "".join(cells))
        for name, res in configs.items():
            s = res.get(ratio + "_spread")
            if s is not None:
                vals = ", ".join(f"{v:.3f}" for v in s["per_seed"])
                print(
                    f"    {name:<{w}} {label} {s['mean']:.3f} (min {s['min']:.3f}, "
                    f"max {s['max']:.3f}; seeds: {vals})"
                )


def headline(summary: dict[str, Any], ratio: str) -> dict[str, dict[str, list[float] | None]]:
    """``{mode: {config: [mean, min, max] of the ratio over seeds}}`` for the suite's summary."""
    out: dict[str, dict[str, list[float] | None]] = {}
    for mode, body in summary.items():
        spreads = {c: r.get(ratio + "_spread") for c, r in body["configs"].items()}
        out[mode] = {c: s and [s["mean"], s["min"], s["max"]] for c, s in spreads.items()}
    return out


def main(name: str, run: Callable[..., dict[str, Any]]) -> int:
    """``python -m bench.NAME``: the benchmark's own flags; non-zero on an integrity violation."""
    argv = sys.argv[1:]
    summary = run(quick="--quick" in argv, argv=[a for a in argv if a != "--quick"])
    bad = {k: v for k, v in summary["integrity"].items() if v}
    if bad:
        print(f"[{name}] INTEGRITY VIOLATIONS: {bad}", file=sys.stderr)
        return 1
    return 0
