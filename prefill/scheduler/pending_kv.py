"""What a pending attempt (its decode peer not ready, so not finalized) does with its KV, by the
tree's write policy (docs/DESIGN.md section 7): published at chunk boundaries, the end of its
prefill and a yield when the tree does not back up at insert; kept request-owned until finalize
when it does. Either way no insert made for a pending attempt starts a host backup.

At a yield the request drops its lock on ``[0, tree_len)`` and frees ``slots[tree_len:]``; it
has no send in flight (nothing is sent before finalize).
"""

from __future__ import annotations

import logging

from prefill.request.kv import RequestKV
from prefill.request.state import PrefillRequest
from prefill.scheduler.admission import AdmissionQueue
from prefill.scheduler.storage_prefetch import StoragePrefetch

logger = logging.getLogger(__name__)


class PendingKV:
    """Publishing and rollback of attempts' KV; ``unpublished`` (the tree backs up at insert)
    keeps a pending attempt's KV out of the tree."""

    def __init__(self, kv: RequestKV, admission: AdmissionQueue, prefetch: StoragePrefetch) -> None:
        self.kv = kv
        self.admission = admission
        self.prefetch = prefetch
        self.stats = kv.stats
        self.unpublished = bool(kv.tree.backs_up_on_insert)

    def publish(self, req: PrefillRequest, chunked: bool) -> None:
        """Insert the request's computed whole pages, unless it is pending and the tree would
        back them up. A no-op for pages already in the tree."""
        if req.pending_bootstrap and self.unpublished:
            return
        self.kv.cache_unfinished(req, chunked=chunked)

    def drop(self, req: PrefillRequest) -> None:
        """Count the pending attempt's computed KV about to be freed unpublished."""
        if req.pending_bootstrap and self.unpublished and req.slots is not None:
            self.stats.unpublished_dropped_tokens += max(0, req.computed_len - req.tree_len)

    def yield_(self, req: PrefillRequest) -> None:
        """Optimistic rollback: publish what the policy allows, release, reset, requeue."""
        if not req.pending_bootstrap or req.peer.inflight_reads():
            raise RuntimeError(f"{req.rid}: yield of a finalized request or one a peer still reads")
        self.publish(req, chunked=req.computed_len < req.num_tokens)
        self.drop(req)
        req.yielded_len = req.computed_len
        matched = req.tree_len  # SGLang's yielded_prefix_len: its cache-protected length
        self.kv.release(req)
        self.prefetch.on_yield(req, matched)
        req.reset_attempt()
        req.yields += 1
        self.stats.yields += 1
        self.admission.requeue_yielded(req)
