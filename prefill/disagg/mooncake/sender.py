"""The prefill side of the Mooncake transport (SGLang's prefill ``MooncakeKVManager``), speaking
SGLang 0.5.23's wire: the bootstrap endpoint (this rank registers itself with ``PUT /route``), the
ZMQ control socket, one ``SessionWorker`` per decode session, non-blocking STATUS / ABORT_ACK
pushes, and every bootstrap room's state, all under ``lock``. Invariants: ``Failed`` is terminal,
otherwise a room's state only moves up; a room's prefill slots stay owned while ``outstanding``
is not 0; a room whose call failed is poisoned and never acked. Against a hostile peer: a
REGISTER never rewrites a live session registered from another endpoint; sessions are capped
and idle ones dropped; replies go only to endpoints a REGISTER named. See docs/DESIGN.md
section 12."""

from __future__ import annotations

import logging
import struct
import threading
import time
from collections import OrderedDict, deque
from dataclasses import dataclass, field

import zmq

from hicache_prefill.hicache.memory.allocator import page_ceil
from hicache_prefill.hicache.memory.device_pool import KVPool
from hicache_prefill.prefill.disagg.mooncake.bootstrap import (
    BootstrapServer,
    BootstrapUnreachable,
    http,
)
from hicache_prefill.prefill.disagg.mooncake.channel import Listener, Pusher
from hicache_prefill.prefill.disagg.mooncake.layout import (
    KVGeometry,
    MetadataBuffers,
    layer_buffers,
    pool_region,
)
from hicache_prefill.prefill.disagg.mooncake.session_worker import (
    Job,
    SessionWorker,
    SourceMemory,
    TransferHook,
)
from hicache_prefill.prefill.disagg.mooncake.wire import (
    Abort,
    AbortAck,
    ControlMessageError,
    Meta,
    Register,
    Status,
    parse_to_prefill,
)
from hicache_prefill.prefill.disagg.protocol import KVPoll

logger = logging.getLogger(__name__)

POISONED_MEMORY = 4096  # poisoned rooms remembered once dropped (a late ABORT is never acked)
PREFILL_RANK = 0  # SGLang's prefill unique rank of a TP1 / CP1 / PP1 instance


@dataclass(frozen=True)
class ControlLimits:
    """What the control plane of a prefill rank holds at most. Sessions: how many decode
    sessions it keeps, and when one is dropped. A session is
    *proven* once a transfer to it succeeded (a Mooncake engine with those buffers answered);
    proven sessions are never evicted for newcomers (SGLang's decode registers once and relies
    on it), unproven ones are capped at ``max_unproven`` (the least recently used idle one
    makes room) and dropped after ``unproven_idle_s`` without rooms; a blacklisted session
    without rooms after ``dead_s``. A worker's thread and engine end after ``engine_idle_s``
    without a job (they restart with the next). Messages: ``max_message_bytes`` a frame (ZMQ's
    ``MAXMSGSIZE``), ``max_connections`` TCP connections to the control socket. Bootstrap
    endpoint: ``bootstrap_threads`` requests in service, each at most ``bootstrap_timeout_s``.
    A registered decode's META for a room this rank has not created yet (the router reached
    decode first) waits at most ``early_meta_s``, ``early_metas`` of them."""

    max_sessions: int = 1024
    max_unproven: int = 64
    unproven_idle_s: float = 300.0
    dead_s: float = 600.0
    engine_idle_s: float = 60.0
    max_message_bytes: int = 8 << 20
    max_connections: int = 256
    bootstrap_threads: int = 16
    bootstrap_timeout_s: float = 5.0
    early_metas: int = 4096
    early_meta_s: float = 60.0


@dataclass(eq=False)
class Room:
    room: int
    rid: str
    num_tokens: int
    status: KVPoll = KVPoll.Bootstrapping
    failure: str | None = None
    timed_out: bool = False
    meta: Meta | None = None
    outstanding: int = 0
    jobs: int = 0
    poisoned: bool = False
    ack_targets: dict[tuple[str, int], int] = field(default_factory=dict)

    @property
    def endpoint(self) -> tuple[str, int] | None:
        return None if self.meta is None else (self.meta.decode_ip, self.meta.decode_port)


@dataclass(eq=False)
class Session:
    """A registered decode session: its REGISTER, the control endpoint it came from, its worker."""

    reg: Register
    worker: SessionWorker
    registered_at: float
    proven: bool = False

    @property
    def endpoint(self) -> tuple[str, int]:
        return self.reg.decode_ip, self.reg.decode_port


class PrefillTransport:
    """Bootstrap endpoint, control plane and session workers of one prefill rank; ``pool`` and
    ``aux`` are registered whole with every session's engine; ``secret``: the opt-in shared
    secret (``channel``), ``None`` for SGLang's unauthenticated plane. ``ValueError`` for a
    bootstrap port in use or a pool on a CUDA device (the non-CUDA engine registers host memory
    only)."""

    def __init__(
        self,
        pool: KVPool,
        aux: MetadataBuffers,
        host: str,
        bootstrap_port: int,
        probe_interval_s: float = 30.0,
        hook: TransferHook | None = None,
        limits: ControlLimits | None = None,
        secret: str | None = None,
    ) -> None:
        if pool.device.type != "cpu":
            raise ValueError(
                f"--disaggregation-transfer-backend mooncake: the pool is on {pool.device}; the "
                "non-CUDA Mooncake engine registers host memory only"
            )
        self.lock = threading.RLock()
        self.pool = pool
        self.aux = aux
        self.host = host
        self.geometry = KVGeometry.from_pool(pool)
        self.page_size = pool.page_size
        self.probe_interval_s = probe_interval_s
        self.hook = hook
        self.limits = limits or ControlLimits()
        bufs = layer_buffers(pool)
        self.source = SourceMemory(
            layer_ptrs=tuple(b.data_ptr() for b in bufs),
            item_lens=tuple(self.geometry.item_lens()),
            aux_ptrs=tuple(aux.ptrs),
            aux_row_lens=tuple(aux.row_lens),
            regions=(pool_region(pool), *aux.regions()),
        )
        self.rooms: dict[int, Room] = {}
        self.sessions: dict[str, Session] = {}
        self.rejected: dict[str, str] = {}  # session -> why its REGISTER was refused
        self._rejected_from: dict[str, tuple[str, int]] = {}  # ... and the endpoint it named
        self._poisoned: deque[int] = deque(maxlen=POISONED_MEMORY)
        self._early: OrderedDict[int, tuple[Meta, float]] = OrderedDict()  # META before its room
        self._closed_rooms: OrderedDict[int, None] = OrderedDict()  # recently concluded rooms
        self.errors: deque[str] = deque(maxlen=100)  # control-plane errors, for operators
        self.counts = {"unknown_room": 0, "refused_register": 0, "dropped_sessions": 0}
        self._pusher = Pusher(secret=secret)
        self.bootstrap = BootstrapServer(  # first: with the port in use nothing else is bound
            host,
            bootstrap_port,
            self.limits.bootstrap_threads,
            self.limits.bootstrap_timeout_s,
            secret,
        )
        try:
            self.listener = Listener(
                host,
                self._on_message,
                "mc-prefill-ctrl",
                self.limits.max_message_bytes,
                self.limits.max_connections,
                secret,
            )
        except zmq.ZMQError as e:
            self.bootstrap.close()
            raise ValueError(f"--host {host}: cannot bind the control socket ({e})") from e
        self._closed = threading.Event()
        try:
            http(
                self.bootstrap.addr,
                "/route",
                method="PUT",
                body=self.rank_registration(),
                secret=secret,
            )
        except BootstrapUnreachable:
            self.close()
            raise
        self._housekeeper = threading.Thread(target=self._housekeep, name="mc-housekeep",
                                             daemon=True)  # fmt: skip
        self._housekeeper.start()

    def rank_registration(self) -> dict[str, object]:
        """This rank's ``PUT /route`` payload (SGLang's ``register_to_bootstrap``)."""
        return {
            "attn_tp_size": 1, "attn_tp_rank": 0, "attn_cp_size": 1, "attn_cp_rank": 0,
            "attn_dp_size": 1, "attn_dp_rank": 0, "pp_size": 1, "pp_rank": 0,
            "system_dp_size": 1, "system_dp_rank": 0,
            "rank_ip": self.host, "rank_port": self.listener.port,
            "page_size": self.page_size,
            "kv_cache_dtype": self.geometry.kv_cache_dtype_str(),
            "kv_layout": None, "dsv41_spec_layout": None,
            "load_balance_method": "follow_bootstrap_room",
            "enable_dsa_cache_layer_split": False, "enable_kv_cache_sharding": False,
            "prefill_http_port": None,
            "decode_allocation_policy": "early",
        }  # fmt: skip

    def create_room(self, room: int, rid: str, num_tokens: int) -> Room:
        """A new room; a META that came first (and is not stale) is applied at once."""
        with self.lock:
            if room in self.rooms:
                raise ValueError(f"bootstrap room {room} is in use")
            r = Room(room, rid, num_tokens)
            self.rooms[room] = r
            self._closed_rooms.pop(room, None)
            early = self._early.pop(room, None)
            if early is not None and time.monotonic() - early[1] < self.limits.early_meta_s:
                self._apply_meta(r, early[0])
            return r

    def enqueue(self, r: Room, job: Job) -> bool:
        """Queue ``job`` on its session's worker; False when the room failed."""
        with self.lock:
            if r.status == KVPoll.Failed or r.meta is None:
                return False
            session = self.sessions.get(r.meta.session)
            if session is None:
                self.fail_room(r, f"decode session {r.meta.session} is not registered")
                return False
            r.outstanding += 1
            r.jobs += 1
            session.worker.put(job)
            return True

    def _push(self, endpoint: tuple[str, int] | None, frames: list[bytes]) -> None:
        """Reply to ``endpoint`` only if a REGISTER named it (never to an address a message
        for an unknown room names)."""
        if endpoint is None:
            return
        named = any(s.endpoint == endpoint for s in self.sessions.values())
        if named or endpoint in self._rejected_from.values():
            self._pusher.push(endpoint, frames)

    def fail_room(
        self,
        r: Room,
        reason: str,
        poison: bool = False,
        notify: bool = True,
        timed_out: bool = False,
    ) -> None:
        """Mark ``r`` Failed (idempotent) and tell its decode peer (STATUS Failed)."""
        with self.lock:
            r.poisoned = r.poisoned or poison
            if poison:
                self._poisoned.append(r.room)
            if r.status in (KVPoll.Failed, KVPoll.Success):
                return
            r.status = KVPoll.Failed
            r.failure = reason
            r.timed_out = timed_out
            logger.info("room %d (%s) failed: %s", r.room, r.rid, reason)
            if notify:
                self._push(r.endpoint, Status(r.room, int(KVPoll.Failed), PREFILL_RANK).to_frames())
            self._maybe_drop(r)

    def _maybe_drop(self, r: Room) -> None:
        """Forget a finished room once nothing is outstanding and every ABORT was answered (a
        poisoned room's never is)."""
        if r.status not in (KVPoll.Success, KVPoll.Failed) or r.outstanding:
            return
        self._maybe_ack(r)
        if r.poisoned:
            r.ack_targets.clear()
        if not r.ack_targets and self.rooms.get(r.room) is r:
            del self.rooms[r.room]
            self._closed_rooms[r.room] = None
            while len(self._closed_rooms) > POISONED_MEMORY:
                self._closed_rooms.popitem(last=False)

    def _maybe_ack(self, r: Room) -> None:
        if r.outstanding == 0 and not r.poisoned and r.ack_targets:
            for endpoint, generation in r.ack_targets.items():
                self._push(endpoint, AbortAck(r.room, PREFILL_RANK, generation).to_frames())
            r.ack_targets.clear()

    def room_failed(self, room: int) -> bool:
        with self.lock:
            r = self.rooms.get(room)
            return r is None or r.status == KVPoll.Failed

    def _on_done(self, job: Job, rc: int | None) -> None:
        with self.lock:
            r = self.rooms.get(job.room)
            if r is None:
                logger.error("job of unknown room %d finished (rc %s)", job.room, rc)
                return
            r.outstanding -= 1
            session = self.sessions.get(r.meta.session) if r.meta is not None else None
            worker = session.worker if session is not None else None
            if rc is not None and rc != 0:
                why = (worker.blacklisted if worker is not None else None) or (
                    f"batch_transfer_sync_write rc={rc}"
                )
                if worker is not None:
                    worker.blacklist(f"a call for room {r.room} returned rc={rc}")
                self.fail_room(
                    r,
                    f"KV transfer of chunk {job.index} to decode session "
                    f"{r.meta.session if r.meta else '?'} failed ({why})",
                    poison=True,
                )
            elif rc == 0 and session is not None:
                session.proven = True
            if rc == 0 and job.last and r.status != KVPoll.Failed:
                r.status = KVPoll.Success
                self._push(
                    r.endpoint, Status(r.room, int(KVPoll.Success), PREFILL_RANK).to_frames()
                )
            self._maybe_drop(r)

    def _on_message(self, frames: list[bytes]) -> None:
        try:
            msg = parse_to_prefill(frames)
            if isinstance(msg, Register):
                self._on_register(msg)
            elif isinstance(msg, Meta):
                self._on_meta(msg)
            else:
                self._on_abort(msg)
        except ControlMessageError as e:
            self.errors.append(str(e))
            raise

    def _register_problem(self, reg: Register) -> str | None:
        """Why this rank cannot serve a decode rank that registered ``reg``."""
        mine = self.source.item_lens
        if tuple(reg.kv_item_lens) != mine:
            return (
                f"another KV geometry: it registered {len(reg.kv_item_lens)} KV buffers of "
                f"{sorted(set(reg.kv_item_lens))} bytes a page, this prefill has {len(mine)} of "
                f"{sorted(set(mine))} ({self.geometry.kind}, {self.geometry.layer_num} layers, "
                f"page {self.page_size}, {self.geometry.dtype})"
            )
        if reg.attn_tp_size != 1:
            return (
                f"attention TP {reg.attn_tp_size} (this prefill serves decode ranks of attention "
                "TP 1, as its own)"
            )
        if reg.dcp_size != 1 or reg.staging_base or reg.staging_size:
            return "decode context parallelism or a staging buffer (not served)"
        if reg.state_ptrs not in (b"", struct.pack("<I", 0)) or reg.kv_layer_ids:
            return "state buffers or layer ids of a hybrid model (not served)"
        n_aux = len(reg.aux_ptrs)
        if n_aux not in (len(self.source.aux_ptrs), len(self.source.aux_ptrs) + 1):
            return (
                f"{n_aux} metadata buffers, this prefill has {len(self.source.aux_ptrs)} (SGLang's "
                "defaults; a decode's sampling mask or DSA top-k buffer shifts them)"
            )
        return None

    def _on_register(self, reg: Register) -> None:
        problem = self._register_problem(reg)
        now = time.monotonic()
        with self.lock:
            old = self.sessions.get(reg.session)
            if problem is not None:
                why = f"decode session {reg.session} has {problem}"
                if old is not None:  # never let a bad REGISTER touch a live session
                    raise ControlMessageError(f"REGISTER for live session refused: {why}")
                logger.error("REGISTER refused: %s", why)
                self.errors.append(why)
                self.counts["refused_register"] += 1
                if len(self.rejected) < 4 * self.limits.max_unproven:
                    self.rejected[reg.session] = why
                    self._rejected_from[reg.session] = (reg.decode_ip, reg.decode_port)
                return
            if old is not None:
                if old.reg == reg:  # SGLang: a new REGISTER clears the blacklist
                    old.worker.unblacklist()
                    return
                if not self._replaceable(old):
                    self.counts["refused_register"] += 1
                    raise ControlMessageError(
                        f"REGISTER for live decode session {reg.session} (registered from "
                        f"{old.endpoint[0]}:{old.endpoint[1]}) refused: only a blacklisted, "
                        "idle session is replaced"
                    )
                self._drop_session(reg.session)
            self._drop_idle_sessions(now, make_room=True)
            unproven = sum(not x.proven for x in self.sessions.values())
            if len(self.sessions) >= self.limits.max_sessions or (
                unproven >= self.limits.max_unproven
            ):
                self.counts["refused_register"] += 1
                raise ControlMessageError(
                    f"REGISTER from {reg.session} refused: {len(self.sessions)} decode sessions "
                    f"are registered, {unproven} not yet used, none idle (the limits)"
                )
            self.rejected.pop(reg.session, None)
            self._rejected_from.pop(reg.session, None)
            worker = SessionWorker(
                reg,
                self.source,
                self.host,
                self.room_failed,
                self._on_done,
                self.hook,
                self.probe_interval_s,
                idle_s=self.limits.engine_idle_s,
            )
            self.sessions[reg.session] = Session(reg, worker, now)

    def _busy_sessions(self) -> set[str]:
        return {
            r.meta.session
            for r in self.rooms.values()
            if r.meta is not None
            and (r.outstanding or r.status not in (KVPoll.Success, KVPoll.Failed))
        }

    def _replaceable(self, s: Session) -> bool:
        return (
            s.worker.blacklisted is not None
            and s.worker.pending == 0
            and s.reg.session not in self._busy_sessions()
        )

    def _drop_session(self, session: str) -> None:
        s = self.sessions.pop(session)
        self.counts["dropped_sessions"] += 1
        if not s.worker.close(timeout_s=0.1):
            logger.warning("decode session %s: its worker is still in a call", session)
        self._pusher.forget(s.endpoint)

    def _drop_idle_sessions(self, now: float, make_room: bool = False) -> None:
        """Drop sessions without rooms or jobs: blacklisted ones after ``dead_s``, unproven ones
        after ``unproven_idle_s``; with ``make_room`` (a REGISTER at a limit) the least recently
        used idle unproven one."""
        busy = self._busy_sessions()
        idle = [
            s for name, s in self.sessions.items()
            if name not in busy and s.worker.pending == 0
        ]  # fmt: skip
        lim = self.limits
        for s in idle:
            used = now - max(s.worker.last_used, s.registered_at)
            if (s.worker.blacklisted and used >= lim.dead_s) or (
                not s.proven and used >= lim.unproven_idle_s
            ):
                logger.info("dropping idle decode session %s", s.reg.session)
                self._drop_session(s.reg.session)
        unproven = [s for s in idle if not s.proven and s.reg.session in self.sessions]
        full = len(self.sessions) >= lim.max_sessions
        if make_room and unproven and (full or len(unproven) >= lim.max_unproven):
            lru = min(unproven, key=lambda s: max(s.worker.last_used, s.registered_at))
            self._drop_session(lru.reg.session)

    def _housekeep(self) -> None:
        while not self._closed.wait(0.5):
            with self.lock:
                now = time.monotonic()
                self._drop_idle_sessions(now)
                while self._early and (
                    now - next(iter(self._early.values()))[1] >= self.limits.early_meta_s
                ):
                    self._early.popitem(last=False)

    def _on_meta(self, meta: Meta) -> None:
        endpoint = (meta.decode_ip, meta.decode_port)
        with self.lock:
            session = self.sessions.get(meta.session)
            if session is not None and session.endpoint != endpoint:
                raise ControlMessageError(
                    f"META for room {meta.room}: session {meta.session} registered from "
                    f"{session.endpoint[0]}:{session.endpoint[1]}, not {endpoint[0]}:{endpoint[1]}"
                )
            r = self.rooms.get(meta.room)
            if r is not None:
                self._apply_meta(r, meta)
                return
            if meta.room in self._closed_rooms:  # late: concluded here (a registered endpoint)
                self._push(
                    endpoint, Status(meta.room, int(KVPoll.Failed), PREFILL_RANK).to_frames()
                )
                return
            if session is None and meta.session not in self.rejected:
                self.counts["unknown_room"] += 1  # no reply: the endpoint is only named here
                logger.warning("META for unknown room %d from an unregistered session", meta.room)
                return
            self._keep_early(meta)

    def _keep_early(self, meta: Meta) -> None:
        """A registered decode's META for a room not created yet (SGLang's prefill keeps it
        too); bounded in number and age."""
        now = time.monotonic()
        while self._early and (
            len(self._early) >= self.limits.early_metas
            or now - next(iter(self._early.values()))[1] >= self.limits.early_meta_s
        ):
            self._early.popitem(last=False)
        self._early[meta.room] = (meta, now)
        self._early.move_to_end(meta.room)

    def _apply_meta(self, r: Room, meta: Meta) -> None:
        endpoint = (meta.decode_ip, meta.decode_port)
        if r.status == KVPoll.Failed:
            self._push(endpoint, Status(meta.room, int(KVPoll.Failed), PREFILL_RANK).to_frames())
            return
        if r.status != KVPoll.Bootstrapping:
            raise ControlMessageError(f"META for room {meta.room} in state {r.status.name}")
        r.meta = meta
        problem = self._meta_problem(r, meta)
        if problem is not None:
            self.errors.append(problem)
            self.fail_room(r, problem)
            return
        r.status = KVPoll.WaitingForInput

    def _meta_problem(self, r: Room, meta: Meta) -> str | None:
        ps, dpl = self.page_size, meta.decode_prefix_len
        if meta.session in self.rejected:
            return self.rejected[meta.session]
        if meta.session not in self.sessions:
            return f"META for room {r.room} from unregistered decode session {meta.session}"
        if meta.required_dst_info_num != 1 or meta.dummy:
            return (
                f"META for room {r.room}: required_dst_info_num {meta.required_dst_info_num}"
                f"{' (dummy rank)' if meta.dummy else ''}; this prefill serves one decode rank "
                "a request"
            )
        if meta.state_indices or meta.device_pages:
            return f"META for room {r.room}: state or device page indices (not served)"
        if dpl < 0 or dpl % ps or dpl >= r.num_tokens:
            return (
                f"META for room {r.room}: decode_prefix_len {dpl} must be page-aligned "
                f"(page {ps}) and below the request's {r.num_tokens} tokens"
            )
        want = page_ceil(r.num_tokens - dpl, ps) // ps
        if len(meta.dst_pages) != want or min(meta.dst_pages) < 1:
            return (
                f"META for room {r.room}: {len(meta.dst_pages)} destination pages (ids >= 1)"
                f" for {r.num_tokens - dpl} tokens, expected {want}"
            )
        if meta.dst_aux_index < 0:
            return f"META for room {r.room}: metadata row {meta.dst_aux_index}"
        return None

    def _on_abort(self, abort: Abort) -> None:
        endpoint = abort.endpoint
        with self.lock:
            r = self.rooms.get(abort.room)
            if r is None:
                if abort.room not in self._poisoned and abort.generation is not None:
                    self._push(endpoint, AbortAck(abort.room, PREFILL_RANK,
                                                  abort.generation).to_frames())  # fmt: skip
                return
            if r.status not in (KVPoll.Success, KVPoll.Failed):
                self.fail_room(r, "the decode side aborted the request", notify=False)
            if endpoint is not None and abort.generation is not None and not r.poisoned:
                if any(s.endpoint == endpoint for s in self.sessions.values()):
                    r.ack_targets[endpoint] = abort.generation
            self._maybe_ack(r)
            self._maybe_drop(r)

    def check_integrity(self) -> None:
        """``AssertionError`` naming what is off: every room's outstanding jobs are the queued or
        running jobs of its session, the tables within their limits."""
        with self.lock:
            per_session: dict[str, int] = {}
            for r in self.rooms.values():
                assert r.outstanding >= 0, f"room {r.room}: {r.outstanding} outstanding"
                if r.outstanding:
                    assert r.meta is not None, f"room {r.room}: jobs without a META"
                    per_session[r.meta.session] = per_session.get(r.meta.session, 0) + r.outstanding
                if r.status == KVPoll.Bootstrapping:
                    assert r.outstanding == 0, f"room {r.room}: jobs while Bootstrapping"
            for name, n in per_session.items():
                s = self.sessions.get(name)
                pending = s.worker.pending if s is not None else 0
                assert pending >= n, f"session {name}: {pending} jobs pending, rooms count {n}"
            lim = self.limits
            assert len(self.sessions) <= lim.max_sessions, f"{len(self.sessions)} sessions"
            unproven = sum(not s.proven for s in self.sessions.values())
            assert unproven <= lim.max_unproven, f"{unproven} unproven sessions"
            assert len(self._early) <= lim.early_metas, f"{len(self._early)} early METAs"

    def stats(self) -> dict[str, object]:
        with self.lock:
            return {
                "rooms": len(self.rooms),
                "early_metas": len(self._early),
                "outstanding": sum(r.outstanding for r in self.rooms.values()),
                "sessions": {
                    name: {
                        "blacklisted": s.worker.blacklisted,
                        "running": s.worker.running,
                        "calls": s.worker.calls,
                        "items": s.worker.items,
                        "bytes": s.worker.bytes,
                    }
                    for name, s in self.sessions.items()
                },
                "rejected": dict(self.rejected),
                "malformed_messages": self.listener.malformed,
                "refused_connections": self.listener.refused,
                "dropped_pushes": self._pusher.dropped,
                "bootstrap": self.bootstrap.stats(),
                "errors": list(self.errors),
                **self.counts,
            }

    def close(self) -> list[str]:
        """Stop listening and end every worker; the sessions whose worker a call to a frozen
        decode still blocks."""
        self._closed.set()
        self.bootstrap.close()
        self.listener.close()
        stuck = [name for name, s in self.sessions.items() if not s.worker.close()]
        self._pusher.close()
        return stuck

    def set_hook(self, hook: TransferHook | None) -> None:
        with self.lock:
            self.hook = hook
            for s in self.sessions.values():
                s.worker.hook = hook
