"""One simulated decode peer (SGLang's bootstrap room, sender / receiver pair): its life, its
sends and their acks, as a :class:`prefill.disagg.protocol.DecodeLink`. ``prefill.disagg.sim_side``
describes the peer's life and owns the decode pool; a peer sees its side through
:class:`PeerSide` (the side imports this module, never the other way round)."""

from __future__ import annotations

import logging
import math
import random
from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Protocol

import torch

from hicache.memory.allocator import page_ceil
from prefill.disagg.protocol import (
    BOOTSTRAP_TIMEOUT_ENV,
    TERMINAL,
    KVPoll,
    MetadataRow,
    SendRecord,
)
from prefill.disagg.sim_config import PeerConfig

logger = logging.getLogger(__name__)


class PeerSide(Protocol):
    """What a simulated peer reads and calls on its decode side (``DecodeSide``)."""

    config: PeerConfig
    clock: Any  # prefill.clock.Clock
    page_size: int
    src_pool: Any  # the prefill device pool the sends read
    pool: Any  # the decode device pool they land in
    allocator: Any  # the decode pool's allocator
    send_log: deque[SendRecord]

    def read(self, src_slots: torch.Tensor, dst_slots: torch.Tensor, last: bool) -> None: ...

    def on_success(self, peer: DecodePeer) -> None: ...

    def retire(self, peer: DecodePeer) -> None: ...


@dataclass
class Transfer:
    """One in-flight send: source slots ``src`` for tokens ``[start, end)``; completes (the
    source is read) at ``done_at``. ``fails`` was drawn at send time."""

    attempt: int
    start: int
    end: int
    src: torch.Tensor | None  # dropped once acked (or when the peer fails)
    done_at: float
    fails: bool
    last: bool
    acked: bool = False


class DecodePeer:
    """The decode side of one request (a ``DecodeLink``). Create through
    ``DecodeSide.create_peer``.

    ``token_ids`` (kept only when the side keeps received KV): the prompt, which a real decode
    instance receives with the request; tests recompute the reference KV from it."""

    def __init__(
        self,
        side: PeerSide,
        rid: str,
        num_tokens: int,
        now: float,
        token_ids: Sequence[int] | None = None,
    ) -> None:
        cfg = side.config
        self.side = side
        self.rid = rid
        self.num_tokens = num_tokens
        self.token_ids = list(token_ids) if token_ids is not None else None
        self._rng = random.Random(f"{cfg.seed}:{rid}")
        self.created_at = now
        self.ready_at = now + cfg.bootstrap_delay.sample(self._rng)
        self.deadline = now + cfg.bootstrap_timeout_s
        self.bootstrap_fails = self._rng.random() < cfg.bootstrap_failure_prob
        ps = side.page_size
        cap = (num_tokens - 1) // ps * ps
        self.decode_prefix_len = min(cfg.decode_prefix_len // ps * ps, cap)
        self.state = KVPoll.Bootstrapping
        self.decode_slots: torch.Tensor | None = None
        self.finalized_attempt: int | None = None
        self.transfers: list[Transfer] = []
        self.received_end = self.decode_prefix_len  # tokens [dpl, received_end) landed
        self.failure: str | None = None
        self.timed_out = False
        self.first_token: int | None = None
        self._forced_ready = False

    # ------------------------------------------------------------------ test controls
    def set_ready(self) -> None:
        """Finish the bootstrap now (if still bootstrapping and decode slots are available)."""
        self._forced_ready = True
        self.poll()

    def fail(self, reason: str = "decode peer failed (injected)") -> None:
        """Fail now at any stage before ``Success``; sends in flight are never read."""
        if self.state != KVPoll.Success:
            self._set_failed(reason)

    # ------------------------------------------------------------------ prefill-side calls
    def poll(self) -> KVPoll:
        """Advance to the clock's ``now`` and return the state. Never blocks."""
        now = self.side.clock.now()
        if self.state == KVPoll.Bootstrapping and (self._forced_ready or now >= self.ready_at):
            if self.bootstrap_fails and not self._forced_ready:
                self._set_failed("decode bootstrap failed (injected)")
            else:
                self._try_prealloc()
        if self.state == KVPoll.Bootstrapping and now >= self.deadline:
            self.timed_out = True
            self._set_failed(
                f"timed out after {now - self.created_at:.1f}s in KVPoll.Bootstrapping "
                f"({BOOTSTRAP_TIMEOUT_ENV}={self.side.config.bootstrap_timeout_s:g})"
            )
        self._complete_transfers(now)
        return self.state

    def init(self, attempt: int) -> None:
        """Finalize: the prefill side commits ``attempt`` as the one whose KV will be sent."""
        if self.poll() != KVPoll.WaitingForInput:
            raise RuntimeError(f"{self.rid}: init in state {self.state.name}")
        if self.finalized_attempt is not None:
            raise RuntimeError(f"{self.rid}: init called twice")
        self.finalized_attempt = attempt

    def send(
        self,
        attempt: int,
        start: int,
        end: int,
        src_slots: torch.Tensor,
        last: bool,
        metadata: MetadataRow | None = None,
    ) -> bool:
        """Queue the KV of tokens ``[start, end)`` held in prefill-pool slots ``src_slots``
        (int64, ``end - start`` entries). Ranges must be contiguous from ``decode_prefix_len``.
        The source is read when the transfer completes, not now. The last send's ``metadata``
        row (first token) is kept in ``first_token``.

        Returns False, queueing nothing, when the peer has failed (it may fail between the
        caller's last poll and this call, like a real transport); the caller aborts the request
        at its next poll. Raises ``RuntimeError`` for a send the protocol never allows."""
        state = self.poll()
        if state == KVPoll.Failed:
            return False
        if self.finalized_attempt != attempt:
            raise RuntimeError(
                f"{self.rid}: send for attempt {attempt}, finalized {self.finalized_attempt}"
            )
        if state not in (KVPoll.WaitingForInput, KVPoll.Transferring):
            raise RuntimeError(f"{self.rid}: send in state {state.name}")
        expected = self.transfers[-1].end if self.transfers else self.decode_prefix_len
        if start != expected or end < start or end > self.num_tokens:
            raise ValueError(f"{self.rid}: send range [{start}, {end}), expected start {expected}")
        if src_slots.numel() != end - start:
            raise ValueError(f"src_slots has {src_slots.numel()} entries for {end - start} tokens")
        if last and end != self.num_tokens:
            raise ValueError(f"last send ends at {end}, request has {self.num_tokens} tokens")
        cfg = self.side.config
        now = self.side.clock.now()
        nbytes = (end - start) * self.side.src_pool.get_size_per_token()
        done_at = now + cfg.transfer_latency_s + nbytes / cfg.transfer_bandwidth
        if self.transfers:  # one queue per peer: acks arrive in send order
            done_at = max(done_at, self.transfers[-1].done_at)
        fails = self._rng.random() < cfg.transfer_failure_prob
        transfer = Transfer(attempt, start, end, src_slots.clone(), done_at, fails, last)
        self.transfers.append(transfer)
        self.side.send_log.append(SendRecord(self.rid, attempt, start, end, now, last))
        if metadata is not None:
            self.first_token = metadata.first_token
        self.state = KVPoll.Transferring
        return True

    def inflight_reads(self) -> int:
        """Sends of a live peer whose source slots are still to be read (not yet acked). A
        failed peer reads nothing more: 0."""
        self._complete_transfers(self.side.clock.now())
        if self.state == KVPoll.Failed:
            return 0
        return sum(1 for t in self.transfers if not t.acked)

    def next_event_time(self) -> float | None:
        """When ``poll`` may next change something on its own: the earliest unacked send's
        completion, the bootstrap delay's end while it lies ahead, and while ``Bootstrapping``
        the timeout. A peer whose delay has passed but whose decode pool is full reports its
        timeout (its preallocation can also succeed earlier, when another peer's event frees
        decode slots). ``None`` once nothing is pending."""
        if not self.live:
            return None
        times = [t.done_at for t in self.transfers if not t.acked]
        if self.state == KVPoll.Bootstrapping:
            now = self.side.clock.now()
            if not self._forced_ready and self.ready_at > now:
                times.append(self.ready_at)
            if self.deadline < math.inf:
                times.append(self.deadline)
        return min(times) if times else None

    @property
    def live(self) -> bool:
        """Not yet ``Success`` or ``Failed`` (a failed peer's unacked sends are never read)."""
        return self.state not in TERMINAL

    # ------------------------------------------------------------------ internals
    def _try_prealloc(self) -> None:
        n = self.num_tokens - self.decode_prefix_len
        ps = self.side.page_size
        slots = self.side.allocator.alloc(page_ceil(n, ps))
        if slots is None:
            return  # decode pool full: stay Bootstrapping, retry at the next poll
        self.decode_slots = slots
        self.state = KVPoll.WaitingForInput

    def _complete_transfers(self, now: float) -> None:
        for t in self.transfers:  # in send order; done_at is non-decreasing
            if t.acked:
                continue
            if t.done_at > now:
                break
            t.acked = True
            if t.fails:
                self._set_failed(f"KV transfer of [{t.start}, {t.end}) failed (injected)")
            elif self.state == KVPoll.Transferring:
                self._copy_in(t)
                self.received_end = t.end
                if t.last:
                    self.state = KVPoll.Success
                    self.side.on_success(self)
            t.src = None

    def _copy_in(self, t: Transfer) -> None:
        """Read the source slots now (the simulated RDMA read), through the decode side
        (``PeerSide.read``: the project's copy ops, ``prefill.disagg.sim_kv.copy_send``, and the
        side's ``copy_hook`` when set); the last range's copy is waited for, so ``Success`` (the
        end of TTFT) comes after the bytes landed."""
        if self.decode_slots is None or t.src is None:
            raise RuntimeError(f"{self.rid}: copy of [{t.start}, {t.end}) without its slots")
        dst = self.decode_slots[t.start - self.decode_prefix_len : t.end - self.decode_prefix_len]
        self.side.read(t.src, dst, last=t.last)

    def _set_failed(self, reason: str) -> None:
        if self.state == KVPoll.Failed:
            return
        self.state = KVPoll.Failed
        self.failure = reason
        logger.debug("%s: %s", self.rid, reason)
        for t in self.transfers:  # a failed peer reads nothing more
            t.src = None
        self.side.retire(self)
