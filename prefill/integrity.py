"""Accounting checks of the optimistic prefill executor (tests call them after every step).

``check_executor(ex)`` raises ``AssertionError`` naming the first broken invariant:

- every request in flight is in exactly one queue and its ``stage`` says which, and the
  executor knows no other request (a finished one is forgotten once its result is reported);
- requests in the bootstrap or waiting queue hold no KV (no slots, no lock); running and
  inflight ones hold a lock on their ``last_node``;
- metadata buffers: every admitted request (waiting, running, inflight) holds one, requests in
  the bootstrap queue hold none, and held + free == the pool;
- under a tree that backs up at insert, a pending request owns all of its computed KV (nothing
  of it was inserted past its matched prefix);
- no host page was ever written from an attempt that was not finalized
  (``stats.speculative_l2_pages == 0``), and no L3 page stored from one
  (``stats.speculative_l3_pages == 0``);
- every tree node's ``lock_ref`` is at least the number of this executor's requests locking it
  or a descendant (the cache's own locks, for pending backups and loads, come on top);
- the tree's ledger balances with the request-owned count: free + in tree + request-owned +
  in flight == total (``tree.check_integrity``), so no slot leaks and none is owned twice.
"""

from __future__ import annotations

import logging
from typing import Any, Protocol

from prefill.request.state import PrefillRequest, Stage

logger = logging.getLogger(__name__)


class ExecutorView(Protocol):
    """What the checks read of the executor (``OptimisticPrefillExecutor`` provides it; it
    imports this module, never the other way round)."""

    stats: Any  # prefill.stats.ExecutorStats
    requests: dict[str, PrefillRequest]
    unpublished_pending: bool
    tree: Any  # the cache's RadixCache or HiRadixCache
    metadata: Any  # ReqToMetadataIdxAllocator
    bootstrap_queue: list[PrefillRequest]
    waiting_queue: list[PrefillRequest]
    inflight_queue: list[PrefillRequest]
    chunked_req: PrefillRequest | None

    def request_owned_slots(self) -> int: ...


def _require(ok: bool, msg: str) -> None:
    """An explicit check (``assert`` statements vanish under ``python -O``)."""
    if not ok:
        raise AssertionError(f"executor integrity: {msg}")


def check_executor(ex: ExecutorView) -> None:
    """See the module docstring. O(requests in flight + tree nodes); touches no device memory."""
    spec = ex.stats.speculative_l2_pages
    _require(spec == 0, f"{spec} host pages written from attempts not finalized")
    spec3 = ex.stats.speculative_l3_pages
    _require(spec3 == 0, f"speculative_l3_pages: {spec3} pages stored in L3 from attempts "
             "not finalized")  # fmt: skip
    queues = {
        Stage.BOOTSTRAP: ex.bootstrap_queue,
        Stage.WAITING: ex.waiting_queue,
        Stage.INFLIGHT: ex.inflight_queue,
        Stage.RUNNING: [ex.chunked_req] if ex.chunked_req else [],
    }
    seen: dict[str, Stage] = {}
    for stage, q in queues.items():
        for r in q:
            _require(r.rid not in seen, f"{r.rid} is in {seen.get(r.rid)} and {stage}")
            _require(r.stage == stage, f"{r.rid} has stage {r.stage}, is queued in {stage}")
            _require(ex.requests.get(r.rid) is r, f"{r.rid} is queued but not known")
            seen[r.rid] = stage
    _require(
        len(seen) == len(ex.requests),
        f"requests known but in no queue: {sorted(set(ex.requests) - set(seen))}",
    )
    locks: dict[int, int] = {}
    held_buffers = 0
    for r in ex.requests.values():
        holds = r.slots is not None or r.last_node is not None
        if r.stage in (Stage.BOOTSTRAP, Stage.WAITING):
            _require(not holds, f"{r.rid} holds KV in stage {r.stage}")
        else:
            _require(holds and r.last_node is not None, f"{r.rid} runs without KV")
        has_buffer = r.metadata_buffer_index >= 0
        _require(
            has_buffer == (r.stage != Stage.BOOTSTRAP),
            f"{r.rid} in {r.stage} holds metadata buffer {r.metadata_buffer_index}",
        )
        held_buffers += has_buffer
        if ex.unpublished_pending and r.pending_bootstrap and holds:
            _require(
                r.tree_len == r.cached_device + r.cached_host,
                f"{r.rid}: pending, yet {r.tree_len - r.cached_device - r.cached_host} computed "
                "tokens were inserted into a tree that backs up at insert",
            )
        if r.last_node is not None:
            x = r.last_node
            while x is not None and x is not ex.tree.root_node:
                locks[id(x)] = locks.get(id(x), 0) + 1
                x = x.parent
    meta = ex.metadata
    _require(
        held_buffers + meta.available_size() == meta.size,
        f"metadata buffers: {held_buffers} held + {meta.available_size()} free != {meta.size}",
    )
    for node in ex.tree.all_nodes():
        held = locks.get(id(node), 0)
        _require(node.lock_ref >= held, f"{node!r}: lock_ref {node.lock_ref} < {held} requests")
    ex.tree.check_integrity(request_owned=ex.request_owned_slots())
