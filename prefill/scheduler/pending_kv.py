"""What a pending attempt (one whose decode peer is not ready yet, so not finalized) does with
its KV, by the tree's write policy (see docs/DESIGN.md):

- the tree does not back up at insert (device only, L2 ``write_back``): the attempt publishes
  its computed whole pages at chunk boundaries, at the end of its prefill and at a yield, so a
  retry hits them (the seed's behaviour, and SGLang's ``checkpoint_kv_cache``);
- the tree backs up at insert (L2 ``write_through*``): the attempt's KV stays request-owned
  (SGLang 0.5.23 ``advance_unpublished_req``); finalize publishes it once, before the first
  send; a yield or abort frees it unpublished, and the retry recomputes what the tree lacks.

Either way no insert made for a pending attempt can start a host backup
(``stats.speculative_l2_pages`` stays 0).

Slot ownership at yield (see prefill/request/kv.py for the ranges; abort and completion are in
prefill/scheduler/sends.py):

- ``[0, tree_len)``: tree-owned, locked by this request: the lock is dropped.
- ``[tree_len, len(slots))``: request-owned: freed (after publishing, when the policy allows).
- sends in flight: none; a yield happens only before finalize, and nothing is sent before it.
"""

from __future__ import annotations

import logging

from prefill.request.kv import RequestKV
from prefill.request.state import PrefillRequest
from prefill.scheduler.admission import AdmissionQueue
from prefill.scheduler.storage_prefetch import StoragePrefetch
from prefill.stats import ExecutorStats

logger = logging.getLogger(__name__)


class PendingKV:
    """Publishing and rollback of attempts' KV.

    Args:
        kv: the executor's ``RequestKV`` (insert, release).
        admission: requeues a yielded request.
        stats: yields, unpublished tokens dropped.
        unpublished: keep a pending attempt's KV out of the tree (``tree.backs_up_on_insert``).
        prefetch: the L3 prefetch of attempts (released at a yield, the retry's lookup seeded
            with the prefix the yielded attempt had).
    """

    def __init__(
        self,
        kv: RequestKV,
        admission: AdmissionQueue,
        stats: ExecutorStats,
        unpublished: bool,
        prefetch: StoragePrefetch | None = None,
    ) -> None:
        self.kv = kv
        self.admission = admission
        self.stats = stats
        self.unpublished = unpublished
        self.prefetch = prefetch

    def publish(self, req: PrefillRequest, chunked: bool) -> None:
        """Insert the request's computed whole pages, unless it is pending and the tree would
        back them up (then they stay request-owned until finalize). A no-op for pages already
        in the tree."""
        if req.pending_bootstrap and self.unpublished:
            return
        self.kv.cache_unfinished(req, chunked=chunked)

    def drop(self, req: PrefillRequest) -> None:
        """Count the pending attempt's computed KV about to be freed unpublished (a yield or an
        abort under a tree that backs up at insert)."""
        if req.pending_bootstrap and self.unpublished and req.slots is not None:
            self.stats.unpublished_dropped_tokens += max(0, req.computed_len - req.tree_len)

    def yield_(self, req: PrefillRequest) -> None:
        """Optimistic rollback: publish what the policy allows, release, reset, requeue (head of
        the waiting queue, or the bootstrap queue once attempts are used up)."""
        if not req.pending_bootstrap or req.peer.inflight_reads():
            raise RuntimeError(f"{req.rid}: yield of a finalized request or one a peer still reads")
        self.publish(req, chunked=req.computed_len < req.num_tokens)
        self.drop(req)
        req.yielded_len = req.computed_len
        matched = req.tree_len  # the prefix this attempt holds in the tree (SGLang's
        self.kv.release(req)  # yielded_prefix_len: its cache-protected length)
        if self.prefetch is not None:
            self.prefetch.on_yield(req, matched)
        req.reset_attempt()
        req.yields += 1
        self.stats.yields += 1
        self.admission.requeue_yielded(req)
