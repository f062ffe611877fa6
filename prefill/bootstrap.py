"""A simulated decode peer for PD disaggregation (SGLang ``KVPoll``, sender / receiver pair).

One ``DecodePeer`` per request (SGLang's bootstrap room). Its life, driven by a clock:

``Bootstrapping`` --(delay from ``PeerConfig.bootstrap_delay``)--> ``WaitingForInput``, having
preallocated decode-side slots for tokens ``[decode_prefix_len, n)``; or ``Failed`` with
probability ``bootstrap_failure_prob``. The prefill side calls ``init`` (finalize; SGLang's
``sender.init``) and then ``send`` page-aligned ranges; the peer is ``Transferring`` while sends
are in flight. A send completes after ``transfer_latency_s + bytes / transfer_bandwidth``; only
then are the source slots read and copied into the decode pool with the project's copy ops
(``kernels.transfer_kv_all_layer``), like an RDMA read, so a prefill side that frees or reuses a
slot before the ack is caught by comparing decode-side KV with a recompute. A send fails with
probability ``transfer_failure_prob`` (the peer turns ``Failed``). ``Success`` once the last
range is acked. Tests can also force ``set_ready`` / ``fail`` at any moment.

Failure draws come from ``random.Random(f"{seed}:{rid}")`` so reruns repeat. The "force not
ready on the first attempt" hook (``force_not_ready``) hashes the rid alone, as upstream's
``should_force_retry`` does.

``DecodeSide`` owns the decode KV pool, its allocator and the peers, and keeps a log of every
send (keyed by ``(rid, attempt)``) so tests can check that nothing was sent for an attempt that
was not finalized.
"""

from __future__ import annotations

import hashlib
import logging
import math
import os
import random
from dataclasses import dataclass, field
from enum import IntEnum
from typing import Any

import torch

import kernels
from hicache.allocator import TokenToKVPoolAllocator
from hicache.memory_pool import MHATokenToKVPool
from hicache.streams import CPU_COPY_LOCK
from prefill.clock import Clock

logger = logging.getLogger(__name__)


FORCE_RETRY_ENV = "SGLANG_TEST_FORCE_OPTIMISTIC_PREFILL_RETRY_PROB"
"""Upstream's environment variable for the force-not-ready test hook (read by ``PeerConfig``)."""


class KVPoll(IntEnum):
    """Decode-peer states, as SGLang's ``disaggregation.base.conn.KVPoll``."""

    Failed = 0
    Bootstrapping = 1
    WaitingForInput = 2
    Transferring = 3
    Success = 4


def force_not_ready(rid: str, prob: float) -> bool:
    """Deterministic per-rid coin of probability ``prob`` (upstream ``should_force_retry``)."""
    if prob <= 0:
        return False
    digest = hashlib.sha256(str(rid).encode()).digest()
    return int.from_bytes(digest[:8], "big") < prob * 2**64


@dataclass(frozen=True)
class DelayDistribution:
    """Bootstrap delay in seconds: ``fixed`` (``a``), ``uniform`` on ``[a, b]``, or
    ``exponential`` with mean ``a``. ``parse("uniform:0.01,0.05")`` reads the CLI form."""

    kind: str = "fixed"
    a: float = 0.0
    b: float = 0.0

    def __post_init__(self) -> None:
        if self.kind not in ("fixed", "uniform", "exponential"):
            raise ValueError(f"kind must be fixed, uniform or exponential, got {self.kind!r}")
        if self.a < 0 or self.b < 0 or (self.kind == "uniform" and self.b < self.a):
            raise ValueError(f"bad delay parameters for {self.kind}: a={self.a}, b={self.b}")

    @classmethod
    def parse(cls, spec: str | float | DelayDistribution) -> DelayDistribution:
        if isinstance(spec, DelayDistribution):
            return spec
        if isinstance(spec, (int, float)):
            return cls("fixed", float(spec))
        kind, _, params = str(spec).partition(":")
        values = [float(x) for x in params.split(",") if x.strip()] if params else []
        if kind in ("fixed", "exponential") and len(values) == 1:
            return cls(kind, values[0])
        if kind == "uniform" and len(values) == 2:
            return cls(kind, values[0], values[1])
        raise ValueError(
            f"bootstrap delay spec {spec!r}: use fixed:S, uniform:LO,HI or exponential:MEAN"
        )

    def sample(self, rng: random.Random) -> float:
        if self.kind == "fixed":
            return self.a
        if self.kind == "uniform":
            return rng.uniform(self.a, self.b)
        return rng.expovariate(1.0 / self.a) if self.a > 0 else 0.0


@dataclass(frozen=True)
class PeerConfig:
    """How simulated decode peers behave. ``decode_prefix_len`` is capped per request to a
    page-aligned length that leaves at least one token to send."""

    bootstrap_delay: DelayDistribution = field(default_factory=DelayDistribution)
    bootstrap_failure_prob: float = 0.0
    transfer_failure_prob: float = 0.0
    force_not_ready_prob: float = 0.0
    transfer_latency_s: float = 0.0
    transfer_bandwidth: float = math.inf  # bytes per second
    decode_prefix_len: int = 0
    seed: int = 0

    def __post_init__(self) -> None:
        for name in ("bootstrap_failure_prob", "transfer_failure_prob", "force_not_ready_prob"):
            if not 0.0 <= getattr(self, name) <= 1.0:
                raise ValueError(f"{name} must be in [0, 1], got {getattr(self, name)}")
        if self.transfer_latency_s < 0 or self.transfer_bandwidth <= 0:
            raise ValueError("transfer_latency_s must be >= 0 and transfer_bandwidth > 0")
        if self.decode_prefix_len < 0:
            raise ValueError(f"decode_prefix_len must be >= 0, got {self.decode_prefix_len}")

    @classmethod
    def from_server_args(cls, args: Any) -> PeerConfig:
        """Failure probabilities from ``ServerArgs`` (``FORCE_RETRY_ENV`` overrides the force
        probability, as upstream's test hook); the delay / transfer model from optional fields
        (``disaggregation_bootstrap_delay``, ``disaggregation_transfer_latency_s``,
        ``disaggregation_transfer_bandwidth_gbps``, ``disaggregation_decode_prefix_len``)."""
        bw_gbps = float(getattr(args, "disaggregation_transfer_bandwidth_gbps", 0.0) or 0.0)
        force = float(getattr(args, "disaggregation_force_not_ready_prob", 0))
        env_force = os.environ.get(FORCE_RETRY_ENV)
        if env_force is not None:  # upstream's test hook spelling wins, with a trace
            logger.warning("%s=%s overrides the force-not-ready probability %s", FORCE_RETRY_ENV,
                           env_force, force)
            force = float(env_force)
        return cls(
            bootstrap_delay=DelayDistribution.parse(
                getattr(args, "disaggregation_bootstrap_delay", "fixed:0")
            ),
            bootstrap_failure_prob=float(getattr(args, "disaggregation_bootstrap_failure_prob", 0)),
            transfer_failure_prob=float(getattr(args, "disaggregation_transfer_failure_prob", 0)),
            force_not_ready_prob=force,
            transfer_latency_s=float(getattr(args, "disaggregation_transfer_latency_s", 0.0)),
            transfer_bandwidth=bw_gbps * 1e9 if bw_gbps > 0 else math.inf,
            decode_prefix_len=int(getattr(args, "disaggregation_decode_prefix_len", 0)),
            seed=int(getattr(args, "random_seed", 0)),
        )


@dataclass
class Transfer:
    """One in-flight send: source slots ``src`` for tokens ``[start, end)``; completes (the
    source is read) at ``done_at``. ``fails`` was drawn at send time."""

    attempt: int
    start: int
    end: int
    src: torch.Tensor
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
    """The decode side of one request. Create through ``DecodeSide.create_peer``."""

    def __init__(self, side: DecodeSide, rid: str, num_tokens: int, now: float) -> None:
        cfg = side.config
        self.side = side
        self.rid = rid
        self.num_tokens = num_tokens
        self._rng = random.Random(f"{cfg.seed}:{rid}")
        self.ready_at = now + cfg.bootstrap_delay.sample(self._rng)
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
        self._forced_ready = False

    # ------------------------------------------------------------------ test controls
    def set_ready(self) -> None:
        """Finish the bootstrap now (if still bootstrapping and decode slots are available)."""
        self._forced_ready = True
        self.poll()

    def fail(self, reason: str = "decode peer failed (injected)") -> None:
        """Fail now at any stage before ``Success``; in-flight sends still ack at their time."""
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
        """Sends whose source slots are still being read (not yet acked)."""
        self._complete_transfers(self.side.clock.now())
        return sum(1 for t in self.transfers if not t.acked)

    def next_event_time(self) -> float | None:
        """The earliest future time at which ``poll`` may change something, or None."""
        times = [t.done_at for t in self.transfers if not t.acked]
        if self.state == KVPoll.Bootstrapping and not self._forced_ready:
            times.append(self.ready_at)
        return min(times) if times else None

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

    def _copy_in(self, t: Transfer) -> None:
        """Read the source slots now (the simulated RDMA read). On CUDA the copy is queued on the
        current (compute) stream, so it reads the KV after the forward that wrote it and before
        any later forward can reuse the slots; the last range's copy is waited for, so
        ``Success`` (the end of TTFT) comes after the bytes landed."""
        assert self.decode_slots is not None
        src_pool, dst_pool = self.side.src_pool, self.side.pool
        dst = self.decode_slots[t.start - self.decode_prefix_len : t.end - self.decode_prefix_len]
        args = (
            src_pool.k_data_ptrs, dst_pool.k_data_ptrs, src_pool.v_data_ptrs,
            dst_pool.v_data_ptrs, t.src.to(src_pool.device), dst.to(dst_pool.device),
            src_pool.item_size, src_pool.layer_num,
        )
        if src_pool.device.type == "cpu":
            # Triton's CPU interpreter is not thread-safe: share the side streams' lock.
            with CPU_COPY_LOCK:
                kernels.transfer_kv_all_layer(*args)
            return
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
        self.side.release(self.rid)


class DecodeSide:
    """The decode instance: a KV pool like the prefill one, an allocator, and one peer per rid.

    ``src_pool`` is the prefill device pool the peers read from. With ``keep_received``, a
    successful request's decode slots stay allocated until ``release(rid)`` so tests can read
    them with ``received_kv``; otherwise they are freed at ``Success``.
    """

    def __init__(
        self,
        src_pool: MHATokenToKVPool,
        clock: Clock,
        config: PeerConfig,
        size: int,
        keep_received: bool = True,
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
        self.peers: dict[str, DecodePeer] = {}
        self.send_log: list[SendRecord] = []

    def create_peer(self, rid: str, num_tokens: int) -> DecodePeer:
        if rid in self.peers:
            raise ValueError(f"rid {rid!r} already has a decode peer")
        if num_tokens < 1:
            raise ValueError(f"num_tokens must be >= 1, got {num_tokens}")
        peer = DecodePeer(self, rid, num_tokens, self.clock.now())
        self.peers[rid] = peer
        return peer

    def next_event_time(self) -> float | None:
        times = [t for p in self.peers.values() if (t := p.next_event_time()) is not None]
        return min(times) if times else None

    def on_success(self, peer: DecodePeer) -> None:
        if not self.keep_received:
            self.release(peer.rid)

    def release(self, rid: str) -> None:
        """Free the decode slots of ``rid`` (idempotent)."""
        peer = self.peers.get(rid)
        if peer is not None and peer.decode_slots is not None:
            self.allocator.free(peer.decode_slots)
            peer.decode_slots = None

    def received_kv(self, rid: str) -> tuple[int, torch.Tensor, torch.Tensor]:
        """``(decode_prefix_len, k, v)`` with ``k``/``v`` ``[L, n - decode_prefix_len, H, D]``:
        what decode holds for the tokens prefill sent (valid after ``Success``)."""
        peer = self.peers[rid]
        if peer.state != KVPoll.Success or peer.decode_slots is None:
            raise ValueError(f"rid {rid!r} has no received KV (state {peer.state.name})")
        slots = peer.decode_slots[: peer.num_tokens - peer.decode_prefix_len]
        k = torch.stack([self.pool.k_buffer[i][slots] for i in range(self.pool.layer_num)])
        v = torch.stack([self.pool.v_buffer[i][slots] for i in range(self.pool.layer_num)])
        return peer.decode_prefix_len, k, v
