"""Who drives the prefill executor's steps under tensor parallelism (SGLang's rank 0 receives
the requests and broadcasts them). Only rank 0 accepts requests and decode-side releases; they
reach every rank at the next step's ``sync`` with rank 0's clock reading. Every rank runs the
same driver, or rank 0 alone drives and the others ``follow`` until ``stop_followers``. With
one rank nothing is broadcast.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING

from hicache.tp.group import TPGroup
from prefill.clock import Clock
from prefill.disagg.protocol import DecodeLink
from prefill.tp_lockstep.sync import AgreedClock, RankZeroInputs

if TYPE_CHECKING:
    from prefill.disagg.protocol import DecodeBackend


def agreed_clock(clock: Clock, group: TPGroup, decode: DecodeBackend | None) -> Clock:
    """The executor's clock: ``clock`` itself with one rank; with more, wrapped in an
    ``AgreedClock`` (unless it is one). Raises ``ValueError`` when a given ``decode`` side does
    not use that clock object under tensor parallelism."""
    if group.size == 1:
        return clock
    if not isinstance(clock, AgreedClock):
        clock = AgreedClock(clock, group)
    if decode is not None and decode.clock is not clock:
        raise ValueError("decode: under tensor parallelism it must use the executor's clock")
    return clock


class TPDriver:
    """Rank 0's inputs and the follow protocol of one executor. ``accept`` queues a request in
    the executor, ``release`` frees the decode side's kept KV on this rank, ``drop_results``
    runs at every step's start while following."""

    def __init__(
        self,
        group: TPGroup,
        clock: Clock,
        accept: Callable[[str, list[int], DecodeLink | None, float], None],
        release: Callable[[str], None],
        drop_results: Callable[[], None],
    ) -> None:
        self.group = group
        self.clock = clock
        self.accept = accept
        self.release_local = release
        self.drop_results = drop_results
        self.inputs: RankZeroInputs | None = None
        if group.size > 1:
            if not isinstance(clock, AgreedClock):
                raise RuntimeError("agreed_clock() wraps the clock first")
            self.inputs = RankZeroInputs(group, clock)
        self.following = False

    def check_submit(self) -> None:
        """Raise ``ValueError`` on a rank other than 0 of a tensor-parallel group."""
        tp_rank = self.group.rank if self.inputs is not None else None
        if tp_rank:
            raise ValueError(
                f"submit: rank {tp_rank} of a tensor-parallel group takes requests only from "
                "rank 0's broadcast"
            )

    def pending(self, rid: str) -> bool:
        """``rid`` was submitted on rank 0 and is not broadcast yet."""
        return self.inputs is not None and self.inputs.pending(rid)

    def submit(self, rid: str, ids: list[int], peer: DecodeLink | None) -> None:
        """A validated request: accepted now (one rank), or queued for the next step's
        broadcast with rank 0's live time (``peer`` must then be omitted: ``ValueError``)."""
        if self.inputs is None:
            self.accept(rid, ids, peer, self.clock.now())
            return
        if peer is not None:
            raise ValueError("peer: under tensor parallelism every rank creates its own")
        self.inputs.submit(rid, ids, self.inputs.clock.live_now())

    def release(self, rid: str) -> None:
        """Free the decode side's kept KV of ``rid``: at once with one rank; under tensor
        parallelism rank 0 queues it for every rank's next step (elsewhere: nothing)."""
        if self.inputs is None:
            self.release_local(rid)
        elif self.group.rank == 0:
            self.inputs.release(rid)

    def sync(self) -> bool:
        """Collective at more than one rank: apply rank 0's requests and releases on every
        rank and set the step's time. Returns ``False`` when rank 0 stopped its followers."""
        if self.inputs is None:
            return True
        keep = True
        for op in self.inputs.sync():
            if op[0] == "submit":
                self.accept(op[1], op[2], None, op[3])
            elif op[0] == "release":
                self.release_local(op[1])
            elif op[0] == "stop":
                keep = False
        if self.following:
            self.drop_results()  # rank 0 hands the results out
        return keep

    def release_clock(self) -> None:
        """The step is over for the caller: rank 0 reads its live clock again."""
        if isinstance(self.clock, AgreedClock):
            self.clock.release()

    def follow(self, step: Callable[[], object], after_step: Callable[[], object] | None) -> None:
        """Ranks other than 0: ``step()`` (then ``after_step()``) once per rank 0 broadcast
        until rank 0 stops the followers. ``ValueError`` on rank 0 or with one rank."""
        if self.inputs is None or self.group.rank == 0:
            raise ValueError("follow: only ranks other than 0 of a tensor-parallel group follow")
        self.following = True
        try:
            while self.sync():
                step()
                if after_step is not None:
                    after_step()
        finally:
            self.following = False

    def stop_followers(self) -> None:
        """Rank 0: end the other ranks' ``follow`` (one more broadcast, no step)."""
        if self.inputs is None or self.group.rank != 0:
            raise ValueError("stop_followers: only rank 0 of a tensor-parallel group stops them")
        self.inputs.stop()
        self.sync()
