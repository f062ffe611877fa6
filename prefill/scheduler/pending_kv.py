"""What a pending (not finalized) attempt does with its KV: published at chunk boundaries,
prefill end and yield when the tree does not back up at insert; kept request-owned until
finalize when it does (docs/DESIGN.md section 7).
"""

from __future__ import annotations

from hicache_prefill.prefill.request.kv import RequestKV
from hicache_prefill.prefill.request.state import PrefillRequest
from hicache_prefill.prefill.scheduler.admission import AdmissionQueue
from hicache_prefill.prefill.scheduler.storage_prefetch import StoragePrefetch


class PendingKV:
    """``unpublished`` (the tree backs up at insert) keeps a pending attempt's KV out of it."""

    def __init__(self, kv: RequestKV, admission: AdmissionQueue, prefetch: StoragePrefetch) -> None:
        self.kv = kv
        self.admission = admission
        self.prefetch = prefetch
        self.stats = kv.stats
        self.unpublished = bool(kv.tree.backs_up_on_insert)

    def publish(self, req: PrefillRequest, chunked: bool) -> None:
        if req.pending_bootstrap and self.unpublished:
            return
        self.kv.cache_unfinished(req, chunked=chunked)

    def drop(self, req: PrefillRequest) -> None:
        if req.pending_bootstrap and self.unpublished and req.slots is not None:
            self.stats.unpublished_dropped_tokens += max(0, req.computed_len - req.tree_len)

    def yield_(self, req: PrefillRequest) -> None:
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
