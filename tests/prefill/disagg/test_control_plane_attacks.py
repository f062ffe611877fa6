"""The PD control plane against a hostile or broken peer on loopback: each attack runs while a
victim decode worker's requests go on, and after it the victim still receives its KV byte for
byte and the prefill process is back to its baseline (threads, file descriptors, listening
ports, decode sessions, running engines; RSS within a bound).

Attacks: a REGISTER for a live session (its id, from another endpoint or its own); a flood of
REGISTERs under new session ids; an oversized frame, a message of thousands of frames and a
flood of raw TCP connections; META / ABORT for unknown rooms naming a black-hole endpoint, and
a registered endpoint that never reads; half-sent requests to the bootstrap endpoint; a
non-loopback bind. The limits are shortened for the module (``ControlLimits``)."""

from __future__ import annotations

import os
import socket
import time
import warnings

import pytest
import torch

from tests.support import loopback
from tests.support.loopback import skip_reason

_REASON = skip_reason("engine", shim_in_process=True)
if _REASON is not None:
    pytest.skip(f"Mooncake control-plane tests: {_REASON}", allow_module_level=True)

import zmq  # noqa: E402

from hicache_prefill.hicache.memory.device_pool import MHATokenToKVPool  # noqa: E402
from hicache_prefill.prefill.clock import WallClock  # noqa: E402
from hicache_prefill.prefill.disagg.mooncake.channel import check_bind_host  # noqa: E402
from hicache_prefill.prefill.disagg.mooncake.layout import KVGeometry  # noqa: E402
from hicache_prefill.prefill.disagg.mooncake.link import MooncakeBackend, MooncakeConfig  # noqa: E402
from hicache_prefill.prefill.disagg.mooncake.sender import ControlLimits  # noqa: E402
from hicache_prefill.prefill.disagg.mooncake.wire import Abort, Meta, Register  # noqa: E402
from hicache_prefill.prefill.disagg.protocol import KVPoll, MetadataRow  # noqa: E402
from tests.support.mooncake_decode import DecodeWorker, MooncakeDecode, wait_for  # noqa: E402

PAGE = 16
LIMITS = ControlLimits(
    max_unproven=8,
    unproven_idle_s=1.0,
    dead_s=1.0,
    max_message_bytes=1 << 20,
    max_connections=16,
    bootstrap_threads=4,
    bootstrap_timeout_s=1.0,
)
ENV = {"GLOG_minloglevel": "2", "MC_TCP_PROGRESS_TIMEOUT_SEC": "3"}


@pytest.fixture(scope="module")
def plane():  # noqa: ANN201
    """A prefill rank (random KV in its pool) and one victim decode worker."""
    pool = MHATokenToKVPool(1024, PAGE, torch.float32, 2, 16, 2, "cpu")
    g = torch.Generator().manual_seed(0)
    for layer in [*pool.k_buffer, *pool.v_buffer]:
        layer.copy_(torch.randn(layer.shape, generator=g))
    backend = MooncakeBackend(pool, WallClock(), MooncakeConfig(bootstrap_port=0, limits=LIMITS),
                              16)  # fmt: skip
    worker = DecodeWorker(KVGeometry.from_pool(pool), pool_tokens=1024, env=ENV)
    try:
        worker.wait_ready()
        decode = MooncakeDecode(backend, [worker], owned=[worker])
        for _ in range(8):  # warm: the engines' lanes, sockets and threads
            victim_request(decode, pool)
        yield decode, pool
    finally:
        decode.close()
        assert not worker.alive


_count = iter(range(1 << 30))


def victim_request(decode: MooncakeDecode, pool: MHATokenToKVPool) -> None:
    """One request of the victim: 40 tokens from scattered pages, received byte for byte."""
    rid = f"v{next(_count)}"
    link = decode.create_peer(rid, 40)
    assert wait_for(lambda: link.poll() == KVPoll.WaitingForInput, 30), link.failure
    link.init(1)
    pages = torch.tensor([9, 3, 4])
    slots = (pages[:, None] * PAGE + torch.arange(PAGE)).flatten()[:40]
    assert link.send(1, 0, 32, slots[:32], last=False)
    assert link.send(1, 32, 40, slots[32:], last=True, metadata=MetadataRow(0, 7, 0))
    assert wait_for(lambda: link.poll() == KVPoll.Success, 30), link.failure
    _, k, v = decode.received_kv(rid)
    assert torch.equal(k, torch.stack([layer[slots] for layer in pool.k_buffer]))
    assert torch.equal(v, torch.stack([layer[slots] for layer in pool.v_buffer]))
    decode.release(rid)


def resources(decode: MooncakeDecode) -> dict:
    t = decode.backend.transport
    return {
        "threads": len(os.listdir("/proc/self/task")),
        "fds": len(os.listdir("/proc/self/fd")),
        "listeners": sorted(loopback.tcp_listeners([os.getpid()])),
        "sessions": len(t.sessions),
        "engines": sum(s.worker.running for s in t.sessions.values()),
    }


def rss() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


LANES = 4  # Mooncake's TCP lanes per peer (MC_TCP_LANES_PER_PEER): its engine opens them lazily


def at_baseline(now: dict, base: dict) -> bool:
    """Threads no more than at the baseline, descriptors no more than it plus the engine's lane
    sockets, the rest the same."""
    return (
        now["threads"] <= base["threads"]
        and now["fds"] <= base["fds"] + LANES
        and all(now[k] == base[k] for k in now if k not in ("threads", "fds"))
    )


def settle(decode: MooncakeDecode, pool: MHATokenToKVPool, base: dict) -> None:
    """The victim still succeeds, and the prefill process returns to ``base``."""
    victim_request(decode, pool)
    decode.backend.transport.check_integrity()
    ok = wait_for(lambda: at_baseline(resources(decode), base), 20, 0.1)
    assert ok, f"not back to the baseline: {resources(decode)} vs {base}"


@pytest.fixture
def base(plane) -> dict:  # noqa: ANN001
    """The prefill process's resources once the victim was served and they stopped moving."""
    decode, pool = plane
    victim_request(decode, pool)  # warm: the victim's session, engine, sockets
    snaps = [resources(decode)]
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:
        time.sleep(0.3)
        snaps.append(resources(decode))
        if snaps[-1] == snaps[-2] and snaps[-1]["sessions"] == 1:
            break
    return snaps[-1]


class Attacker:
    """A ZMQ PUSH peer of the prefill rank's control socket."""

    def __init__(self, port: int) -> None:
        self.sock = zmq.Context.instance().socket(zmq.PUSH)
        self.sock.setsockopt(zmq.LINGER, 2000)
        self.sock.connect(f"tcp://127.0.0.1:{port}")

    def send(self, frames: list[bytes]) -> None:
        self.sock.send_multipart(frames)

    def close(self) -> None:
        self.sock.close()


def _attacker(decode: MooncakeDecode) -> Attacker:
    return Attacker(decode.backend.transport.listener.port)


def _victim_session(decode: MooncakeDecode):  # noqa: ANN202
    (session,) = decode.backend.transport.sessions.values()
    return session


def test_a_register_never_rewrites_a_live_session(plane, base) -> None:
    decode, pool = plane
    t = decode.backend.transport
    victim = _victim_session(decode)
    before = t.listener.malformed
    atk = _attacker(decode)
    try:
        n = len(victim.reg.kv_ptrs)
        for endpoint_port in (victim.reg.decode_port, victim.reg.decode_port + 1):
            reg = victim.reg
            forged = Register(reg.decode_ip, endpoint_port, reg.session, (4096,) * n,
                              reg.aux_ptrs, reg.kv_item_lens)  # fmt: skip
            atk.send(forged.to_frames())
        assert wait_for(lambda: t.listener.malformed == before + 2, 10)
    finally:
        atk.close()
    assert _victim_session(decode) is victim and victim.reg.kv_ptrs[0] != 4096
    assert "refused" in t.listener.last_error
    for _ in range(3):
        victim_request(decode, pool)
    settle(decode, pool, base)


def test_a_register_flood_is_capped_and_reclaimed(plane, base) -> None:
    decode, pool = plane
    t = decode.backend.transport
    victim = _victim_session(decode)
    geo = KVGeometry.from_pool(pool)
    atk = _attacker(decode)
    try:
        for i in range(150):
            reg = Register("127.0.0.1", 9, f"127.0.0.1:{30000 + i}", (1 << 20,) * 4,
                           (1,) * 10, tuple(geo.item_lens()))  # fmt: skip
            atk.send(reg.to_frames())
        assert wait_for(lambda: t.listener.messages >= 150, 30)
        # capped: at most max_unproven forged sessions, no engine or thread for any of them
        assert len(t.sessions) <= 1 + LIMITS.max_unproven
        assert resources(decode)["engines"] == base["engines"]
        victim_request(decode, pool)  # the victim's proven session is never evicted
        assert t.sessions[victim.reg.session] is victim
    finally:
        atk.close()
    settle(decode, pool, base)  # the forged ones dropped after unproven_idle_s


def test_message_and_connection_limits(plane, base) -> None:
    decode, pool = plane
    t = decode.backend.transport
    rss0, malformed = rss(), t.listener.malformed
    atk = _attacker(decode)
    try:
        atk.send([b"1", b"x" * (4 << 20)])  # past MAXMSGSIZE: that peer is disconnected
        atk.sock.close()
        atk = _attacker(decode)
        atk.send([b"None"] + [b"\0" * 512] * 5000)  # thousands of frames: dropped
        assert wait_for(lambda: t.listener.malformed == malformed + 1, 20)
        assert "more than 32 frames" in t.listener.last_error
    finally:
        atk.close()
    raw = [socket.create_connection(("127.0.0.1", t.listener.port)) for _ in range(60)]
    try:
        assert wait_for(lambda: t.listener.refused > 0, 10)
        assert t.listener.connections <= LIMITS.max_connections
        victim_request(decode, pool)  # its connection is older than the flood
    finally:
        for s in raw:
            s.close()
    assert rss() - rss0 < 64 << 20
    settle(decode, pool, base)


def test_no_reply_to_unknown_rooms_and_a_slow_endpoint_delays_no_one(plane, base) -> None:
    decode, pool = plane
    t = decode.backend.transport
    geo = KVGeometry.from_pool(pool)
    hole = socket.create_server(("127.0.0.1", 0), backlog=1)  # accepts nothing, reads nothing
    hole.settimeout(0.5)
    port = hole.getsockname()[1]
    atk = _attacker(decode)
    try:
        for room in range(1, 200):
            atk.send(Meta(room, "127.0.0.1", port, "127.0.0.1:1", (1,), 0, 0).to_frames())
            atk.send(Abort(room, "127.0.0.1", port, 1).to_frames())
        assert wait_for(lambda: t.counts["unknown_room"] >= 199, 20)
        with pytest.raises(TimeoutError):
            hole.accept()  # nothing was pushed to an endpoint only those messages named
        # Now the black hole registers (as a decode that never reads) and asks for thousands
        # of ABORT_ACKs: its queue fills and drops; the victim's STATUS never waits behind it.
        reg = Register("127.0.0.1", port, "127.0.0.1:2", (1 << 20,) * 4, (1,) * 10,
                       tuple(geo.item_lens()))  # fmt: skip
        atk.send(reg.to_frames())
        for room in range(1, 3000):
            atk.send(Abort(1000 + room, "127.0.0.1", port, 1).to_frames())
        assert wait_for(lambda: t.stats()["dropped_pushes"] > 0, 30)
        for _ in range(3):
            victim_request(decode, pool)
    finally:
        atk.close()
        hole.close()
    settle(decode, pool, base)


def test_the_bootstrap_endpoint_bounds_threads_and_times_out_half_sent_requests(
    plane, base
) -> None:
    decode, pool = plane
    t = decode.backend.transport
    host, port = t.bootstrap.host, t.bootstrap.port
    half = []
    for _ in range(40):
        s = socket.create_connection((host, port))
        s.sendall(b"GET /route?prefill_dp_rank=-1 HTTP/1.1\r\nHost: x\r\n")  # never finished
        half.append(s)
    try:
        assert wait_for(lambda: t.bootstrap.stats()["shed"] > 0, 10)
        assert t.bootstrap.stats()["in_service"] <= LIMITS.bootstrap_threads
        assert len(os.listdir("/proc/self/task")) <= base["threads"] + LIMITS.bootstrap_threads
        victim_request(decode, pool)  # the control plane is not behind the bootstrap endpoint
        # every half-sent request is closed by the server, at once (shed) or after its timeout
        assert all(closed_by_server(s) for s in half)
        assert wait_for(lambda: t.bootstrap.stats()["in_service"] == 0, 10)
    finally:
        for s in half:
            s.close()
    # a slow drip (a byte every 0.2 s) is cut at the request deadline, not per byte
    with socket.create_connection((host, port)) as s:
        s.sendall(b"GET /health HTTP/1.0\r\n")
        deadline = time.monotonic() + 10
        with pytest.raises(OSError):
            while time.monotonic() < deadline:
                time.sleep(0.2)
                s.sendall(b"X-Slow: 1\r\n")
            raise AssertionError("a slow request was never cut")
    assert t.bootstrap.stats()["expired"] >= 1
    with socket.create_connection((host, port)) as s:  # served again
        s.sendall(b"GET /health HTTP/1.0\r\n\r\n")
        assert s.recv(1024).startswith(b"HTTP/1.0 200")
    settle(decode, pool, base)


def closed_by_server(s: socket.socket, timeout_s: float = 10.0) -> bool:
    s.settimeout(timeout_s)
    try:
        while s.recv(1024):
            pass
        return True
    except ConnectionResetError:
        return True
    except TimeoutError:
        return False


def test_non_loopback_binds_warn_and_every_listener_is_on_loopback(plane, base) -> None:
    decode, _ = plane
    with pytest.warns(RuntimeWarning, match="not authenticated"):
        check_bind_host("0.0.0.0", "the control socket")
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        check_bind_host("127.0.0.1", "the control socket")
        check_bind_host("::1", "the control socket")
    pids = {os.getpid(), *decode.worker_pids}
    listeners = loopback.tcp_listeners(pids)
    assert {pid for _, pid in listeners} == pids
    assert loopback.non_loopback(listeners) == []


def test_an_idle_session_engine_is_reclaimed(plane, base) -> None:
    decode, pool = plane
    t = decode.backend.transport
    session = _victim_session(decode)
    worker = session.worker
    worker.idle_s = 0.3  # its thread and engine end after 0.3 s without a job
    try:
        victim_request(decode, pool)
        assert wait_for(lambda: not worker.running, 10)
        assert resources(decode)["engines"] == base["engines"] - 1
        time.sleep(0.1)
        victim_request(decode, pool)  # restarted by the next job
    finally:
        worker.idle_s = LIMITS.engine_idle_s
    assert t.sessions[session.reg.session] is session


def test_with_the_opt_in_shared_secret_only_its_holders_take_part() -> None:
    """Prefill and decode worker given ``HICACHE_PD_SHARED_SECRET``: requests succeed byte for
    byte; a REGISTER from a peer without it never reaches the prefill side's handler."""
    pool = MHATokenToKVPool(256, PAGE, torch.float32, 2, 16, 2, "cpu")
    for layer in [*pool.k_buffer, *pool.v_buffer]:
        layer.copy_(torch.randn(layer.shape))
    cfg = MooncakeConfig(bootstrap_port=0, secret="s3cret")
    backend = MooncakeBackend(pool, WallClock(), cfg, 8)
    worker = DecodeWorker(KVGeometry.from_pool(pool), pool_tokens=256,
                          env={**ENV, "HICACHE_PD_SHARED_SECRET": "s3cret"})  # fmt: skip
    decode = MooncakeDecode(backend, [worker], owned=[worker])
    try:
        worker.wait_ready()
        victim_request(decode, pool)
        t = backend.transport
        before = t.listener.messages
        atk = _attacker(decode)
        try:
            reg = Register("127.0.0.1", 9, "127.0.0.1:9", (1 << 20,) * 4, (1,) * 10,
                           tuple(KVGeometry.from_pool(pool).item_lens()))  # fmt: skip
            atk.send(reg.to_frames())
            time.sleep(0.5)
        finally:
            atk.close()
        assert t.listener.messages == before and "127.0.0.1:9" not in t.sessions
        victim_request(decode, pool)
    finally:
        decode.close()
