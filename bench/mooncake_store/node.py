"""``python -m bench.mooncake_store.node``: a node process (``prefill.testing.node_commands``) with
the benchmark's two commands:

- ``bandwidth {extra, pages, total_bytes, repeats}``: ``bandwidth.measure`` for each page size
  against the store ``extra`` names (rank 0);
- ``multiturn {name, workload, skip_rounds, max_parallel, kv_sample_every, rate, seed}``: the
  conversations of ``workload`` (``bench.e2e.workload.make_conversations`` arguments), each
  advanced by ``skip_rounds`` rounds without serving them (another instance served those),
  driven through executor ``name`` by ``bench.multiturn.trace.drive_trace`` on its clock; returns
  ``config_summary`` with the ``audit`` and the tier's counters.
"""

from __future__ import annotations

import argparse
import dataclasses
import sys
from typing import Any

from bench.e2e.audit import audit, config_summary
from bench.e2e.workload import make_conversations
from bench.mooncake_store import bandwidth
from bench.multiturn.trace import drive_trace
from prefill.testing.node_commands import COMMANDS
from prefill.testing.node_main import Node, main


def bandwidth_rows(node: Node, msg: dict) -> Any:
    if node.rank != 0:
        return None
    return [bandwidth.measure(msg["extra"], page, msg["total_bytes"], msg["repeats"])
            for page in msg["pages"]]  # fmt: skip


def multiturn(node: Node, msg: dict) -> Any:
    ex = node.executors.get(msg["name"])
    if ex is None:
        return None
    conversations = make_conversations(**msg["workload"])
    for conv in conversations:
        for _ in range(msg["skip_rounds"]):
            conv.complete_round(conv.next_prompt())
    opts = argparse.Namespace(max_parallel=msg["max_parallel"],
                              kv_sample_every=msg["kv_sample_every"])  # fmt: skip
    run = drive_trace(ex, None, conversations, msg["rate"], msg["seed"], msg["name"], opts)
    ex.drain_cache_events()
    out = config_summary(run)
    out["integrity"] = audit(run)
    out["integrity"]["speculative_l3_pages"] = ex.stats.speculative_l3_pages
    out["storage_hit_tokens"] = ex.cache.stats.storage_hit_tokens
    out["load_back_no_room_tokens"] = ex.cache.stats.load_back_no_room_tokens
    storage = ex.cache.storage
    if storage is not None:
        out["storage"] = storage.stats.as_dict()
        out["prefetch_unused_tokens"] = storage.stats.prefetch_unused_tokens
        backend = storage.backend
        stats = getattr(backend, "backend", backend).get_stats()
        out["backend"] = dataclasses.asdict(stats) if dataclasses.is_dataclass(stats) else None
    return out


if __name__ == "__main__":
    sys.exit(main({**COMMANDS, "bandwidth": bandwidth_rows, "multiturn": multiturn}))
