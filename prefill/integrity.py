"""Accounting checks of the optimistic prefill executor: ``check_executor(ex)`` raises
``AssertionError`` naming the first broken invariant (queues and stages, KV and metadata
buffer holders, unpublished pending KV, speculative L2/L3 pages, tree locks and slot ledger).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Protocol

from hicache_prefill.prefill.executor_stats import ExecutorStats
from hicache_prefill.prefill.request.state import PrefillRequest, Stage

if TYPE_CHECKING:
    from hicache_prefill.prefill.scheduler.admission import ReqToMetadataIdxAllocator


class ExecutorView(Protocol):
    stats: ExecutorStats
    requests: dict[str, PrefillRequest]
    unpublished_pending: bool
    tree: Any  # RadixCache or HiRadixCache
    metadata: ReqToMetadataIdxAllocator
    bootstrap_queue: list[PrefillRequest]
    waiting_queue: list[PrefillRequest]
    inflight_queue: list[PrefillRequest]
    draining_queue: list[PrefillRequest]
    chunked_req: PrefillRequest | None

    def request_owned_slots(self) -> int: ...


def _require(ok: bool, msg: str) -> None:
    """An explicit check (``assert`` statements vanish under ``python -O``)."""
    if not ok:
        raise AssertionError(f"executor integrity: {msg}")


def check_executor(ex: ExecutorView) -> None:
    """O(requests in flight + tree nodes); touches no device memory."""
    spec = ex.stats.speculative_l2_pages
    _require(spec == 0, f"{spec} host pages written from attempts not finalized")
    spec3 = ex.stats.speculative_l3_pages
    _require(
        spec3 == 0, f"speculative_l3_pages: {spec3} pages stored in L3 from attempts not finalized"
    )
    queues = {
        Stage.BOOTSTRAP: ex.bootstrap_queue,
        Stage.WAITING: ex.waiting_queue,
        Stage.INFLIGHT: ex.inflight_queue,
        Stage.DRAINING: ex.draining_queue,
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
