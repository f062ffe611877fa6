"""Cross-instance multi-turn: instance B serves the later rounds of conversations whose first
round instance A served, each instance its own node process with its own device and host pools.

A serves every conversation's first prompt (all submitted at once) and drains its backups; then
B drives the remaining rounds, each conversation's next round sent when its previous one is
back, at most ``max_parallel`` in flight (closed loop: ``bench.multiturn.trace.drive_trace`` at
an unbounded arrival rate), on wall time. Rows, by what A and B share:

- ``L2 only``: nothing (each has its own device and host cache, no L3): B recomputes every
  conversation's first prompt at its first round;
- ``L2+L3 file``: one ``HiCacheFile`` directory (both processes on this machine);
- ``L2+L3 mooncake``: one Mooncake master (each instance's client mounts a segment).

Per row, B's TTFT (mean, p50, p90, from send to the transfer's ``Success``) and its hit tokens
per tier: device, L2 (host hits not fetched from storage), L3 (fetched from storage), computed;
and why prefetched pages went unused: ``L3 unused`` (fetched into the host pool and inserted,
not loaded at the request's admission: evicted from the host while it waited, no device room,
or on the device by then) and ``no room`` (host hits of any origin recomputed because their
load back found no device room).
"""

from __future__ import annotations

import json
import os
from typing import Any

from bench.e2e.setup import model_args, on_cuda
from bench.e2e.workload import make_conversations
from hicache.storage.mooncake.master import MooncakeMaster
from prefill.testing.node_process import StoreNode

ROWS = ("L2 only", "L2+L3 file", "L2+L3 mooncake")
TABLE = [
    ("TTFT mean ms", "ttft_mean_s", 1e3, ".1f"),
    ("p50 ms", "ttft_p50_s", 1e3, ".1f"),
    ("p90 ms", "ttft_p90_s", 1e3, ".1f"),
    ("dev hit tok", "device_hit_tokens", 1, ".0f"),
    ("L2 hit tok", "l2_hit_tokens", 1, ".0f"),
    ("L3 hit tok", "storage_hit_tokens", 1, ".0f"),
    ("L3 unused tok", "prefetch_unused_tokens", 1, ".0f"),
    ("no room tok", "load_back_no_room_tokens", 1, ".0f"),
    ("computed tok", "prefill_tokens_computed", 1, ".0f"),
]
UNBOUNDED_RATE = 1e6
"""Arrivals per second: every round is sent as soon as its client may send it."""


def row_args(row: str, opts: Any, master: MooncakeMaster, l3_dir: str) -> dict[str, Any]:
    fields = dict(
        **model_args(), page_size=opts.page_size, max_total_tokens=opts.device_tokens,
        chunked_prefill_size=opts.chunked_prefill_size, hicache_ratio=opts.hicache_ratio,
        enable_hierarchical_cache=True, hicache_write_policy="write_through",
        hicache_mem_layout="page_first" if on_cuda() else "page_first_direct",
        hicache_io_backend="kernel" if on_cuda() else "direct",
        disaggregation_mode="prefill", random_seed=0,
    )  # fmt: skip
    if row == "L2+L3 file":
        extra = {"file_storage_path": l3_dir}
    elif row == "L2+L3 mooncake":
        extra = {"master_server_address": master.address, "protocol": "tcp",
                 "local_hostname": "127.0.0.1", "global_segment_size": opts.segment}  # fmt: skip
    else:
        return fields
    fields["hicache_storage_backend"] = "file" if "file" in row else "mooncake"
    fields["hicache_storage_backend_extra_config"] = json.dumps(extra)
    return fields


def workload(opts: Any, vocab: int) -> dict[str, Any]:
    return dict(num_clients=opts.num_clients, num_rounds=opts.num_rounds,
                request_length=opts.request_length,
                sub_question_input_length=opts.sub_question_input_length, vocab_size=vocab,
                seed=opts.seed)  # fmt: skip


def run_row(row: str, a: StoreNode, b: StoreNode, opts: Any, master: MooncakeMaster,
            root: str) -> dict[str, Any]:  # fmt: skip
    """A serves the first rounds, B the rest (module docstring); B's numbers, with A's."""
    fields = row_args(row, opts, master, os.path.join(root, row.replace(" ", "_")))
    wl = workload(opts, fields["vocab_size"])
    name = row.replace(" ", "_")
    a.command("build", name=name, args=fields, clock="wall")
    b.command("build", name=name, args=fields, clock="wall")
    try:
        firsts = [[f"c{c.client_id}-r0", c.first_prompt] for c in make_conversations(**wl)]
        served = a.first("serve", name=name, requests=firsts, check=False)
        out = b.first("multiturn", name=name, workload=wl, skip_rounds=1,
                      max_parallel=opts.max_parallel, kv_sample_every=opts.kv_sample_every,
                      rate=UNBOUNDED_RATE, seed=opts.seed)  # fmt: skip
    finally:
        a.command("close", name=name)
        b.command("close", name=name)
    out["l2_hit_tokens"] = out["host_hit_tokens"] - out["storage_hit_tokens"]
    out["a"] = {"requests": len(served["results"]), "storage": served.get("storage"),
                "backend": served.get("backend")}  # fmt: skip
    out.pop("ttft_samples_s", None)
    return out
