"""What the prefill executor's ranks agree on under tensor parallelism (docs/DESIGN.md
section 10): rank 0's requests and time, decode-peer states MIN-reduced per queue, and each
batch checked against rank 0's. With one rank every helper is the identity.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import TYPE_CHECKING, Any

from hicache_prefill.hicache.tp.group import RankDivergenceError, TPGroup
from hicache_prefill.prefill.clock import Clock
from hicache_prefill.prefill.disagg.protocol import KVPoll

if TYPE_CHECKING:
    from hicache_prefill.prefill.disagg.protocol import DecodeBackend
    from hicache_prefill.prefill.request.state import PrefillRequest


class AgreedClock:
    """Rank 0's time, fixed for a step by ``set_base``. A virtual inner clock is moved along but
    never read back (every rank reads bitwise the same float); on wall time ``now()`` stays at
    the step's start until ``release()``. ``live_now()`` is rank 0's own reading."""

    def __init__(self, inner: Clock, group: TPGroup) -> None:
        self.inner = inner
        self.group = group
        self.is_virtual = bool(getattr(inner, "is_virtual", False))
        self._base = float(inner.now())
        self._time = self._base  # the shared virtual time (virtual inner clocks only)
        self._live = True

    def set_base(self, t: float) -> None:
        self._base = float(t)
        self._live = False
        if self.is_virtual:
            self._time = self._base
            self.inner.wait_until(self._time)

    def release(self) -> None:
        self._live = True

    def now(self) -> float:
        if self.is_virtual:
            return self._time
        if self._live and self.group.rank == 0:
            return float(self.inner.now())
        return self._base

    def live_now(self) -> float:
        if self.group.rank == 0 and not self.is_virtual:
            return float(self.inner.now())
        return self.now()

    def advance(self, dt: float) -> None:
        self.inner.advance(dt)
        if self.is_virtual:
            self._time += float(dt)

    def wait_until(self, t: float, poll_s: float | None = None) -> None:
        if self.is_virtual:
            if t > self._time:
                self._time = float(t)
                self.inner.wait_until(self._time)
        elif self.group.rank == 0:
            self.inner.wait_until(t, poll_s)


class RankZeroInputs:
    """What rank 0 received since the last step, broadcast at the next one."""

    def __init__(self, group: TPGroup, clock: AgreedClock) -> None:
        self.group = group
        self.clock = clock
        self.ops: list[tuple[Any, ...]] = []
        self._rids: set[str] = set()

    def pending(self, rid: str) -> bool:
        return rid in self._rids

    def submit(self, rid: str, token_ids: list[int], submit_time: float) -> None:
        self.ops.append(("submit", rid, token_ids, submit_time))
        self._rids.add(rid)

    def release(self, rid: str) -> None:
        self.ops.append(("release", rid))

    def stop(self) -> None:
        self.ops.append(("stop",))

    def sync(self) -> list[tuple[Any, ...]]:
        """Collective: returns rank 0's queued operations and sets the step's time."""
        payload = (self.clock.live_now(), self.ops) if self.group.rank == 0 else None
        t, ops = self.group.broadcast_object(payload, src=0, tag="step_inputs")
        self.ops = []
        self._rids.clear()
        self.clock.set_base(t)
        return ops


class PeerPolls:
    """This rank's peer polls, MIN-reduced over the group (one collective per queue, entered
    even for an empty one)."""

    def __init__(self, group: TPGroup) -> None:
        self.group = group

    def each(self, reqs: Sequence[PrefillRequest]) -> Iterable[tuple[PrefillRequest, KVPoll]]:
        if self.group.size == 1:
            return ((r, r.peer.poll()) for r in reqs)
        local = [int(r.peer.poll()) for r in reqs]
        agreed = self.group.agree_min_many(local, tag="peer_polls")
        out = []
        for r, mine, state in zip(reqs, local, agreed, strict=True):
            if state == KVPoll.Failed and mine != KVPoll.Failed:
                r.peer.fail("decode peer failed on another tensor-parallel rank")
            out.append((r, KVPoll(state)))
        return out

    def one(self, req: PrefillRequest) -> KVPoll:
        return next(iter(self.each([req])))[1]

    def sent(self, req: PrefillRequest, ok: bool) -> bool:
        """Whether a send reached every rank's peer (else this rank's peer fails too)."""
        if self.group.size == 1:
            return ok
        agreed = self.group.agree_all(ok, tag="peer_send")
        if ok and not agreed:
            req.peer.fail("a KV send failed on another tensor-parallel rank")
        return agreed

    def drained(self, reqs: Sequence[PrefillRequest]) -> list[bool]:
        """Whether each request's peer reads none of its sends, on every rank (collective)."""
        local = [int(r.peer.inflight_reads() == 0) for r in reqs]
        if self.group.size == 1:
            return [bool(x) for x in local]
        return [bool(x) for x in self.group.agree_min_many(local, tag="peer_drained")]

    def next_event_time(self, decode: DecodeBackend) -> float | None:
        t = decode.next_event_time()
        if self.group.size == 1:
            return t
        times = [x for x in self.group.all_gather_object(t, tag="peer_next_event") if x is not None]
        return min(times) if times else None


def check_batch(group: TPGroup, batch: Sequence[tuple[PrefillRequest, int]]) -> None:
    """Raise ``RankDivergenceError`` on every rank when a rank's batch differs from rank 0's."""
    if group.size == 1:
        return
    mine = [(req.rid, int(n), int(req.computed_len)) for req, n in batch]
    ref = group.broadcast_object(mine if group.rank == 0 else None, src=0, tag="batch")
    try:
        group.assert_same("batch", mine)
    except RankDivergenceError as exc:
        raise RankDivergenceError(
            exc.tag, exc.digests, detail=f"rank 0 runs {ref}, rank {group.rank} runs {mine}"
        ) from None
