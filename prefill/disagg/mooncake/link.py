"""The Mooncake transport behind the executor's decode-peer protocol: ``MooncakeLink`` (SGLang's
``MooncakeKVSender``) and ``MooncakeBackend`` (the prefill rank's ``PrefillTransport`` and the
links). A request keeps one random 63-bit room across its optimistic attempts; whoever calls
``create_peer`` forwards ``link.room`` with the request to decode (SGLang's router)."""

from __future__ import annotations

import logging
import random
import threading
from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from hicache_prefill.hicache.memory.device_pool import KVPool
from hicache_prefill.hicache.storage.mooncake.availability import require_loopback_engines
from hicache_prefill.prefill.disagg.mooncake.channel import secret_from_env
from hicache_prefill.prefill.disagg.mooncake.layout import MetadataBuffers
from hicache_prefill.prefill.disagg.mooncake.sender import ControlLimits, PrefillTransport, Room
from hicache_prefill.prefill.disagg.mooncake.session_worker import Job, TransferHook
from hicache_prefill.prefill.disagg.protocol import (
    BOOTSTRAP_TIMEOUT_ENV,
    TERMINAL,
    KVPoll,
    MetadataRow,
    SendRecord,
    bootstrap_timeout_from_env,
    check_new_link,
    finalize,
    force_not_ready_prob,
    positive_env,
    send_allowed,
)

logger = logging.getLogger(__name__)

DEFAULT_POLL_INTERVAL_S = 0.001  # how often the executor's idle wait looks at live links again
PROBE_INTERVAL_ENV = "SGLANG_FAILED_SESSION_PROBE_INTERVAL_S"


@dataclass(frozen=True)
class MooncakeConfig:
    """Settings of the prefill side's transport (defaults as SGLang's)."""

    host: str = "127.0.0.1"
    bootstrap_port: int = 8998
    bootstrap_timeout_s: float = 300.0
    poll_interval_s: float = DEFAULT_POLL_INTERVAL_S
    probe_interval_s: float = 30.0
    force_not_ready_prob: float = 0.0
    limits: ControlLimits = ControlLimits()
    secret: str | None = None  # HICACHE_PD_SHARED_SECRET: opt-in, not SGLang's wire

    @classmethod
    def from_server_args(cls, args: Any) -> MooncakeConfig:
        return cls(
            host=str(getattr(args, "host", "127.0.0.1")),
            bootstrap_port=int(getattr(args, "disaggregation_bootstrap_port", 8998)),
            bootstrap_timeout_s=bootstrap_timeout_from_env(),
            probe_interval_s=positive_env(PROBE_INTERVAL_ENV, 30.0),
            force_not_ready_prob=force_not_ready_prob(args),
            secret=secret_from_env(),
        )


class MooncakeLink:
    def __init__(
        self, backend: MooncakeBackend, room: Room, token_ids: Sequence[int] | None
    ) -> None:
        self.backend = backend
        self._room = room
        self.rid = room.rid
        self.room = room.room
        self.num_tokens = room.num_tokens
        self.token_ids = list(token_ids) if token_ids is not None else None
        self.created_at = backend.clock.now()
        self.finalized_attempt: int | None = None
        self.sent_end = 0
        self._chunks = 0

    @property
    def decode_prefix_len(self) -> int:
        meta = self._room.meta
        return meta.decode_prefix_len if meta is not None else 0

    @property
    def failure(self) -> str | None:
        return self._room.failure

    @property
    def timed_out(self) -> bool:
        return self._room.timed_out

    def poll(self) -> KVPoll:
        r, t = self._room, self.backend
        with t.transport.lock:
            if r.status == KVPoll.Bootstrapping:
                waited = t.clock.now() - self.created_at
                if waited >= t.config.bootstrap_timeout_s:
                    t.transport.fail_room(
                        r,
                        f"timed out after {waited:.1f}s in KVPoll.Bootstrapping "
                        f"({BOOTSTRAP_TIMEOUT_ENV}={t.config.bootstrap_timeout_s:g})",
                        timed_out=True,
                    )
            if r.status in TERMINAL and r.outstanding == 0:
                t.unwatch(self)  # the executor has seen the end: no event ahead
            return r.status

    def init(self, attempt: int) -> None:
        finalize(self, attempt)
        self.sent_end = self.decode_prefix_len

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
        ps = self.backend.page_size
        if last != (end == self.num_tokens) or (not last and end % ps):
            raise ValueError(
                f"{self.rid}: send [{start}, {end}) last={last}: a non-last send "
                f"ends on a page boundary (page {ps}), the last at "
                f"{self.num_tokens}"
            )
        if last and metadata is None:
            raise ValueError(f"{self.rid}: the last send carries the metadata row")
        firsts = src_slots[::ps].to("cpu", torch.int64).numpy()
        if np.any(firsts % ps):
            raise ValueError(f"{self.rid}: src_slots of [{start}, {end}) are not whole pages")
        src_pages = firsts // ps
        lo = (start - self.decode_prefix_len) // ps
        meta = self._room.meta
        assert meta is not None
        dst_pages = np.asarray(meta.dst_pages[lo : lo + len(src_pages)], dtype=np.int64)
        job = Job(self.room, self.rid, self._chunks, src_pages, dst_pages, last)
        if last:
            assert metadata is not None
            m = metadata
            self.backend.aux.set_row(
                m.index,
                m.first_token,
                m.cached_tokens,
                self.room,
                (m.cached_device, m.cached_host, m.cached_storage),
            )
            job.aux_index, job.dst_aux_index = metadata.index, meta.dst_aux_index
        if not self.backend.transport.enqueue(self._room, job):
            return False
        self._chunks += 1
        self.sent_end = end
        self.backend.record_send(
            SendRecord(self.rid, attempt, start, end, self.backend.clock.now(), last)
        )
        return True

    def inflight_reads(self) -> int:
        with self.backend.transport.lock:
            if self._room.status in TERMINAL and self._room.outstanding == 0:
                self.backend.unwatch(self)
            return self._room.outstanding

    def next_event_time(self) -> float | None:
        if self.live or self.inflight_reads():
            return self.backend.clock.now() + self.backend.config.poll_interval_s
        return None

    def fail(self, reason: str) -> None:
        self.backend.transport.fail_room(self._room, reason)

    @property
    def live(self) -> bool:
        return self._room.status not in TERMINAL


class MooncakeBackend:
    """The prefill rank's Mooncake transport as a ``DecodeBackend``, on a wall clock and a host
    memory pool. ``metadata_size``: the executor's metadata rows; ``keep_token_ids``: links
    keep their prompt. Raises ``ValueError`` (bootstrap port in use, virtual clock, CUDA pool)
    and ``RuntimeError`` (a loopback host without the loopback shim)."""

    def __init__(
        self,
        pool: KVPool,
        clock: Any,
        config: MooncakeConfig,
        metadata_size: int,
        keep_token_ids: bool = True,
        send_log_size: int | None = 10_000,
        hook: TransferHook | None = None,
    ) -> None:
        if getattr(clock, "is_virtual", False):
            raise ValueError(
                "--disaggregation-transfer-backend mooncake runs on the wall clock, "
                "not a virtual one"
            )
        require_loopback_engines(config.host)
        self.clock = clock
        self.config = config
        self.page_size = pool.page_size
        self.aux = MetadataBuffers(metadata_size)
        self.transport = PrefillTransport(
            pool,
            self.aux,
            config.host,
            config.bootstrap_port,
            config.probe_interval_s,
            hook,
            config.limits,
            config.secret,
        )
        self.keep_token_ids = keep_token_ids
        self.peers: dict[str, MooncakeLink] = {}
        self.send_log: deque[SendRecord] = deque(maxlen=send_log_size)
        self._rng = random.Random()
        self._log_lock = threading.Lock()
        self._watch: set[MooncakeLink] = set()  # links whose end the executor has not seen

    @property
    def force_not_ready_prob(self) -> float:
        return self.config.force_not_ready_prob

    @property
    def bootstrap_addr(self) -> str:
        """``host:port`` of the bootstrap endpoint (a request carries it to decode)."""
        return self.transport.bootstrap.addr

    def create_peer(
        self, rid: str, num_tokens: int, token_ids: Sequence[int] | None = None
    ) -> MooncakeLink:
        check_new_link(self.peers.get(rid), rid, num_tokens, token_ids)
        while True:
            room = self._rng.getrandbits(63) or 1
            try:
                r = self.transport.create_room(room, rid, num_tokens)
                break
            except ValueError:
                continue
        link = MooncakeLink(self, r, token_ids if self.keep_token_ids else None)
        self.peers[rid] = link
        with self.transport.lock:
            self._watch.add(link)
        return link

    def next_event_time(self) -> float | None:
        """``now + poll_interval`` while a link may change unseen by the executor."""
        with self.transport.lock:
            busy = bool(self._watch)
        return self.clock.now() + self.config.poll_interval_s if busy else None

    def unwatch(self, link: MooncakeLink) -> None:
        """``link`` ended and the executor saw it; without ``keep_token_ids`` it is forgotten."""
        self._watch.discard(link)
        if not self.keep_token_ids and self.peers.get(link.rid) is link:
            del self.peers[link.rid]

    def release(self, rid: str) -> None:
        link = self.peers.pop(rid, None)
        if link is not None:
            with self.transport.lock:
                self._watch.discard(link)

    def record_send(self, rec: SendRecord) -> None:
        with self._log_lock:
            self.send_log.append(rec)

    def set_hook(self, hook: TransferHook | None) -> None:
        self.transport.set_hook(hook)

    def close(self) -> list[str]:
        return self.transport.close()
