"""One Mooncake ``TransferEngine`` over TCP, as SGLang's PD transport uses it
(``distributed/device_communicators/mooncake_transfer_engine.py``): ``initialize(host,
"P2PHANDSHAKE", "tcp", "")``, a session id ``host:rpc_port``, registered memory, and only the
synchronous batch write (the asynchronous API's ids are single-use: polling one twice crashes the
process in 0.3.13).

Facts this wrapper follows (Mooncake 0.3.13.post1, measured on loopback):

- ``batch_transfer_sync_write`` returns 0 when every byte landed and -1 on any failure; more than
  about 2048 items in one call fail at once with the default queue limits, so a write is cut
  into calls of at most ``MAX_ITEMS_PER_CALL`` (1024) items;
- a call that returned -1 may still land bytes later (a frozen receiver gets the whole payload
  after it resumes), and the engine's lanes may still read the source meanwhile: "failed" never
  proves the destination untouched;
- a killed receiver fails a call within milliseconds; a frozen one after
  ``MC_TCP_PROGRESS_TIMEOUT_SEC`` / ``MC_TCP_STATUS_TIMEOUT_SEC`` (default 30 s; read when the
  engine is initialized); the first contact with a receiver frozen before its handshake blocks
  the whole engine for about 60 s whatever the environment, which is why the prefill side runs
  one engine per decode session (``session_worker``);
- only the receiver checks destination addresses (a write outside its registered regions is
  refused); the source is not checked.

Every call blocks its thread (the binding releases the GIL) and none raises: failures are return
codes, turned into ``EngineError`` only where the caller cannot go on (initialize, register).
"""

from __future__ import annotations

import logging
from collections.abc import Sequence

from hicache.storage.mooncake.availability import module_reason

logger = logging.getLogger(__name__)

MAX_ITEMS_PER_CALL = 1024
"""Items per ``batch_transfer_sync_write``: half of what the default TCP queue limits accept."""

TIMEOUT_ENV = ("MC_TCP_PROGRESS_TIMEOUT_SEC", "MC_TCP_STATUS_TIMEOUT_SEC")
"""Mooncake's timeouts for a receiver that stops making progress (seconds, default 30)."""


class EngineError(RuntimeError):
    """A Mooncake call the caller cannot go on without failed (message names it and its rc)."""


class KVTransferEngine:
    """A TCP transfer engine on ``host``. ``session_id`` is what peers pass to reach it.

    Raises ``EngineError`` when Mooncake is unavailable or ``initialize`` fails."""

    def __init__(self, host: str = "127.0.0.1") -> None:
        reason = module_reason("engine")
        if reason is not None:
            raise EngineError(reason)
        from mooncake.engine import TransferEngine

        self._te = TransferEngine()
        rc = self._te.initialize(host, "P2PHANDSHAKE", "tcp", "")
        if rc != 0:
            raise EngineError(f"TransferEngine.initialize({host!r}, P2PHANDSHAKE, tcp) rc={rc}")
        self.host = host
        self.session_id = f"{host}:{self._te.get_rpc_port()}"
        self._registered: list[int] = []

    def register(self, regions: Sequence[tuple[int, int]]) -> None:
        """Register ``(address, bytes)`` regions (duplicates and zero-length ones skipped, as
        SGLang does). ``EngineError`` names the call's rc on failure."""
        seen = set(self._registered)
        ptrs, lens = [], []
        for ptr, n in regions:
            if n > 0 and ptr not in seen:
                seen.add(ptr)
                ptrs.append(int(ptr))
                lens.append(int(n))
        if not ptrs:
            return
        rc = self._te.batch_register_memory(ptrs, lens)
        if rc != 0:
            raise EngineError(f"batch_register_memory of {len(ptrs)} regions rc={rc}")
        self._registered.extend(ptrs)

    def write(
        self,
        session: str,
        srcs: Sequence[int],
        dsts: Sequence[int],
        lens: Sequence[int],
        max_items: int = MAX_ITEMS_PER_CALL,
    ) -> int:
        """Write ``lens[i]`` bytes from local ``srcs[i]`` to ``dsts[i]`` in ``session``'s
        registered memory, in calls of at most ``max_items`` items, stopping at the first call
        that fails. Returns 0 or that call's rc. Blocks (seconds when the peer is frozen)."""
        for i in range(0, len(srcs), max_items):
            j = i + max_items
            rc = self._te.batch_transfer_sync_write(
                session, list(srcs[i:j]), list(dsts[i:j]), list(lens[i:j])
            )
            if rc != 0:
                return int(rc)
        return 0

    def probe(self, session: str) -> int:
        """``send_probe``: 0 for a live peer, negative when none listens. Does not return while
        the peer is frozen: never call it on a thread that must stay responsive."""
        return int(self._te.send_probe(session))

    def close(self) -> None:
        """Unregister the memory and drop the engine (its listeners close). No call may run on
        it any more."""
        if self._registered:
            self._te.batch_unregister_memory(self._registered)
            self._registered = []
        self._te = None
