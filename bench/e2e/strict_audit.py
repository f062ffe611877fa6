"""The strict decode-side audit: the KV decode received for a request, bit for bit against a
second forward chunked the same way.

The loose audit (``bench.e2e.audit``) compares decode-side KV with a full recompute of the
prompt, which differs from the chunked prefill by rounding (row-wise relative error in bf16),
so a small corruption can hide in it. Here ``ForwardLog`` records every forward the executor
runs: for each request in the batch its attempt, its token range ``[lo, lo + n)``, and the
batch's layout (every entry's token count, and which entry it is). ``replay_matches`` then
recomputes, for one sampled request, the tokens its final attempt computed: a scratch pool holds
the prefix the attempt found in the cache (as decode received it), and every recorded forward of
that attempt is run again in order with the same layout (the other entries' rows are filler
tokens: a matmul's row depends on the matrix's shape, not on the other rows' values), so on one
device each computed token's KV comes out bit for bit as the executor's did. Any difference is a
mismatch: KV sent from a wrong slot, a slot reused before its send was read, a wrong prefix.

The prefix the final attempt reused (a cache hit, computed by an earlier request chunked its own
way) is covered by the loose audit only.
"""

from __future__ import annotations

import logging
from collections import defaultdict
from dataclasses import dataclass
from typing import Any

import torch

from hicache.memory.allocator import page_ceil
from prefill.disagg.sim_kv import decode_pool_like, read_kv, write_kv

logger = logging.getLogger(__name__)

__all__ = ["ChunkRecord", "ForwardLog", "replay_matches"]


@dataclass(frozen=True)
class ChunkRecord:
    """One request's part of one forward: tokens ``[lo, lo + n)`` of ``attempt``, entry
    ``index`` of a batch whose entries had ``lens`` new tokens each."""

    attempt: int
    lo: int
    n: int
    index: int
    lens: tuple[int, ...]


class ForwardLog:
    """Records the layout of every forward of one executor (wraps ``ex.batch_runner.forward``,
    an instance attribute). ``chunks[rid]``: the records of its current attempt (an older
    attempt's are dropped when a new one computes). ``forget(rid)`` drops a request's."""

    def __init__(self, ex: Any) -> None:
        self.chunks: dict[str, list[ChunkRecord]] = defaultdict(list)
        forward = ex.batch_runner.forward

        def logged(batch: Any) -> Any:
            lens = tuple(int(n) for _, n in batch)
            for i, (req, n) in enumerate(batch):
                recs = self.chunks[req.rid]
                if recs and recs[-1].attempt != req.attempt:
                    recs.clear()
                recs.append(ChunkRecord(req.attempt, int(req.computed_len), int(n), i, lens))
            return forward(batch)

        ex.batch_runner.forward = logged

    def forget(self, rid: str) -> None:
        self.chunks.pop(rid, None)


def replay_matches(ex: Any, rid: str, log: ForwardLog, seed: int = 0) -> bool | None:
    """Whether the decode-side KV of ``rid``'s computed tokens equals, bit for bit, a replay of
    its final attempt's forwards (see the module docstring). ``None`` when no replay is
    possible: no record, or a decode prefix that hides part of the attempt's cached prefix.
    MHA and MLA pools alike (``prefill.disagg.sim_kv``). Valid after ``Success`` until the
    decode side releases it. Collective under tensor parallelism (every rank replays the same
    forwards)."""
    recs = log.chunks.get(rid)
    pool = ex.pool
    if not recs:
        return None
    dpl, *got = ex.decode.received_kv(rid)
    token_ids = ex.decode.peers[rid].token_ids
    recs = sorted(recs, key=lambda r: r.lo)
    p0 = recs[0].lo  # the prefix the final attempt found cached
    if dpl != 0 or token_ids is None or recs[-1].lo + recs[-1].n != len(token_ids):
        return None
    from prefill.model.paged import ExtendInput

    page, dev = pool.page_size, pool.device
    own = page_ceil(len(token_ids), page)
    fill = max(sum(r.lens) - r.n for r in recs)
    scratch = decode_pool_like(pool, own + page_ceil(fill, page) + page)  # MHA or MLA
    slots = torch.arange(page, page + len(token_ids), device=dev)  # token t at slots[t]
    filler_slots = torch.arange(page + own, page + own + fill, device=dev)
    if p0:
        write_kv(scratch, slots[:p0], tuple(t[:, :p0] for t in got))
    gen = torch.Generator().manual_seed(seed)
    vocab = ex.model.config.vocab_size
    ids = torch.tensor(token_ids, dtype=torch.int64)
    for r in recs:
        batch, at = [], 0
        for i, n in enumerate(r.lens):
            if i == r.index:
                batch.append(ExtendInput(ids[r.lo : r.lo + r.n], slots[: r.lo + r.n], r.lo))
            else:  # filler rows: the same matrix shapes
                batch.append(ExtendInput(torch.randint(1, vocab, (n,), generator=gen),
                                         filler_slots[at : at + n], 0))  # fmt: skip
                at += n
        ex.model.forward_extend(scratch, batch)
    ref = read_kv(scratch, slots[p0:])
    return all(torch.equal(g[:, p0:], r.to(g.device)) for g, r in zip(got, ref, strict=True))
