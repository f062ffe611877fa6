"""The simulated decode side (``--disaggregation-transfer-backend simulated``, the default): a
``DecodeBackend`` in this process, deterministic on the executor's clock. ``DecodeSide`` owns a
decode pool like the prefill one and one ``DecodePeer`` per request; ``PeerConfig`` says how
peers behave. A send's source slots are read only when the send completes (like an RDMA read),
so a prefill side that reuses a live send's slot before the ack shows in decode-side KV; a
failed peer's sends are never read. Failure draws come from ``random.Random(f"{seed}:{rid}")``
so reruns repeat."""

from __future__ import annotations

import logging
import math
import random
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from hicache_prefill import kernels
from hicache_prefill.hicache.memory.allocator import TokenToKVPoolAllocator, page_ceil
from hicache_prefill.hicache.memory.device_pool import KVPool, MLATokenToKVPool
from hicache_prefill.hicache.transfer.streams import CPU_COPY_LOCK
from hicache_prefill.prefill.clock import Clock
from hicache_prefill.prefill.disagg.mooncake.layout import KVGeometry, buffer_kinds, layer_buffers
from hicache_prefill.prefill.disagg.protocol import (
    BOOTSTRAP_TIMEOUT_ENV,
    DEFAULT_BOOTSTRAP_TIMEOUT_S,
    TERMINAL,
    KVPoll,
    MetadataRow,
    SendRecord,
    bootstrap_timeout_from_env,
    check_new_link,
    finalize,
    force_not_ready_prob,
    send_allowed,
)

logger = logging.getLogger(__name__)

DEFAULT_SEND_LOG_SIZE = 10_000

CopyHook = Callable[[int, Callable[[], None]], None]
"""``hook(nbytes, copy)``: runs one read of a completed send; must call ``copy()`` once."""


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
    page-aligned length below the prompt; ``bootstrap_timeout_s`` may be ``math.inf``."""

    bootstrap_delay: DelayDistribution = field(default_factory=DelayDistribution)
    bootstrap_failure_prob: float = 0.0
    transfer_failure_prob: float = 0.0
    force_not_ready_prob: float = 0.0
    transfer_latency_s: float = 0.0
    transfer_bandwidth: float = math.inf  # bytes per second
    decode_prefix_len: int = 0
    seed: int = 0
    bootstrap_timeout_s: float = DEFAULT_BOOTSTRAP_TIMEOUT_S

    def __post_init__(self) -> None:
        for name in ("bootstrap_failure_prob", "transfer_failure_prob", "force_not_ready_prob"):
            if not 0.0 <= getattr(self, name) <= 1.0:
                raise ValueError(f"{name} must be in [0, 1], got {getattr(self, name)}")
        if self.transfer_latency_s < 0 or self.transfer_bandwidth <= 0:
            raise ValueError("transfer_latency_s must be >= 0 and transfer_bandwidth > 0")
        if self.decode_prefix_len < 0:
            raise ValueError(f"decode_prefix_len must be >= 0, got {self.decode_prefix_len}")
        if not self.bootstrap_timeout_s > 0:
            raise ValueError(f"bootstrap_timeout_s must be > 0, got {self.bootstrap_timeout_s}")

    @classmethod
    def from_server_args(cls, args: Any) -> PeerConfig:
        """From ``ServerArgs`` (missing fields defaulted) and SGLang's environment variables."""
        bw_gbps = float(getattr(args, "disaggregation_transfer_bandwidth_gbps", 0.0) or 0.0)
        return cls(
            bootstrap_delay=DelayDistribution.parse(
                getattr(args, "disaggregation_bootstrap_delay", "fixed:0")
            ),
            bootstrap_failure_prob=float(getattr(args, "disaggregation_bootstrap_failure_prob", 0)),
            transfer_failure_prob=float(getattr(args, "disaggregation_transfer_failure_prob", 0)),
            force_not_ready_prob=force_not_ready_prob(args),
            transfer_latency_s=float(getattr(args, "disaggregation_transfer_latency_s", 0.0)),
            transfer_bandwidth=bw_gbps * 1e9 if bw_gbps > 0 else math.inf,
            decode_prefix_len=int(getattr(args, "disaggregation_decode_prefix_len", 0)),
            seed=int(getattr(args, "random_seed", 0)),
            bootstrap_timeout_s=bootstrap_timeout_from_env(),
        )


def decode_pool_like(src_pool: KVPool, size: int) -> KVPool:
    """A zeroed pool of ``src_pool``'s kind, geometry and device with ``size`` slots."""
    return KVGeometry.from_pool(src_pool).make_pool(size, src_pool.device)


def copy_send(
    src_pool: KVPool,
    dst_pool: KVPool,
    src: torch.Tensor,
    dst: torch.Tensor,
    block_quota: int,
    wait: bool = False,
) -> None:
    """Copy every layer's KV of ``src_pool`` slots ``src`` into ``dst_pool`` slots ``dst``:
    CUDA, all-layer kernels of ``block_quota`` programs on the current stream (``wait``: block
    until done); CPU, the direct op. ``ValueError`` for pools of different kinds."""
    mla = isinstance(src_pool, MLATokenToKVPool)
    if mla != isinstance(dst_pool, MLATokenToKVPool):
        raise ValueError(
            f"dst_pool: {type(dst_pool).__name__} cannot receive a {type(src_pool).__name__}'s KV"
        )
    if src_pool.device.type == "cpu":
        with CPU_COPY_LOCK:  # the side streams' copies touch the same pool
            kernels.transfer_kv_direct(
                layer_buffers(src_pool), layer_buffers(dst_pool), src, dst, page_size=1
            )
        return
    s, d, layers = src.to(src_pool.device), dst.to(dst_pool.device), src_pool.layer_num
    if not mla and src_pool.v_item_size == src_pool.item_size:
        kernels.transfer_kv_all_layer(
            src_pool.k_data_ptrs,
            dst_pool.k_data_ptrs,
            src_pool.v_data_ptrs,
            dst_pool.v_data_ptrs,
            s,
            d,
            src_pool.item_size,
            layers,
            block_quota=block_quota,
        )
    else:  # MLA's latent, or K and V of different widths: one table copy per buffer
        tables = (
            [("data_ptrs", src_pool.item_size)]
            if mla
            else [("k_data_ptrs", src_pool.item_size), ("v_data_ptrs", src_pool.v_item_size)]
        )
        for ptrs, item in tables:
            kernels.transfer_kv_all_layer_mla(
                getattr(src_pool, ptrs),
                getattr(dst_pool, ptrs),
                s,
                d,
                item,
                layers,
                block_quota=block_quota,
            )
    if wait:
        torch.cuda.current_stream(src_pool.device).synchronize()


def read_kv(pool: KVPool, slots: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """Copies of what ``pool`` holds at ``slots``: MHA ``(k [L, n, H, D], v [L, n, H, D_v])``,
    MLA ``(kv [L, n, 1, C],)``."""
    return tuple(torch.stack([layer[slots] for layer in kind]) for kind in buffer_kinds(pool))


def write_kv(pool: KVPool, slots: torch.Tensor, kv: tuple[torch.Tensor, ...]) -> None:
    """Write ``kv`` (as ``read_kv`` returns it) at ``slots``; ``ValueError``, pool unchanged,
    when the kinds, layers or tokens differ."""
    kinds = buffer_kinds(pool)

    fits = len(kv) == len(kinds) and all(
        tuple(t.shape[:2]) == (len(k), len(slots)) for t, k in zip(kv, kinds, strict=True)
    )
    if not fits:
        shapes = [tuple(t.shape) for t in kv]
        raise ValueError(
            f"kv: {shapes} does not fit {len(kinds)} kinds of {pool.layer_num} "
            f"layers at {len(slots)} slots"
        )
    for tensors, layers in zip(kv, kinds, strict=True):
        for layer, buf in enumerate(layers):
            buf[slots] = tensors[layer].to(buf.device, buf.dtype)


@dataclass
class Transfer:
    """One in-flight send of tokens ``[start, end)``; its source is read at ``done_at``."""

    attempt: int
    start: int
    end: int
    src: torch.Tensor | None  # dropped once acked (or when the peer fails)
    done_at: float
    fails: bool
    last: bool
    acked: bool = False


class DecodePeer:
    """The decode side of one request (a ``DecodeLink``), made by ``DecodeSide.create_peer``."""

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
        self.first_token: int | None = None
        self._forced_ready = False

    def set_ready(self) -> None:
        """Test control: finish the bootstrap now (if decode slots are available)."""
        self._forced_ready = True
        self.poll()

    def fail(self, reason: str = "decode peer failed (injected)") -> None:
        """Fail now at any stage before ``Success``; sends in flight are never read."""
        if self.state != KVPoll.Success:
            self._set_failed(reason)

    def poll(self) -> KVPoll:
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
        finalize(self, attempt)

    @property
    def sent_end(self) -> int:
        return self.transfers[-1].end if self.transfers else self.decode_prefix_len

    def send(
        self,
        attempt: int,
        start: int,
        end: int,
        src_slots: torch.Tensor,
        last: bool,
        metadata: MetadataRow | None = None,
    ) -> bool:
        if not send_allowed(self, attempt, start, end, src_slots):
            return False
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
        """Unacked sends of a live peer (a failed peer reads nothing more: 0)."""
        self._complete_transfers(self.side.clock.now())
        if self.state == KVPoll.Failed:
            return 0
        return sum(1 for t in self.transfers if not t.acked)

    def next_event_time(self) -> float | None:
        """A send's completion, the end of the bootstrap delay or the bootstrap timeout."""
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
        return self.state not in TERMINAL

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
        """The simulated RDMA read; the last range's is waited for, so ``Success`` follows it."""
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


class DecodeSide:
    """The decode instance: a KV pool like the prefill one, one peer per rid and a bounded
    ``send_log``. With ``keep_received`` a successful peer keeps its slots until ``release``.
    Reads run on the caller's thread; ``copy_hook`` (settable) wraps each one."""

    def __init__(
        self,
        src_pool: KVPool,
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
        self.pool = decode_pool_like(src_pool, size)
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
        self.copy_hook: CopyHook | None = None
        self.read_tokens = 0  # tokens whose KV the reads copied (all peers, ever)

    @property
    def force_not_ready_prob(self) -> float:
        return self.config.force_not_ready_prob

    def create_peer(
        self, rid: str, num_tokens: int, token_ids: Sequence[int] | None = None
    ) -> DecodePeer:
        """A new peer for ``rid``; a kept finished one is released first, a live one raises."""
        old = self.peers.get(rid)
        check_new_link(old, rid, num_tokens, token_ids)
        if old is not None:
            self.retire(old)
        keep_ids = token_ids if self.keep_received else None
        peer = DecodePeer(self, rid, num_tokens, self.clock.now(), keep_ids)
        self.peers[rid] = peer
        self._live[rid] = peer
        return peer

    def read(self, src_slots: torch.Tensor, dst_slots: torch.Tensor, last: bool) -> None:
        self.read_tokens += int(src_slots.numel())
        if self.copy_hook is None:
            self.copy_kv(src_slots, dst_slots, last)
            return
        nbytes = int(src_slots.numel()) * self.src_pool.get_size_per_token()
        self.copy_hook(nbytes, lambda: self.copy_kv(src_slots, dst_slots, last))

    def copy_kv(self, src_slots: torch.Tensor, dst_slots: torch.Tensor, wait: bool) -> None:
        """On CUDA on the compute stream, after the forward that wrote ``src_slots``."""
        copy_send(self.src_pool, self.pool, src_slots, dst_slots, self.copy_block_quota, wait=wait)

    def next_event_time(self) -> float | None:
        times = [t for p in self._live.values() if (t := p.next_event_time()) is not None]
        return min(times, default=None)

    def on_success(self, peer: DecodePeer) -> None:
        if self._live.get(peer.rid) is peer:
            del self._live[peer.rid]
        if not self.keep_received:
            self.retire(peer)

    def retire(self, peer: DecodePeer) -> None:
        """Free ``peer``'s decode slots and forget it (idempotent; a newer peer is kept)."""
        if peer.decode_slots is not None:
            self.allocator.free(peer.decode_slots)
            peer.decode_slots = None
        if self.peers.get(peer.rid) is peer:
            del self.peers[peer.rid]
        if self._live.get(peer.rid) is peer and not peer.live:
            del self._live[peer.rid]

    def release(self, rid: str) -> None:
        peer = self.peers.get(rid)
        if peer is not None:
            self.retire(peer)

    def received_kv(self, rid: str) -> tuple[Any, ...]:
        """``(decode_prefix_len, *read_kv(...))`` of the sent tokens, from ``Success`` until
        ``release(rid)``."""

        peer = self.peers.get(rid)
        if peer is None or peer.state != KVPoll.Success or peer.decode_slots is None:
            state = "released" if peer is None else peer.state.name
            raise ValueError(f"rid {rid!r} has no received KV ({state})")
        slots = peer.decode_slots[: peer.num_tokens - peer.decode_prefix_len]
        return (peer.decode_prefix_len, *read_kv(self.pool, slots))
