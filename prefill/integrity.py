"""Accounting checks of the optimistic prefill executor (tests call them after every step).

``check_executor(ex)`` raises ``AssertionError`` naming the first broken invariant:

- every live request is in exactly one queue and its ``stage`` says which;
- requests in the bootstrap or waiting queue, and finished ones, hold no KV (no slots, no lock);
  running and inflight ones hold a lock on their ``last_node``;
- every finished request has a result;
- every tree node's ``lock_ref`` is at least the number of this executor's requests locking it
  or a descendant (the cache's own locks, for pending backups and loads, come on top);
- the tree's ledger balances with the request-owned count: free + in tree + request-owned +
  in flight == total (``tree.check_integrity``), so no slot leaks and none is owned twice.
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING

from prefill.request import Stage

if TYPE_CHECKING:
    from prefill.executor import OptimisticPrefillExecutor

logger = logging.getLogger(__name__)


def check_executor(ex: OptimisticPrefillExecutor) -> None:
    """See the module docstring. O(requests + tree nodes); touches no device memory."""
    queues = {
        Stage.BOOTSTRAP: ex.bootstrap_queue,
        Stage.WAITING: ex.waiting_queue,
        Stage.INFLIGHT: ex.inflight_queue,
        Stage.RELEASING: ex.releasing,
        Stage.RUNNING: [ex.chunked_req] if ex.chunked_req else [],
    }
    seen: dict[str, Stage] = {}
    for stage, q in queues.items():
        for r in q:
            assert r.rid not in seen, f"{r.rid} is in {seen[r.rid]} and {stage}"
            assert r.stage == stage, f"{r.rid} has stage {r.stage}, is queued in {stage}"
            seen[r.rid] = stage
    locks: dict[int, int] = {}
    for r in ex.requests.values():
        if r.rid not in seen:
            assert r.stage == Stage.DONE, f"{r.rid} ({r.stage}) is in no queue"
        holds = r.slots is not None or r.last_node is not None
        if r.stage in (Stage.BOOTSTRAP, Stage.WAITING, Stage.DONE):
            assert not holds, f"{r.rid} holds KV in stage {r.stage}"
        if r.stage in (Stage.RUNNING, Stage.INFLIGHT):
            assert holds and r.last_node is not None, f"{r.rid} runs without KV"
        if r.last_node is not None:
            x = r.last_node
            while x is not None and x is not ex.tree.root_node:
                locks[id(x)] = locks.get(id(x), 0) + 1
                x = x.parent
        if r.stage == Stage.DONE:
            assert r.rid in ex.results, f"{r.rid} is done without a result"
    for node in ex.tree.all_nodes():
        held = locks.get(id(node), 0)
        assert node.lock_ref >= held, f"{node!r}: lock_ref {node.lock_ref} < {held} request locks"
    ex.tree.check_integrity(request_owned=ex.request_owned_slots())
