"""The Mooncake Store as the L3 tier: put/get bandwidth against a same-run memcpy, and two prefill
instances sharing one store (instance B serves conversations instance A started) against L2
only and against the file backend.

1. **Bandwidth** (``bandwidth``): ``MooncakeStore``'s ``batch_set_v1`` / ``batch_get_v1`` at
   pages of 1, 16 and 64 tokens of the Llama-3-8B KV shape, with the objects in the client's own
   segment (``local``) or in another process's (``remote``, the client mounting none), against
   a memcpy of the same objects in the same run.
2. **Cross-instance multi-turn** (``cross``): rows ``L2 only``, ``L2+L3 file``,
   ``L2+L3 mooncake``; B's TTFT and hit tokens per tier.

Every Mooncake client runs in a node process under the loopback shim; every master is started
on loopback by ``hicache.storage.mooncake.master`` and stopped by its pid. Without Mooncake the
benchmark reports itself skipped, with the reason.

    python -m bench.mooncake_store [--quick] [--out results]
"""

from __future__ import annotations

import argparse
import sys
import tempfile
from pathlib import Path
from typing import Any

from bench.e2e.report import print_config_table, write_result
from bench.e2e.setup import cpu_note
from bench.mooncake_store import bandwidth, cross
from bench.multiturn.trace import longest_prompt
from hicache.memory.allocator import page_ceil
from hicache.mooncake.availability import skip_reason
from hicache.storage.mooncake.master import MooncakeMaster
from prefill.testing.node_process import StoreNode, stop_nodes

NODE = "bench.mooncake_store.node"
SIZES = {  # (quick, full)
    "num_clients": (8, 24), "num_rounds": (4, 5), "request_length": (256, 512),
    "sub_question_input_length": (32, 64), "bandwidth_mib": (64, 256),
}  # fmt: skip
DEVICE_PROMPTS = 3
"""The default device pool holds this many of the longest prompts (with 1.3 of them, 1024
tokens at the full sizes, B found no hit in any tier: measured, see the README)."""


def parse_args(argv: list[str], quick: bool) -> argparse.Namespace:
    q = 0 if quick else 1
    p = argparse.ArgumentParser(prog="python -m bench.mooncake_store", description=__doc__)
    for name, sizes in SIZES.items():
        p.add_argument(f"--{name.replace('_', '-')}", type=int, default=sizes[q])
    p.add_argument("--page-size", type=int, default=16)
    p.add_argument("--chunked-prefill-size", type=int, default=256)
    p.add_argument("--device-tokens", type=int, default=None,
                   help="Each instance's device pool (tokens; default: three of the longest "
                   "prompts, in whole pages).")
    p.add_argument("--hicache-ratio", type=float, default=2.0)
    p.add_argument("--max-parallel", type=int, default=4)
    p.add_argument("--kv-sample-every", type=int, default=4)
    p.add_argument("--segment", default="256mb", help="Each instance's Mooncake segment.")
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--seed", type=int, default=0)
    opts = p.parse_args(argv)
    if opts.device_tokens is None:  # room for the prefix loads of several requests in flight
        opts.device_tokens = page_ceil(DEVICE_PROMPTS * longest_prompt(opts), opts.page_size)
    return opts


def missing() -> str | None:
    """Why the benchmark cannot run here (``mooncake.store`` or the loopback shim), or ``None``."""
    return skip_reason("store")


def _bandwidth(a: StoreNode, b: StoreNode, opts: argparse.Namespace) -> list[dict[str, Any]]:
    total = opts.bandwidth_mib << 20
    seg = f"{2 * opts.bandwidth_mib + 64}mb"  # one repeat's objects at a time
    rows: list[dict[str, Any]] = []
    with MooncakeMaster.start() as local, MooncakeMaster.start() as remote:
        base = {"protocol": "tcp", "local_hostname": "127.0.0.1"}
        for r in a.first("bandwidth", extra={**base, "master_server_address": local.address,
                                             "global_segment_size": seg},
                         pages=list(bandwidth.PAGE_SIZES), total_bytes=total,
                         repeats=opts.repeats):  # fmt: skip
            rows.append({"placement": "local", **r})
        b.first("store_open", name="owner", extra={**base, "global_segment_size": seg,
                                                   "master_server_address": remote.address})
        try:
            for r in a.first("bandwidth", extra={**base, "master_server_address": remote.address,
                                                 "global_segment_size": 0},
                             pages=list(bandwidth.PAGE_SIZES), total_bytes=total,
                             repeats=opts.repeats):  # fmt: skip
                rows.append({"placement": "remote", **r})
        finally:
            b.command("store_close", name="owner")
    return rows


def run(quick: bool = True, out_dir: Path = Path("results"), argv: list[str] | None = None) -> dict:
    reason = missing()
    if reason is not None:
        print(f"[mooncake_store] skipped: {reason}")
        return {"skipped": reason, "integrity": {}}
    opts = parse_args(argv or [], quick)
    a = StoreNode(1, module=NODE, name="A", connect=False)
    b = StoreNode(1, module=NODE, name="B", connect=False)
    rows: dict[str, Any] = {}
    try:
        a.connect()
        b.connect()
        print("[mooncake_store] bandwidth: MooncakeStore put/get vs memcpy of the same objects "
              f"({opts.bandwidth_mib} MiB per row, median of {opts.repeats})", flush=True)
        bw = _bandwidth(a, b, opts)
        bandwidth.print_table(bw)
        print(f"[mooncake_store] cross-instance multi-turn: A serves the first round of "
              f"{opts.num_clients} conversations, B the next {opts.num_rounds - 1} "
              f"(closed loop, {opts.max_parallel} in flight, wall clock; device pool "
              f"{opts.device_tokens} tokens, host pool {opts.hicache_ratio:g}x)", flush=True)
        with MooncakeMaster.start() as master, tempfile.TemporaryDirectory() as root:
            for row in cross.ROWS:
                rows[row] = cross.run_row(row, a, b, opts, master, root)
                print(f"    {row}: done", flush=True)
    finally:
        stop_nodes([a, b])
    print()
    print_config_table(rows, cross.TABLE)
    integrity: dict[str, int] = {}
    for r in rows.values():
        for k, v in r["integrity"].items():
            if k != "kv_checked_requests":  # a count, not a violation
                integrity[k] = integrity.get(k, 0) + int(v)
    for r in bw:
        integrity["failed_pages"] = integrity.get("failed_pages", 0) + r["failed_pages"]
    summary = {"bandwidth": bw, "cross": rows, "integrity": integrity, "note": cpu_note()}
    path = write_result(out_dir, "mooncake_store", {"workload": vars(opts), "summary": summary})
    print(f"[mooncake_store] integrity: {integrity}")
    print(f"[mooncake_store] wrote {path}")
    return summary


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    p = argparse.ArgumentParser(add_help=False)
    p.add_argument("--quick", action="store_true")
    p.add_argument("--out", type=Path, default=Path("results"))
    known, rest = p.parse_known_args(argv)
    summary = run(known.quick, known.out, rest)
    bad = {k: v for k, v in summary.get("integrity", {}).items() if v}
    if bad:
        print(f"[mooncake_store] INTEGRITY VIOLATIONS: {bad}", file=sys.stderr)
        return 1
    return 0
