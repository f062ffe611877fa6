"""The simulated decode instance of PD disaggregation: a ``DecodeBackend`` in this process.

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
the project's copy ops (``prefill.disagg.sim_kv.copy_send``), like an RDMA read, so a prefill side
that frees or reuses a slot of a live peer's send before the ack is caught by comparing
decode-side KV with a recompute. Sends of a failed peer are never read (the decode side
discards them). A send fails with probability ``transfer_failure_prob`` (the peer turns
``Failed``). ``Success`` once the last range is acked. Tests can also force ``set_ready`` /
``fail`` at any moment.

Failure draws come from ``random.Random(f"{seed}:{rid}")`` so reruns repeat. The "force not
ready on the first attempt" hook (``prefill.disagg.protocol.force_not_ready``) hashes the rid
alone, as upstream's ``should_force_retry`` does. ``DecodePeer`` lives in
``prefill.disagg.sim_peer``, ``PeerConfig`` and the delay distributions in
``prefill.disagg.sim_config``, ``KVPoll`` and the protocol in ``prefill.disagg.protocol``.

``DecodeSide`` owns the decode KV pool, its allocator and the peers, and keeps a bounded log of
the latest sends (keyed by ``(rid, attempt)``) so tests can check that nothing was sent for an
attempt that was not finalized. Memory stays bounded over any number of requests: a peer is
dropped when it fails or succeeds (with ``keep_received``, a successful one stays until
``release(rid)``), an acked send drops its copy of the source slots, and ``next_event_time``
looks at live peers only.
"""

from __future__ import annotations

import logging
from collections import deque
from collections.abc import Callable, Sequence
from typing import Any

import torch

from hicache.memory.allocator import TokenToKVPoolAllocator
from hicache.memory.device_pool import KVPool
from prefill.clock import Clock
from prefill.disagg.protocol import KVPoll, SendRecord
from prefill.disagg.sim_config import PeerConfig
from prefill.disagg.sim_kv import copy_send, decode_pool_like, read_kv
from prefill.disagg.sim_peer import DecodePeer

logger = logging.getLogger(__name__)


DEFAULT_SEND_LOG_SIZE = 10_000
"""Sends ``DecodeSide.send_log`` remembers by default (the latest ones)."""

CopyHook = Callable[[int, Callable[[], None]], None]
"""``hook(nbytes, copy)``: runs one read of a completed send; must call ``copy()`` once."""


class DecodeSide:
    """The decode instance: a KV pool like the prefill one, an allocator, and one peer per rid.

    ``src_pool`` is the prefill device pool the peers read from (MHA or MLA; the decode pool is
    of its kind, ``prefill.disagg.sim_kv``). With ``keep_received``, a
    successful request's decode slots (and its peer) stay until ``release(rid)`` so tests can
    read them with ``received_kv``; otherwise they are freed at ``Success``. A failed peer's
    slots are freed at once. ``send_log`` keeps the latest ``send_log_size`` sends (``None``:
    all of them, for tests).

    Reads of completed sends run on the caller's thread (the executor's, inside a poll): this
    in-process stand-in for a transport copies the bytes itself (``copy_kv``). ``copy_hook``
    (settable attribute, default ``None``) wraps each read, e.g. to time it or to charge its
    modelled cost to a virtual clock.
    """

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

    def read(self, src_slots: torch.Tensor, dst_slots: torch.Tensor, last: bool) -> None:
        """One read of a completed send: ``copy_kv``, through ``copy_hook`` when set."""
        self.read_tokens += int(src_slots.numel())
        if self.copy_hook is None:
            self.copy_kv(src_slots, dst_slots, last)
            return
        nbytes = int(src_slots.numel()) * self.src_pool.get_size_per_token()
        self.copy_hook(nbytes, lambda: self.copy_kv(src_slots, dst_slots, last))

    def copy_kv(self, src_slots: torch.Tensor, dst_slots: torch.Tensor, wait: bool) -> None:
        """Copy the KV of prefill-pool slots ``src_slots`` into decode-pool slots ``dst_slots``
        (int64, same length; every layer's buffers, MHA or MLA) with the project's copy ops
        (``prefill.disagg.sim_kv.copy_send``). On CUDA the copy is queued on the current
        (compute) stream, so it reads the KV after the forward that wrote it and before any
        later forward can reuse the slots; ``wait`` blocks until it finished. On CPU it is the
        direct op, which returns when the bytes are there. A device-to-device copy standing in
        for a network transfer gets the whole GPU (``copy_block_quota``), not HiCache's 2
        blocks: a GB through 2 blocks would hold the compute stream for an estimated tens of
        ms, charged to every later forward."""
        copy_send(self.src_pool, self.pool, src_slots, dst_slots,
                  block_quota=self.copy_block_quota, wait=wait)  # fmt: skip

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

    def received_kv(self, rid: str) -> tuple[Any, ...]:
        """``(decode_prefix_len, *kv)``: what decode holds for the tokens prefill sent, ``kv``
        one ``[L, n - decode_prefix_len, ...]`` tensor per pool buffer (``sim_kv.read_kv``: MHA
        ``k, v`` ``[L, n', H, D]``; MLA the latent ``[L, n', 1, C]``). Valid after ``Success``,
        until ``release(rid)``."""
        peer = self.peers.get(rid)
        if peer is None or peer.state != KVPoll.Success or peer.decode_slots is None:
            state = "released" if peer is None else peer.state.name
            raise ValueError(f"rid {rid!r} has no received KV ({state})")
        slots = peer.decode_slots[: peer.num_tokens - peer.decode_prefix_len]
        return (peer.decode_prefix_len, *read_kv(self.pool, slots))
