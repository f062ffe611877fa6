"""Who drives the prefill executor's steps under tensor parallelism: only rank 0 accepts
requests and releases; they reach every rank at the next step's ``sync`` with rank 0's clock
reading. Every rank drives, or rank 0 alone and the others ``follow`` until ``stop_followers``.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING

from hicache_prefill.hicache.tp.group import TPGroup
from hicache_prefill.prefill.clock import Clock
from hicache_prefill.prefill.disagg.protocol import DecodeLink
from hicache_prefill.prefill.tp_lockstep.sync import AgreedClock, RankZeroInputs

if TYPE_CHECKING:
    from hicache_prefill.prefill.disagg.protocol import DecodeBackend


def agreed_clock(clock: Clock, group: TPGroup, decode: DecodeBackend | None) -> Clock:
    """``clock``, wrapped in an ``AgreedClock`` under TP; ``ValueError`` when a given
    ``decode`` does not use that clock object under TP."""
    if group.size == 1:
        return clock
    if not isinstance(clock, AgreedClock):
        clock = AgreedClock(clock, group)
    if decode is not None and decode.clock is not clock:
        raise ValueError("decode: under tensor parallelism it must use the executor's clock")
    return clock


class TPDriver:
    """Rank 0's inputs and the follow protocol of one executor; ``drop_results`` runs at every
    step's start while following."""

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
        if self.inputs is not None and self.group.rank:
            raise ValueError(
                f"submit: rank {self.group.rank} of a tensor-parallel group takes requests only "
                "from rank 0's broadcast"
            )

    def pending(self, rid: str) -> bool:
        return self.inputs is not None and self.inputs.pending(rid)

    def submit(self, rid: str, ids: list[int], peer: DecodeLink | None) -> None:
        """Accepted now (one rank), or queued for the next broadcast (then no ``peer``)."""
        if self.inputs is None:
            self.accept(rid, ids, peer, self.clock.now())
            return
        if peer is not None:
            raise ValueError("peer: under tensor parallelism every rank creates its own")
        self.inputs.submit(rid, ids, self.inputs.clock.live_now())

    def release(self, rid: str) -> None:
        if self.inputs is None:
            self.release_local(rid)
        elif self.group.rank == 0:
            self.inputs.release(rid)

    def sync(self) -> bool:
        """Collective under TP: apply rank 0's inputs and set the step's time. Returns
        ``False`` when rank 0 stopped its followers."""
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
        if isinstance(self.clock, AgreedClock):
            self.clock.release()

    def follow(self, step: Callable[[], object], after_step: Callable[[], object] | None) -> None:
        """Ranks other than 0: one ``step()`` per rank 0 broadcast until it stops them."""
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
