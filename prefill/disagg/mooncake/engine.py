"""One Mooncake ``TransferEngine`` over TCP as SGLang's PD transport uses it: P2P handshake,
registered memory and the synchronous batch write. Writes block their thread and never raise
(a failed call may still land bytes later); ``EngineError`` only from initialize and register."""

from __future__ import annotations

from collections.abc import Sequence

from hicache_prefill.hicache.storage.mooncake.availability import module_reason

MAX_ITEMS_PER_CALL = 1024
"""Items per ``batch_transfer_sync_write``: half of what the default TCP queue limits accept."""


class EngineError(RuntimeError):
    """A Mooncake call the caller cannot go on without failed (message names it and its rc)."""


class KVTransferEngine:
    """A TCP transfer engine on ``host``; peers reach it by ``session_id``."""

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
        """Register ``(address, bytes)`` regions, skipping duplicates and empty ones."""
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
        """Write ``lens[i]`` bytes from ``srcs[i]`` to ``session``'s ``dsts[i]``, in calls of at
        most ``max_items`` items; 0 or the first failed call's rc."""
        for i in range(0, len(srcs), max_items):
            j = i + max_items
            rc = self._te.batch_transfer_sync_write(
                session, list(srcs[i:j]), list(dsts[i:j]), list(lens[i:j])
            )
            if rc != 0:
                return int(rc)
        return 0

    def probe(self, session: str) -> int:
        """0 for a live peer, negative when none listens; blocks while the peer is frozen."""
        return int(self._te.send_probe(session))

    def close(self) -> None:
        if self._registered:
            self._te.batch_unregister_memory(self._registered)
            self._registered = []
        self._te = None
