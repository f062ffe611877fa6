"""The decode side of the Mooncake transport (SGLang's decode ``MooncakeKVManager``) on SGLang
0.5.23's wire, run by the decode worker process; passive on the data plane. Its pool has its
own geometry (a decode's model); it checks a prefill's page size, KV dtype and policy from
``PrefillServerInfo``, the prefill checks its per-layer item lengths from REGISTER. A request
failed after META keeps its pages and row until ABORT_ACK or the deferred-release timeout, so a
failed call's late bytes never land in another request's pages. ``check_free_pages`` poisons
freed pages and counts writes into them (``late_writes``). See docs/DESIGN.md section 12."""

from __future__ import annotations

import logging
import threading
import time
from dataclasses import dataclass
from typing import Any

import torch

from hicache_prefill.hicache.memory.allocator import TokenToKVPoolAllocator, page_ceil
from hicache_prefill.prefill.disagg.mooncake.bootstrap import (
    BootstrapUnreachable,
    fetch_route,
    healthy,
)
from hicache_prefill.prefill.disagg.mooncake.channel import Listener, Pusher, secret_from_env
from hicache_prefill.prefill.disagg.mooncake.engine import KVTransferEngine
from hicache_prefill.prefill.disagg.mooncake.layout import (
    KVGeometry,
    MetadataBuffers,
    layer_buffers,
    pool_region,
    read_pool,
)
from hicache_prefill.prefill.disagg.mooncake.wire import (
    Abort,
    AbortAck,
    Meta,
    Register,
    Status,
    parse_to_decode,
)
from hicache_prefill.prefill.disagg.protocol import TERMINAL, KVPoll, positive_env
from hicache_prefill.prefill.scheduler.admission import ReqToMetadataIdxAllocator

logger = logging.getLogger(__name__)

POISON = 0xA5
WAITING_TIMEOUT_ENV = "SGLANG_DISAGGREGATION_WAITING_TIMEOUT"
RELEASE_TIMEOUT_ENV = "SGLANG_DISAGGREGATION_DEFERRED_DECODE_KV_RELEASE_TIMEOUT"
HEARTBEAT_INTERVAL_ENV = "SGLANG_DISAGGREGATION_HEARTBEAT_INTERVAL"
HEARTBEAT_FAILURES_ENV = "SGLANG_DISAGGREGATION_HEARTBEAT_MAX_FAILURE"


SERVER_INFO_FIELDS = frozenset({
    "attn_tp_size", "attn_cp_size", "dp_size", "pp_size", "page_size", "kv_cache_dtype",
    "follow_bootstrap_room", "enable_dsa_cache_layer_split", "dsv41_spec_layout", "kv_layout",
    "decode_allocation_policy", "enable_kv_cache_sharding", "prefill_http_port",
    "target_tp_rank", "target_tp_ranks", "target_cp_ranks", "target_pp_ranks",
    "required_dst_info_num", "required_prefill_response_num",
})  # fmt: skip
"""SGLang 0.5.23's ``PrefillServerInfo`` fields: its decode refuses any other key."""


def server_info_problem(info: dict[str, Any], geometry: KVGeometry) -> str | None:
    """Why a decode rank of ``geometry`` (attention TP 1) cannot use the prefill described by
    ``info``, checked as SGLang's ``try_ensure_parallel_info`` and ``receiver.init`` do."""
    extra = sorted(set(info) - SERVER_INFO_FIELDS)
    if extra:
        return f"PrefillServerInfo has unknown fields {extra}"
    if info.get("page_size") is not None and int(info["page_size"]) != geometry.page_size:
        return f"page size mismatch: prefill {info['page_size']}, decode {geometry.page_size}"
    dtype = info.get("kv_cache_dtype")
    if dtype is not None and dtype != geometry.kv_cache_dtype_str():
        return f"KV cache dtype mismatch: prefill {dtype}, decode {geometry.kv_cache_dtype_str()}"
    if info.get("decode_allocation_policy", "early") != "early":
        return f"decode allocation policy mismatch: prefill {info['decode_allocation_policy']}"
    sizes = {k: int(info.get(k, 1)) for k in ("attn_tp_size", "attn_cp_size", "dp_size", "pp_size")}
    if any(v != 1 for v in sizes.values()):
        return f"this decode worker serves prefill instances of TP/CP/DP/PP 1, got {sizes}"
    return None


@dataclass(frozen=True)
class DecodeConfig:
    geometry: KVGeometry
    host: str = "127.0.0.1"
    pool_tokens: int = 1 << 16
    max_running_requests: int = 256
    device: str = "cpu"
    check_free_pages: bool = False
    waiting_timeout_s: float = 300.0
    release_timeout_s: float = 30.0
    heartbeat_interval_s: float = 5.0
    heartbeat_max_failures: int = 2
    tick_s: float = 0.0005
    secret: str | None = None  # HICACHE_PD_SHARED_SECRET: opt-in, not SGLang's wire

    @classmethod
    def from_env(cls, **kw: Any) -> DecodeConfig:
        return cls(
            waiting_timeout_s=positive_env(WAITING_TIMEOUT_ENV, 300, int),
            release_timeout_s=positive_env(RELEASE_TIMEOUT_ENV, 30.0),
            heartbeat_interval_s=max(positive_env(HEARTBEAT_INTERVAL_ENV, 5.0), 2.0),
            heartbeat_max_failures=int(positive_env(HEARTBEAT_FAILURES_ENV, 2, int)),
            secret=secret_from_env(),
            **kw,
        )


@dataclass(eq=False)
class DecodeRequest:
    rid: str
    room: int
    bootstrap_addr: str
    num_tokens: int
    decode_prefix_len: int
    keep: bool
    hold: bool
    not_before: float
    state: KVPoll = KVPoll.Bootstrapping
    slots: torch.Tensor | None = None
    aux_index: int = -1
    meta_sent_at: float | None = None
    failure: str | None = None
    held_until: float | None = None  # deferred release deadline while held
    acked: bool = False
    generation: int | None = None
    forget: bool = False
    first_token: int | None = None
    cached_tokens: int | None = None


@dataclass(eq=False)
class PrefillPeer:
    addr: str
    state: str = "fetching"  # fetching | ready | error
    info: dict[str, Any] | None = None
    error: str | None = None
    endpoint: tuple[str, int] | None = None
    registered: bool = False
    misses: int = 0


class DecodeReceiver:
    """The decode side's transport and request queues. Thread-safe; its threads: the scheduler
    tick, the heartbeat, the control listener, route fetches."""

    def __init__(self, cfg: DecodeConfig) -> None:
        self.cfg = cfg
        self.lock = threading.RLock()
        self.engine = KVTransferEngine(cfg.host)
        self.pusher = Pusher(secret=cfg.secret)
        self.geometry = cfg.geometry
        self.pool = cfg.geometry.make_pool(cfg.pool_tokens, cfg.device)
        self.allocator = TokenToKVPoolAllocator(cfg.pool_tokens, cfg.geometry.page_size, cfg.device)
        n_meta = 2 * cfg.max_running_requests
        self.aux = MetadataBuffers(n_meta)
        self.aux_alloc = ReqToMetadataIdxAllocator(n_meta)
        self.engine.register([pool_region(self.pool), *self.aux.regions()])
        if cfg.check_free_pages:
            ps = cfg.geometry.page_size
            self._poison(torch.arange(ps, cfg.pool_tokens + ps))
        self._generation = 0
        self.listener = Listener(cfg.host, self._on_message, "mc-decode-ctrl", secret=cfg.secret)
        self.requests: dict[str, DecodeRequest] = {}
        self.by_room: dict[int, DecodeRequest] = {}
        self.prefills: dict[str, PrefillPeer] = {}
        self.late_writes = 0
        self.counts = {"success": 0, "failed": 0, "acked_releases": 0, "timeout_releases": 0}
        self._closed = threading.Event()
        for target, name in ((self._tick_loop, "tick"), (self._heartbeat_loop, "heartbeat")):
            threading.Thread(target=target, name=f"decode-{name}", daemon=True).start()

    def add(
        self,
        rid: str,
        room: int,
        bootstrap_addr: str,
        num_tokens: int,
        decode_prefix_len: int = 0,
        keep: bool = True,
        hold: bool = False,
        delay_s: float = 0.0,
    ) -> None:
        if num_tokens < 1:
            raise ValueError(f"num_tokens must be >= 1, got {num_tokens}")
        now = time.monotonic()
        with self.lock:
            old = self.requests.get(rid)
            if old is not None and old.state not in TERMINAL:
                raise ValueError(f"rid {rid!r} is already live on this decode worker")
            if old is not None:
                self._forget(old)
            if room in self.by_room:
                raise ValueError(f"bootstrap room {room} is already in use here")
            req = DecodeRequest(
                rid,
                room,
                bootstrap_addr,
                num_tokens,
                decode_prefix_len,
                keep,
                hold,
                now + delay_s,
            )
            self.requests[rid] = req
            self.by_room[room] = req
            self._peer(bootstrap_addr)

    def unhold(self, rid: str) -> None:
        with self.lock:
            req = self.requests.get(rid)
            if req is not None:
                req.hold = False

    def abort(self, rid: str, reason: str = "aborted by the client") -> None:
        with self.lock:
            req = self.requests.get(rid)
            if req is not None and req.state not in TERMINAL:
                self._fail(req, reason)

    def release(self, rid: str) -> None:
        """Free a finished request's pages (a held one is freed when its hold ends)."""
        with self.lock:
            req = self.requests.get(rid)
            if req is None:
                return
            done = req.state == KVPoll.Failed and req.held_until is None
            if req.state == KVPoll.Success or done:
                self._free(req)
                self._forget(req)
            else:
                req.forget = True  # live or held: forgotten when it ends
                if req.state not in TERMINAL:
                    self._fail(req, "released by the driver before it finished")

    def state(self, rid: str) -> dict[str, Any]:
        with self.lock:
            req = self.requests.get(rid)
            if req is None:
                return {"state": None}
            return {
                "state": req.state.name,
                "failure": req.failure,
                "held": req.held_until is not None,
                "first_token": req.first_token,
                "room": req.room,
            }

    def received_kv(
        self, rid: str, any_state: bool = False
    ) -> tuple[int, int | None, list[torch.Tensor]]:
        """``(decode_prefix_len, first_token, buffers)`` of the sent tokens after ``Success``;
        with ``any_state`` whatever its pages hold now (a failed call's late bytes)."""
        with self.lock:
            req = self.requests.get(rid)
            ok = req is not None and (any_state or req.state == KVPoll.Success)
            if req is None or not ok or req.slots is None:
                state = "unknown" if req is None else req.state.name
                raise ValueError(f"rid {rid!r} has no received KV ({state})")
            slots = req.slots[: req.num_tokens - req.decode_prefix_len]
            return req.decode_prefix_len, req.first_token, read_pool(self.pool, slots)

    def stats(self) -> dict[str, Any]:
        with self.lock:
            self._check_all_free_pages()
            by_state: dict[str, int] = {}
            for r in self.requests.values():
                by_state[r.state.name] = by_state.get(r.state.name, 0) + 1
            held = [r for r in self.requests.values() if r.held_until is not None]
            alloc = self.allocator
            return {
                "pool_tokens": alloc.size if alloc else self.cfg.pool_tokens,
                "free_tokens": alloc.available_size() if alloc else self.cfg.pool_tokens,
                "metadata_free": self.aux_alloc.available_size(),
                "metadata_total": self.aux_alloc.size,
                "held": len(held),
                "held_tokens": sum(r.slots.numel() for r in held if r.slots is not None),
                "requests": by_state,
                "late_writes": self.late_writes,
                "geometry": self.geometry.to_json(),
                "malformed_messages": self.listener.malformed,
                "dropped_pushes": self.pusher.dropped,
                "last_control_error": self.listener.last_error,
                "session": self.engine.session_id,
                "control_port": self.listener.port,
                **self.counts,
            }

    def close(self) -> None:
        self._closed.set()
        self.listener.close()
        self.pusher.close()

    def _peer(self, addr: str) -> PrefillPeer:
        peer = self.prefills.get(addr)
        if peer is None:
            peer = self.prefills[addr] = PrefillPeer(addr)
            threading.Thread(target=self._fetch, args=(peer,), name="route", daemon=True).start()
        return peer

    def _fetch(self, peer: PrefillPeer) -> None:
        error = None
        for attempt in range(3):
            try:
                info, rank = fetch_route(peer.addr, secret=self.cfg.secret)
                break
            except BootstrapUnreachable as e:
                error = f"bootstrap endpoint {peer.addr} unreachable: {e}"
                time.sleep(0.2 * (attempt + 1))
        else:
            with self.lock:
                peer.state, peer.error = "error", error
            return
        problem = server_info_problem(info, self.geometry)
        with self.lock:
            if problem is not None:
                peer.state, peer.error = "error", f"prefill {peer.addr}: {problem}"
                logger.error("%s", peer.error)
                return
            peer.info = info
            peer.endpoint = (str(rank["rank_ip"]), int(rank["rank_port"]))
            peer.state = "ready"

    def _register(self, peer: PrefillPeer) -> bool:
        assert peer.endpoint is not None
        reg = Register(
            self.cfg.host,
            self.listener.port,
            self.engine.session_id,
            tuple(b.data_ptr() for b in layer_buffers(self.pool)),
            tuple(self.aux.ptrs),
            tuple(self.geometry.item_lens()),
        )
        peer.registered = self.pusher.push(peer.endpoint, reg.to_frames())
        return peer.registered

    def _tick_loop(self) -> None:
        while not self._closed.wait(self.cfg.tick_s):
            try:
                with self.lock:
                    self._tick(time.monotonic())
            except Exception:  # keep the worker alive; the error is in its log
                logger.exception("decode tick failed")

    def _tick(self, now: float) -> None:
        for req in list(self.requests.values()):
            if req.state == KVPoll.Bootstrapping:
                self._advance(req, now)
            elif req.state == KVPoll.WaitingForInput and req.meta_sent_at is not None:
                waited = now - req.meta_sent_at
                if waited >= self.cfg.waiting_timeout_s:
                    self._fail(
                        req,
                        f"timed out after {waited:.1f}s in KVPoll.WaitingForInput "
                        f"({WAITING_TIMEOUT_ENV}={self.cfg.waiting_timeout_s:g})",
                    )
            elif req.held_until is not None and (req.acked or now >= req.held_until):
                self.counts["acked_releases" if req.acked else "timeout_releases"] += 1
                req.held_until = None
                self._free(req)
                if req.forget:
                    self._forget(req)

    def _advance(self, req: DecodeRequest, now: float) -> None:
        peer = self.prefills.get(req.bootstrap_addr) or self._peer(req.bootstrap_addr)
        if peer.state == "fetching":
            return
        if peer.state == "error":
            self._fail(req, peer.error or "bootstrap failed")
            if not any(
                r.bootstrap_addr == peer.addr and r.state == KVPoll.Bootstrapping
                for r in self.requests.values()
            ):
                self.prefills.pop(peer.addr, None)  # a later request tries again
            return
        if not peer.registered and not self._register(peer):
            self._fail(req, f"REGISTER to prefill {peer.addr} could not be sent")
            return
        if req.hold or now < req.not_before:
            return
        ps = self.geometry.page_size
        dpl = min(req.decode_prefix_len // ps * ps, (req.num_tokens - 1) // ps * ps)
        n = page_ceil(req.num_tokens - dpl, ps)
        if self.aux_alloc.available_size() == 0 or not self.allocator.can_alloc(n):
            return  # decode is full: stay Bootstrapping, retry at the next tick
        slots = self.allocator.alloc(n)
        if slots is None:
            return
        if self.cfg.check_free_pages:
            self._check_poison(slots)
        req.slots, req.decode_prefix_len = slots, dpl
        req.aux_index = self.aux_alloc.alloc()  # type: ignore[assignment]
        self.aux.clear_row(req.aux_index)
        pages = tuple(int(p) for p in (slots[::ps] // ps).tolist())
        meta = Meta(
            req.room,
            self.cfg.host,
            self.listener.port,
            self.engine.session_id,
            pages,
            req.aux_index,
            dpl,
        )
        assert peer.endpoint is not None
        req.state, req.meta_sent_at = KVPoll.WaitingForInput, now
        if not self.pusher.push(peer.endpoint, meta.to_frames()):
            self._fail(req, f"META to prefill {peer.addr} could not be sent")

    def _on_message(self, frames: list[bytes]) -> None:
        msg = parse_to_decode(frames)
        with self.lock:
            req = self.by_room.get(msg.room)
            if req is None:
                return
            if isinstance(msg, AbortAck):
                if msg.generation is not None and msg.generation == req.generation:
                    req.acked = True  # SGLang ignores an ack of another generation
                return
            assert isinstance(msg, Status)
            if req.state != KVPoll.WaitingForInput:
                return
            if msg.status == KVPoll.Failed:
                self._fail(req, "the prefill side reported the transfer Failed")
            elif msg.status == KVPoll.Success:
                first, cached, room = self.aux.get_row(req.aux_index)
                if room != req.room:
                    self._fail(
                        req,
                        f"metadata row {req.aux_index} holds room {room}, expected "
                        f"{req.room} (stale or corrupted transfer)",
                    )
                    return
                req.state, req.first_token, req.cached_tokens = KVPoll.Success, first, cached
                self.counts["success"] += 1
                if not req.keep:
                    self._free(req)
                    self._forget(req)

    def _fail(self, req: DecodeRequest, reason: str) -> None:
        """``Failed``; pages exposed by META are held (ABORT sent) until ack or timeout."""
        if req.state in TERMINAL:
            return
        logger.info("decode request %s (room %d) failed: %s", req.rid, req.room, reason)
        req.state, req.failure = KVPoll.Failed, reason
        self.counts["failed"] += 1
        peer = self.prefills.get(req.bootstrap_addr)
        exposed = req.meta_sent_at is not None
        if peer is not None and peer.endpoint is not None:
            self._generation += 1
            req.generation = self._generation if exposed else None
            abort = Abort(req.room, self.cfg.host, self.listener.port, req.generation)
            self.pusher.push(peer.endpoint, abort.to_frames())
        if exposed:
            req.held_until = time.monotonic() + self.cfg.release_timeout_s
        else:
            self._free(req)
            if req.forget:
                self._forget(req)

    def _free(self, req: DecodeRequest) -> None:
        if req.slots is not None:
            assert self.allocator is not None
            if self.cfg.check_free_pages:
                self._poison(req.slots)
            self.allocator.free(req.slots)
            req.slots = None
        if req.aux_index >= 0:
            self.aux.clear_row(req.aux_index)
            self.aux_alloc.free(req.aux_index)
            req.aux_index = -1

    def _forget(self, req: DecodeRequest) -> None:
        if self.requests.get(req.rid) is req:
            del self.requests[req.rid]
        if self.by_room.get(req.room) is req:
            del self.by_room[req.room]

    def _heartbeat_loop(self) -> None:
        while not self._closed.wait(self.cfg.heartbeat_interval_s):
            with self.lock:
                addrs = {
                    r.bootstrap_addr for r in self.requests.values() if r.state not in TERMINAL
                }
                peers = [
                    self.prefills[a]
                    for a in addrs
                    if a in self.prefills and self.prefills[a].state == "ready"
                ]
            for peer in peers:
                ok = healthy(peer.addr, secret=self.cfg.secret)
                with self.lock:
                    peer.misses = 0 if ok else peer.misses + 1
                    if peer.misses < self.cfg.heartbeat_max_failures:
                        continue
                    logger.error("prefill %s missed %d heartbeats", peer.addr, peer.misses)
                    for r in list(self.requests.values()):
                        if r.bootstrap_addr == peer.addr:
                            self._fail(r, f"prefill {peer.addr} is unreachable (heartbeat)")
                    self.prefills.pop(peer.addr, None)

    def _poison(self, slots: torch.Tensor) -> None:
        for b in layer_buffers(self.pool):
            b.view(torch.uint8)[slots] = POISON

    def _check_poison(self, slots: torch.Tensor) -> int:
        """Count (once each) the slots of ``slots`` written since they were poisoned."""
        bad = torch.zeros(slots.numel(), dtype=torch.bool)
        for b in layer_buffers(self.pool):
            bad |= (b.view(torch.uint8)[slots] != POISON).flatten(1).any(dim=1)
        n = int(bad.sum())
        if n:
            self.late_writes += n
            logger.error("%d slots were written while free (late writes)", n)
            self._poison(slots[bad])
        return n

    def _check_all_free_pages(self) -> None:
        if not self.cfg.check_free_pages or self.allocator is None:
            return
        alloc = self.allocator
        pages = torch.cat([alloc.free_pages, *alloc.release_pages])
        if pages.numel():
            ps = alloc.page_size
            slots = (pages[:, None] * ps + torch.arange(ps)[None, :]).flatten()
            self._check_poison(slots)
