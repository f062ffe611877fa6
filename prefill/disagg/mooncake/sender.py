"""The prefill side of the Mooncake transport (SGLang's prefill ``MooncakeKVManager``): the
bootstrap endpoint, the control listener, one ``SessionWorker`` per decode session, a notifier
that pushes STATUS / ABORT_ACK, and every bootstrap room's state, all under ``lock``.
Invariants: ``Failed`` is terminal, otherwise a room's state only moves up; a room's prefill
slots stay owned while ``outstanding`` (its jobs queued or running) is not 0; a room whose call
failed is poisoned and never acked. See docs/DESIGN.md section 12."""

from __future__ import annotations

import logging
import queue
import threading
import time
from collections import deque
from dataclasses import dataclass, field

from hicache_prefill.hicache.memory.allocator import page_ceil
from hicache_prefill.hicache.memory.device_pool import KVPool
from hicache_prefill.prefill.disagg.mooncake.bootstrap import BootstrapServer
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
    Listener,
    Meta,
    Pusher,
    Register,
    Status,
    parse_to_prefill,
)
from hicache_prefill.prefill.disagg.protocol import KVPoll

logger = logging.getLogger(__name__)

SESSION_IDLE_S = 600.0  # a blacklisted session unused this long is dropped (SGLang's idle timeout)
POISONED_MEMORY = 4096  # poisoned rooms remembered once dropped (a late ABORT is never acked)


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
    ack_targets: list[tuple[str, int]] = field(default_factory=list)

    @property
    def endpoint(self) -> tuple[str, int] | None:
        return None if self.meta is None else (self.meta.decode_ip, self.meta.decode_port)


class PrefillTransport:
    """Bootstrap endpoint, control plane and session workers of one prefill rank; ``pool`` and
    ``aux`` are registered whole with every session's engine. ``ValueError`` for a bootstrap
    port in use or a pool on a CUDA device (the non-CUDA engine registers host memory only)."""

    def __init__(
        self,
        pool: KVPool,
        aux: MetadataBuffers,
        host: str,
        bootstrap_port: int,
        probe_interval_s: float = 30.0,
        hook: TransferHook | None = None,
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
        bufs = layer_buffers(pool)
        self.source = SourceMemory(
            layer_ptrs=tuple(b.data_ptr() for b in bufs),
            item_lens=tuple(self.geometry.item_lens()),
            aux_ptrs=tuple(aux.ptrs),
            aux_row_lens=tuple(aux.row_lens),
            regions=(pool_region(pool), *aux.regions()),
        )
        self.rooms: dict[int, Room] = {}
        self.sessions: dict[str, SessionWorker] = {}
        self.rejected: dict[str, str] = {}  # session -> why its REGISTER was refused
        self._poisoned: deque[int] = deque(maxlen=POISONED_MEMORY)
        self.errors: deque[str] = deque(maxlen=100)  # control-plane errors, for operators
        self._pusher = Pusher()
        self._notify: queue.Queue[tuple[tuple[str, int], list[bytes]] | None] = queue.Queue()
        self._notifier = threading.Thread(target=self._push_loop, name="mc-notify", daemon=True)
        self._notifier.start()
        self.listener = Listener(host, self._on_message, "mc-prefill-ctrl")
        server_info = {
            "attn_tp_size": 1,
            "attn_cp_size": 1,
            "dp_size": 1,
            "pp_size": 1,
            "page_size": self.page_size,
            "kv_cache_dtype": self.geometry.dtype,
            "follow_bootstrap_room": True,
            "decode_allocation_policy": "early",
            "kv_geometry": self.geometry.to_json(),
        }
        try:
            self.bootstrap = BootstrapServer(
                host,
                bootstrap_port,
                server_info,
                {"rank_ip": host, "rank_port": self.listener.port},
            )
        except ValueError:
            self.listener.close()
            self._notify.put(None)
            raise

    def create_room(self, room: int, rid: str, num_tokens: int) -> Room:
        with self.lock:
            if room in self.rooms:
                raise ValueError(f"bootstrap room {room} is in use")
            r = Room(room, rid, num_tokens)
            self.rooms[room] = r
            return r

    def enqueue(self, r: Room, job: Job) -> bool:
        """Queue ``job`` on its session's worker; False when the room failed."""
        with self.lock:
            if r.status == KVPoll.Failed or r.meta is None:
                return False
            worker = self.sessions.get(r.meta.session)
            if worker is None:
                self.fail_room(r, f"decode session {r.meta.session} is not registered")
                return False
            r.outstanding += 1
            r.jobs += 1
            worker.put(job)
            return True

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
            if notify and r.endpoint is not None:
                self._notify.put((r.endpoint, Status(r.room, int(KVPoll.Failed)).to_frames()))
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

    def _maybe_ack(self, r: Room) -> None:
        if r.outstanding == 0 and not r.poisoned and r.ack_targets:
            for endpoint in r.ack_targets:
                self._notify.put((endpoint, AbortAck(r.room).to_frames()))
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
            worker = self.sessions.get(r.meta.session) if r.meta is not None else None
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
            elif rc == 0 and job.last and r.status != KVPoll.Failed:
                r.status = KVPoll.Success
                if r.endpoint is not None:
                    self._notify.put((r.endpoint, Status(r.room, int(KVPoll.Success)).to_frames()))
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

    def _on_register(self, reg: Register) -> None:
        try:
            theirs = KVGeometry.from_json(reg.geometry)
        except ValueError as e:
            raise ControlMessageError(f"REGISTER from {reg.session}: {e}") from None
        diff = self.geometry.mismatches(theirs)
        if not diff and tuple(reg.kv_item_lens) != self.source.item_lens:
            diff = [f"kv_item_lens: {self.source.item_lens} vs {reg.kv_item_lens}"]
        with self.lock:
            if diff:
                why = f"decode session {reg.session} has another KV geometry: {'; '.join(diff)}"
                logger.error("REGISTER refused: %s", why)
                self.errors.append(why)
                self.rejected[reg.session] = why
                return
            self.rejected.pop(reg.session, None)
            worker = self.sessions.get(reg.session)
            if worker is not None:  # a new REGISTER clears the blacklist (SGLang)
                worker.reg = reg
                worker.unblacklist()
                return
            self._drop_idle_sessions()
            self.sessions[reg.session] = SessionWorker(
                reg,
                self.source,
                self.host,
                self.room_failed,
                self._on_done,
                self.hook,
                self.probe_interval_s,
            )

    def _drop_idle_sessions(self) -> None:
        now = time.monotonic()
        busy = {r.meta.session for r in self.rooms.values() if r.meta is not None}
        for session, w in list(self.sessions.items()):
            if w.blacklisted and session not in busy and now - w.last_used > SESSION_IDLE_S:
                if w.close(timeout_s=0.1):
                    del self.sessions[session]
                    logger.info("dropped blacklisted decode session %s (idle)", session)

    def _on_meta(self, meta: Meta) -> None:
        endpoint = (meta.decode_ip, meta.decode_port)
        with self.lock:
            r = self.rooms.get(meta.room)
            if r is None or r.status == KVPoll.Failed:
                self._notify.put((endpoint, Status(meta.room, int(KVPoll.Failed)).to_frames()))
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
        if meta.required_dst_info_num != 1:
            return f"META for room {r.room}: required_dst_info_num {meta.required_dst_info_num}"
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
        return None

    def _on_abort(self, abort: Abort) -> None:
        endpoint = (abort.decode_ip, abort.decode_port)
        with self.lock:
            r = self.rooms.get(abort.room)
            if r is None:
                if abort.room not in self._poisoned:
                    self._notify.put((endpoint, AbortAck(abort.room).to_frames()))
                return
            if r.status not in (KVPoll.Success, KVPoll.Failed):
                self.fail_room(r, "the decode side aborted the request", notify=False)
            r.ack_targets.append(endpoint)
            self._maybe_ack(r)
            self._maybe_drop(r)

    def _push_loop(self) -> None:
        while True:
            item = self._notify.get()
            if item is None:
                return
            endpoint, frames = item
            self._pusher.push(endpoint, frames)

    def stats(self) -> dict[str, object]:
        with self.lock:
            return {
                "rooms": len(self.rooms),
                "outstanding": sum(r.outstanding for r in self.rooms.values()),
                "sessions": {
                    s: {
                        "blacklisted": w.blacklisted,
                        "calls": w.calls,
                        "items": w.items,
                        "bytes": w.bytes,
                    }
                    for s, w in self.sessions.items()
                },
                "rejected": dict(self.rejected),
                "malformed_messages": self.listener.malformed,
                "errors": list(self.errors),
            }

    def close(self) -> list[str]:
        """Stop listening and end every worker; the sessions whose worker a call to a frozen
        decode still blocks."""

        self.bootstrap.close()
        self.listener.close()
        stuck = [s for s, w in self.sessions.items() if not w.close()]
        self._notify.put(None)
        self._notifier.join(timeout=5)
        self._pusher.close()
        return stuck

    def set_hook(self, hook: TransferHook | None) -> None:
        with self.lock:
            self.hook = hook
            for w in self.sessions.values():
                w.hook = hook
