"""A simulated decode peer for PD disaggregation (SGLang ``KVPoll``, sender / receiver pair).

One ``DecodePeer`` per request (SGLang's bootstrap room). Its life, driven by a clock:

``Bootstrapping`` --(delay from ``PeerConfig.bootstrap_delay``)--> ``WaitingForInput``, having
preallocated decode-side slots for tokens ``[decode_prefix_len, n)``; or ``Failed`` with
probability ``bootstrap_failure_prob``. A peer whose delay has passed but whose decode pool is
full stays ``Bootstrapping`` and retries at every poll; a peer still ``Bootstrapping``
``bootstrap_timeout_s`` after its creation turns ``Failed`` (SGLang's
``SGLANG_DISAGGREGATION_BOOTSTRAP_TIMEOUT``). The prefill side calls ``init`` (finalize;
SGLang's ``sender.init``) and then ``send`` page-aligned ranges; the peer is ``Transferring``
while sends are in flight. A send completes after ``transfer_latency_s + bytes /
transfer_bandwidth``; only then are the source slots read and copied into the decode pool with
the project's copy ops (``kernels.transfer_kv_all_layer``), like an RDMA read, so a prefill side
that frees or reuses a slot of a live peer's send before the ack is caught by comparing
decode-side KV with a recompute. Sends of a failed peer are never read (the decode side
discards them). A send fails with probability ``transfer_failure_prob`` (the peer turns
``Failed``). ``Success`` once the last range is acked. Tests can also force ``set_ready`` /
``fail`` at any moment.

Failure draws come from ``random.Random(f"{seed}:{rid}")`` so reruns repeat. The "force not
ready on the first attempt" hook (``force_not_ready``) hashes the rid alone, as upstream's
``should_force_retry`` does. ``PeerConfig`` and the delay distributions live in
``prefill.peer_config`` (re-exported here).

``DecodeSide`` owns the decode KV pool, its allocator and the peers, and keeps a bounded log of
the latest sends (keyed by ``(rid, attempt)``) so tests can check that nothing was sent for an
attempt that was not finalized. Memory stays bounded over any number of requests: a peer is
dropped when it fails or succeeds (with ``keep_received``, a successful one stays until
``release(rid)``), an acked send drops its copy of the source slots, and ``next_event_time``
looks at live peers only.
"""

from __future__ import annotations

import logging
import math
import random
from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass
from enum import IntEnum

import torch

import kernels
from hicache.allocator import TokenToKVPoolAllocator
from hicache.memory_pool import MHATokenToKVPool
from hicache.streams import CPU_COPY_LOCK
from prefill.clock import Clock
from prefill.peer_config import (
    BOOTSTRAP_TIMEOUT_ENV,
    FORCE_RETRY_ENV,
    DelayDistribution,
    PeerConfig,
    force_not_ready,
)

__all__ = [
    "BOOTSTRAP_TIMEOUT_ENV",
    "FORCE_RETRY_ENV",
    "DecodePeer",
    "DecodeSide",
    "DelayDistribution",
    "KVPoll",
    "PeerConfig",
    "SendRecord",
    "force_not_ready",
]

logger = logging.getLogger(__name__)


class KVPoll(IntEnum):
    """Decode-peer states, as SGLang's ``disaggregation.base.conn.KVPoll``."""

    Failed = 0
    Bootstrapping = 1
    WaitingForInput = 2
    Transferring = 3
    Success = 4


TERMINAL = (KVPoll.Success, KVPoll.Failed)


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


@dataclass(frozen=True)
class SendRecord:
    """Log entry of one ``send``: who sent what, when."""

    rid: str
    attempt: int
    start: int
    end: int
    time: float
    last: bool


class DecodePeer:
    """The decode side of one request. Create through ``DecodeSide.create_peer``.

    ``token_ids`` (kept only when the side keeps received KV): the prompt, which a real decode
    instance receives with the request; tests recompute the reference KV from it."""

    def __init__(
        self,
        side: DecodeSide,
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

    def send(self, attempt: int, start: int, end: int, src_slots: torch.Tensor, last: bool) -> bool:
        """Queue the KV of tokens ``[start, end)`` held in prefill-pool slots ``src_slots``
        (int64, ``end - start`` entries). Ranges must be contiguous from ``decode_prefix_len``.
        The source is read when the transfer completes, not now.

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
        slots = self.side.allocator.alloc((n + ps - 1) // ps * ps)
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
        """Read the source slots now (the simulated RDMA read). On CUDA the copy is queued on the
        current (compute) stream, so it reads the KV after the forward that wrote it and before
        any later forward can reuse the slots; the last range's copy is waited for, so
        ``Success`` (the end of TTFT) comes after the bytes landed. On CPU it is one indexed
        copy of every layer's K and V (the interpreted Triton kernel would cost ~0.1 s a send;
        the kernel is tested on its own)."""
        assert self.decode_slots is not None and t.src is not None
        src_pool, dst_pool = self.side.src_pool, self.side.pool
        dst = self.decode_slots[t.start - self.decode_prefix_len : t.end - self.decode_prefix_len]
        if src_pool.device.type == "cpu":
            with CPU_COPY_LOCK:  # the side streams' copies touch the same pool
                dst_pool.kv_buffer[:, :, dst] = src_pool.kv_buffer[:, :, t.src]
            return
        args = (
            src_pool.k_data_ptrs, dst_pool.k_data_ptrs, src_pool.v_data_ptrs,
            dst_pool.v_data_ptrs, t.src.to(src_pool.device), dst.to(dst_pool.device),
            src_pool.item_size, src_pool.layer_num,
        )
        # A device-to-device copy standing in for a network transfer, on the compute stream: give
        # it the whole GPU, not HiCache's 2 blocks (a GB through 2 blocks would hold the stream
        # for an estimated tens of ms, charged to every later forward).
        kernels.transfer_kv_all_layer(*args, block_quota=self.side.copy_block_quota)
        if t.last:
            torch.cuda.current_stream(src_pool.device).synchronize()

    def _set_failed(self, reason: str) -> None:
        if self.state == KVPoll.Failed:
            return
        self.state = KVPoll.Failed
        self.failure = reason
        logger.debug("%s: %s", self.rid, reason)
        for t in self.transfers:  # a failed peer reads nothing more
            t.src = None
        self.side.retire(self)


DEFAULT_SEND_LOG_SIZE = 10_000
"""Sends ``DecodeSide.send_log`` remembers by default (the latest ones)."""


class DecodeSide:
    """The decode instance: a KV pool like the prefill one, an allocator, and one peer per rid.

    ``src_pool`` is the prefill device pool the peers read from. With ``keep_received``, a
    successful request's decode slots (and its peer) stay until ``release(rid)`` so tests can
    read them with ``received_kv``; otherwise they are freed at ``Success``. A failed peer's
    slots are freed at once. ``send_log`` keeps the latest ``send_log_size`` sends (``None``:
    all of them, for tests).
    """

    def __init__(
        self,
        src_pool: MHATokenToKVPool,
        clock: Clock,
        config: PeerConfig,
        size: int,
        keep_received: bool = True,
        send_log_size: int | None = DEFAULT_SEND_LOG_SIZE,
    ) -> None:
        self.src_pool = src_pool
        self.clock = clock
        self.config = config
        self.page_size = src_pool.page_size
        self.pool = MHATokenToKVPool(
            size, src_pool.page_size, src_pool.dtype, src_pool.head_num, src_pool.head_dim,
            src_pool.layer_num, src_pool.device,
        )
        self.allocator = TokenToKVPoolAllocator(size, src_pool.page_size, src_pool.device)
        dev = src_pool.device
        # Programs of the simulated transfer's copy kernel: two 32-warp blocks per SM on CUDA.
        self.copy_block_quota = (
            2 * torch.cuda.get_device_properties(dev).multi_processor_count
            if dev.type == "cuda"
            else 2
        )
        self.keep_received = keep_received
        self.peers: dict[str, DecodePeer] = {}  # live peers, and kept successful ones
        self._live: dict[str, DecodePeer] = {}  # peers that may still produce an event
        self.send_log: deque[SendRecord] = deque(maxlen=send_log_size)

    def create_peer(
        self, rid: str, num_tokens: int, token_ids: Sequence[int] | None = None
    ) -> DecodePeer:
        """A new peer for ``rid``. A finished peer kept under the same rid (its KV not yet
        released) is released first; a live one raises ``ValueError``."""
        old = self.peers.get(rid)
        if old is not None:
            if old.live:
                raise ValueError(f"rid {rid!r} already has a live decode peer")
            self.retire(old)
        if num_tokens < 1:
            raise ValueError(f"num_tokens must be >= 1, got {num_tokens}")
        if token_ids is not None and len(token_ids) != num_tokens:
            raise ValueError(f"token_ids has {len(token_ids)} entries, num_tokens is {num_tokens}")
        keep_ids = token_ids if self.keep_received else None
        peer = DecodePeer(self, rid, num_tokens, self.clock.now(), keep_ids)
        self.peers[rid] = peer
        self._live[rid] = peer
        return peer

    def next_event_time(self) -> float | None:
        """Earliest ``next_event_time`` of the live peers; O(live peers)."""
        best = None
        for p in self._live.values():
            t = p.next_event_time()
            if t is not None and (best is None or t < best):
                best = t
        return best

    def on_success(self, peer: DecodePeer) -> None:
        if self._live.get(peer.rid) is peer:
            del self._live[peer.rid]
        if not self.keep_received:
            self.retire(peer)

    def retire(self, peer: DecodePeer) -> None:
        """Free ``peer``'s decode slots and forget it (idempotent; a newer peer under the same
        rid is left alone)."""
        if peer.decode_slots is not None:
            self.allocator.free(peer.decode_slots)
            peer.decode_slots = None
        if self.peers.get(peer.rid) is peer:
            del self.peers[peer.rid]
        if self._live.get(peer.rid) is peer and not peer.live:
            del self._live[peer.rid]

    def release(self, rid: str) -> None:
        """Free the decode slots of ``rid`` and forget its peer (idempotent)."""
        peer = self.peers.get(rid)
        if peer is not None:
            self.retire(peer)

    def received_kv(self, rid: str) -> tuple[int, torch.Tensor, torch.Tensor]:
        """``(decode_prefix_len, k, v)`` with ``k``/``v`` ``[L, n - decode_prefix_len, H, D]``:
        what decode holds for the tokens prefill sent (valid after ``Success``, until
        ``release(rid)``)."""
        peer = self.peers.get(rid)
        if peer is None or peer.state != KVPoll.Success or peer.decode_slots is None:
            state = "released" if peer is None else peer.state.name
            raise ValueError(f"rid {rid!r} has no received KV ({state})")
        slots = peer.decode_slots[: peer.num_tokens - peer.decode_prefix_len]
        k = torch.stack([self.pool.k_buffer[i][slots] for i in range(self.pool.layer_num)])
        v = torch.stack([self.pool.v_buffer[i][slots] for i in range(self.pool.layer_num)])
        return peer.decode_prefix_len, k, v
