"""``MooncakeClient``: one process's ``MooncakeDistributedStore``, set up with clear startup
errors (``open_client``) and guarded so that nothing touches it after ``close()`` (Mooncake 0.3.13
segfaults on any call after ``close()``). Calls block their thread; return codes are results.
"""

from __future__ import annotations

import logging
import socket
import threading
import uuid
from collections.abc import Callable
from typing import Any

from hicache_prefill.hicache.storage.mooncake import availability
from hicache_prefill.hicache.storage.mooncake.config import MooncakeStoreConfig

logger = logging.getLogger(__name__)

LOCAL_BUFFER_SIZE = 16 << 20  # SGLang's constant; the zero-copy calls do not use it
MIN_SEGMENT_SIZE = 16 << 20  # ``setup`` refuses a smaller non-zero segment with -600
PROBE_TIMEOUT_S = 2.0  # ``setup`` against no master blocks for about 90 s
CLOSE_WAIT_S = 30.0

ERROR_NAMES = {
    -1: "INTERNAL_ERROR",
    -10: "BUFFER_OVERFLOW",
    -200: "NO_AVAILABLE_HANDLE",
    -600: "INVALID_PARAMS",
    -703: "REPLICA_IS_NOT_READY",
    -704: "OBJECT_NOT_FOUND",
    -705: "OBJECT_ALREADY_EXISTS",
    -706: "OBJECT_HAS_LEASE",
    -707: "LEASE_EXPIRED",
    -800: "TRANSFER_FAIL",
    -900: "RPC_FAIL",
}
HEALTHY, CLOSED, MASTER_UNREACHABLE = 0, 1, 2


def error_name(rc: object) -> str:
    """``"-704 OBJECT_NOT_FOUND"`` for a return code; ``repr`` of any other answer."""
    return f"{rc} {ERROR_NAMES.get(rc, 'UNKNOWN')}" if isinstance(rc, int) else repr(rc)


def new_distributed_store() -> Any:
    from mooncake.store import MooncakeDistributedStore

    return MooncakeDistributedStore()


def probe_master(host: str, port: int, source: str) -> None:
    try:
        socket.create_connection((host, port), timeout=PROBE_TIMEOUT_S).close()
    except OSError as e:
        raise ValueError(
            f"{source}={host}:{port}: no Mooncake master answers there ({e}); start one "
            "(Mooncake's mooncake_master command) or fix the address"
        ) from None


class MooncakeClient:
    def __init__(self, store: Any, description: str) -> None:
        self._store = store
        self.description = description
        self._lock = threading.Condition()
        self._busy = 0
        self._closed = False
        self._registered: list[int] = []

    def call(self, name: str, *args: Any) -> Any:
        """``None`` when closed or when it raised (logged)."""
        with self._lock:
            if self._closed:
                return None
            self._busy += 1
        try:
            return getattr(self._store, name)(*args)
        except Exception:  # noqa: BLE001 - a failed call is a result, never an exception
            logger.exception("Mooncake %s raised", name)
            return None
        finally:
            with self._lock:
                self._busy -= 1
                if not self._busy:
                    self._lock.notify_all()

    def health(self) -> int:
        """``health_check()``: 0 healthy, 1 closed, 2 master unreachable (0 where the installed
        Mooncake has no health check)."""
        if not hasattr(self._store, "health_check"):
            return CLOSED if self._closed else HEALTHY
        rc = self.call("health_check")
        return CLOSED if rc is None else int(rc)

    def supports(self, name: str) -> bool:
        return hasattr(self._store, name)

    def register(self, regions: list[tuple[int, int]]) -> None:
        """``ValueError`` (every registration undone) when Mooncake refuses a region."""
        for ptr, n in regions:
            if n <= 0:
                continue
            rc = self.register_one(ptr, n)
            if rc != 0:
                self.unregister()
                raise ValueError(
                    f"Mooncake register_buffer of a {n}-byte host buffer failed ({error_name(rc)})"
                )

    def register_one(self, ptr: int, n: int) -> Any:
        rc = self.call("register_buffer", ptr, n)
        if rc == 0:
            self._registered.append(ptr)
        return rc

    def unregister(self, ptr: int | None = None) -> None:
        """``None``: every registered buffer."""
        for p in list(self._registered) if ptr is None else [ptr]:
            self._registered.remove(p)
            self.call("unregister_buffer", p)

    def close(self, wait_s: float = CLOSE_WAIT_S) -> None:
        """Close once no call is in flight; a call still running after ``wait_s`` leaves the
        store open (logged) rather than closed under it. Idempotent."""
        self.unregister()
        with self._lock:
            if self._closed:
                return
            self._closed = True
            if not self._lock.wait_for(lambda: self._busy == 0, timeout=wait_s):
                logger.error(
                    "Mooncake client %s: %d calls still running after %.0f s; not closing it "
                    "under them",
                    self.description,
                    self._busy,
                    wait_s,
                )
                return
        try:
            self._store.close()
        except Exception:  # noqa: BLE001
            logger.exception("Mooncake close raised")


def open_client(
    config: MooncakeStoreConfig,
    *,
    device_name: str,
    segment_bytes: int,
    ssd_offload_path: str | None = None,
    factory: Callable[[], Any] | None = None,
) -> MooncakeClient:
    """A client mounting ``segment_bytes`` (0: none), warmed up with one put and get;
    ``ValueError`` naming the setting at fault."""
    addr_name = config.source("master_server_address")
    if factory is None:
        reason = availability.module_reason("store")
        if reason is not None:
            raise ValueError(
                f"--hicache-storage-backend=mooncake needs Mooncake: {reason}; install "
                "mooncake-transfer-engine-non-cuda (make test does) and libibverbs1"
            )
        factory = new_distributed_store
    if 0 < segment_bytes < MIN_SEGMENT_SIZE:
        raise ValueError(
            f"{config.source('global_segment_size')}: {segment_bytes} bytes per rank is below "
            f"Mooncake's minimum segment of {MIN_SEGMENT_SIZE} bytes (use 0 for none)"
        )
    host_port = config.master_host_port()
    if host_port is not None and factory is new_distributed_store:
        probe_master(*host_port, addr_name)
    kwargs: dict[str, Any] = {}
    if config.enable_ssd_offload:
        kwargs["enable_ssd_offload"] = True
    if ssd_offload_path is not None:
        kwargs["ssd_offload_path"] = ssd_offload_path
    if config.tenant_id != "default":
        kwargs["tenant_id"] = config.tenant_id
    store = factory()
    try:
        rc = store.setup(
            config.local_hostname,
            config.metadata_server,
            segment_bytes,
            LOCAL_BUFFER_SIZE,
            config.protocol,
            device_name,
            config.master_server_address,
            None,
            **kwargs,
        )
    except TypeError as e:
        raise ValueError(f"the installed Mooncake's setup() refuses {sorted(kwargs)}: {e}") from e
    if rc != 0:
        raise ValueError(
            f"Mooncake setup failed ({error_name(rc)}) against {addr_name}="
            f"{config.master_server_address} (local_hostname={config.local_hostname!r}, "
            f"protocol={config.protocol!r}, metadata_server={config.metadata_server!r}): is a "
            "Mooncake master serving there? (setup waits MC_STORE_CLIENT_SETUP_RETRIES times "
            "MC_RPC_TIMEOUT_MS)"
        )
    client = MooncakeClient(store, f"{config.local_hostname} -> {config.master_server_address}")
    try:
        _warm_up(client, config, segment_bytes)
    except ValueError:
        client.close()
        raise
    return client


def _warm_up(client: MooncakeClient, config: MooncakeStoreConfig, segment_bytes: int) -> None:
    """SGLang's 4 KiB put, get and remove (also proves there is a segment to put into)."""
    key = f"hicache_mooncake_warmup_{uuid.uuid4().hex}"
    value = uuid.uuid4().bytes * 256
    rc = client.call("put", key, value)
    if rc == -200:
        where = "this client mounts none" if segment_bytes == 0 else "every segment is full"
        raise ValueError(
            f"{config.source('global_segment_size')}: no segment of the store has room for a "
            f"4 KiB object ({where}; start a client with a segment, or raise the size)"
        )
    if rc != 0:
        raise ValueError(
            f"Mooncake warm-up put failed ({error_name(rc)}) "
            f"against {config.source('master_server_address')}={config.master_server_address}"
        )
    got = client.call("get", key)
    client.call("remove", key, True)
    if got != value:
        raise ValueError(
            f"Mooncake warm-up read back {len(got or b'')} of 4096 bytes from "
            f"{config.master_server_address} (protocol={config.protocol!r}, "
            f"local_hostname={config.local_hostname!r}: can the peers reach this host?)"
        )
