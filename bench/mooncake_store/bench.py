"""``python -m bench.mooncake_store [--quick] [--out DIR]``: the Mooncake Store as the L3 tier,
measured on this CPU over TCP loopback (wall clock): ``MooncakeStore`` put / get bandwidth at
pages of 1, 16 and 64 tokens against a memcpy of the same objects (``bandwidth``), with the
objects in the client's own segment (``local``: Mooncake copies within the process) or in another
process's (``remote``: the client mounts none, every byte crosses TCP).

Each client runs in a node process under the loopback shim, each master is started on loopback by
``hicache.storage.mooncake.master`` and stopped by its pid. Writes ``bench_mooncake_store.json``.
Without Mooncake: one line, and the benchmark reports itself skipped with the reason.
"""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import Any

from bench.common import write_json
from bench.mooncake_store import bandwidth
from hicache.mooncake.availability import skip_reason
from hicache.storage.mooncake.master import MooncakeMaster
from prefill.testing.node_process import StoreNode, stop_nodes

MEASURED_ON = "a CPU: Mooncake over TCP loopback, wall clock"
DESCRIPTION = "MooncakeStore put/get bandwidth against memcpy, measured on this CPU."
NODE = "bench.mooncake_store.bandwidth"


def missing() -> str | None:
    """Why the benchmark cannot run here (``mooncake.store`` or the loopback shim), or ``None``."""
    return skip_reason("store")


def measure(mib: int, repeats: int) -> list[dict[str, Any]]:
    """The ``local`` rows, then the ``remote`` ones (module docstring)."""
    a = StoreNode(1, module=NODE, name="A", connect=False)
    b = StoreNode(1, module=NODE, name="B", connect=False)
    seg = f"{2 * mib + 64}mb"  # one repeat's objects at a time
    job = dict(pages=list(bandwidth.PAGE_SIZES), total_bytes=mib << 20, repeats=repeats)
    rows: list[dict[str, Any]] = []
    try:
        a.connect()
        b.connect()
        with MooncakeMaster.start() as local, MooncakeMaster.start() as remote:
            base = {"protocol": "tcp", "local_hostname": "127.0.0.1"}
            extra = {**base, "master_server_address": local.address, "global_segment_size": seg}
            rows += [{"placement": "local", **r} for r in a.first("bandwidth", extra=extra, **job)]
            extra = {**base, "master_server_address": remote.address, "global_segment_size": seg}
            b.first("store_open", name="owner", extra=extra)
            extra = {**extra, "global_segment_size": 0}
            rows += [{"placement": "remote", **r} for r in a.first("bandwidth", extra=extra, **job)]
    finally:
        stop_nodes([a, b])
    return rows


def run(quick: bool = True, out_dir: Path = Path("results")) -> dict[str, Any]:
    """The table and ``bench_mooncake_store.json``; ``{"skipped": reason}`` without Mooncake."""
    reason = missing()
    if reason is not None:
        print(f"[mooncake_store] skipped: {reason}")
        return {"skipped": reason, "integrity": {}}
    mib, repeats = (64, 3) if quick else (256, 5)
    print(
        f"[mooncake_store] measured on {MEASURED_ON}: {mib} MiB per row, median of {repeats}",
        flush=True,
    )
    rows = measure(mib, repeats)
    bandwidth.print_table(rows)
    integrity = {"failed_pages": sum(r["failed_pages"] for r in rows)}
    summary = {"measured_on": MEASURED_ON, "bandwidth": rows, "integrity": integrity}
    path = write_json("bench_mooncake_store", {"quick": quick, **summary}, out_dir)
    print(f"[mooncake_store] integrity: {integrity}")
    print(f"[mooncake_store] wrote {path}")
    return summary


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.mooncake_store", description=DESCRIPTION)
    parser.add_argument("--quick", action="store_true", help="Smaller sizes (about a minute).")
    parser.add_argument("--out", type=Path, default=Path("results"), help="Output folder.")
    args = parser.parse_args(argv)
    return 1 if any(run(args.quick, args.out).get("integrity", {}).values()) else 0
