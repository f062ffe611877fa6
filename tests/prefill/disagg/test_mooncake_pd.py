"""The executor over the real Mooncake transport: decode worker processes on loopback, KV written
into their memory by the prefill side's transfer engines.

Stories: every successful request's decode KV equals a recompute; optimistic attempts send
nothing before finalize and keep their room; a decode killed or frozen while bootstrapping,
before a chunk or before the metadata row turns its request Failed on the prefill side, leaks
nothing on either side, never lands a late write in a reused page, and a new (or the resumed)
worker serves again; a frozen decode stalls only its own requests; bad input fails cleanly
(another geometry, an unreachable bootstrap endpoint, a malformed control message, decode's
waiting timeout); every listener is on loopback.

Timeouts are shortened for the module (Mooncake's progress timeout, SGLang's bootstrap, waiting
and deferred-release timeouts, the failed-session probe).
"""

from __future__ import annotations

import os
import socket
import threading
import time
from collections.abc import Callable

import pytest
import torch

from tests.support import loopback
from tests.support.loopback import skip_reason

_REASON = skip_reason("engine", shim_in_process=True)
if _REASON is not None:
    pytest.skip(f"Mooncake transport tests: {_REASON}", allow_module_level=True)

import zmq  # noqa: E402

from hicache_prefill.prefill.clock import WallClock  # noqa: E402
from hicache_prefill.prefill.disagg.mooncake.layout import KVGeometry  # noqa: E402
from hicache_prefill.prefill.disagg.mooncake.link import MooncakeBackend, MooncakeConfig  # noqa: E402
from hicache_prefill.prefill.disagg.mooncake.receiver import POISON  # noqa: E402
from hicache_prefill.prefill.disagg.protocol import KVPoll, MetadataRow  # noqa: E402
from hicache_prefill.prefill.disagg.simulated import PeerConfig  # noqa: E402
from hicache_prefill.prefill.request.state import Outcome  # noqa: E402
from hicache_prefill.server_args import ServerArgs  # noqa: E402
from tests.support.harness import assert_decode_kv_matches, build_cache, make_executor  # noqa: E402
from tests.support.mooncake_decode import (  # noqa: E402
    DecodeWorker,
    MooncakeDecode,
    wait_for,
)

pytestmark = pytest.mark.usefixtures("one_torch_thread")

ENV = {
    "MC_TCP_PROGRESS_TIMEOUT_SEC": "3",
    "MC_TCP_STATUS_TIMEOUT_SEC": "3",
    "SGLANG_DISAGGREGATION_BOOTSTRAP_TIMEOUT": "4",
    "SGLANG_DISAGGREGATION_WAITING_TIMEOUT": "6",
    "SGLANG_DISAGGREGATION_DEFERRED_DECODE_KV_RELEASE_TIMEOUT": "2",
    "SGLANG_DISAGGREGATION_HEARTBEAT_INTERVAL": "2",
    "SGLANG_FAILED_SESSION_PROBE_INTERVAL_S": "0.5",
    "GLOG_minloglevel": "2",
}
PAGE = 16
MLA = KVGeometry("mla", 2, PAGE, "bfloat16", kv_lora_rank=32, qk_rope_head_dim=8)


@pytest.fixture(scope="module", autouse=True)
def env() -> object:
    mp = pytest.MonkeyPatch()
    for k, v in ENV.items():
        mp.setenv(k, v)
    yield
    mp.undo()


@pytest.fixture(scope="module")
def workers(env: object) -> object:
    """Every worker the module uses, started at once so their start-ups overlap; each pool has
    the geometry of ``mk_args()``'s model, but ``mla``'s."""
    geo = KVGeometry.from_pool(build_cache(mk_args()).device_pool)
    spec = {
        "steady": dict(pool_tokens=4096),
        "kill_bootstrapping": dict(pool_tokens=512),
        "kill_before_chunk": dict(pool_tokens=512),
        "kill_before_aux": dict(pool_tokens=512),
        "frozen": dict(pool_tokens=256),  # 16 pages: a new request must reuse a failed one's
        "mla": dict(pool_tokens=512, geometry=MLA),
    }
    started = {name: DecodeWorker(**{"geometry": geo, "env": ENV, **kw})
               for name, kw in spec.items()}  # fmt: skip
    try:
        for w in started.values():
            w.wait_ready()
        yield started
    finally:
        for w in started.values():
            w.stop()
        for w in started.values():
            assert not w.alive, f"decode worker {w.pid} still runs"


def mk_args(**kw: object) -> ServerArgs:
    base = dict(
        page_size=PAGE,
        max_total_tokens=4096,
        chunked_prefill_size=64,
        device="cpu",
        dtype="float32",
        disaggregation_mode="prefill",
        disaggregation_transfer_backend="mooncake",
        disaggregation_bootstrap_port=0,
    )
    return ServerArgs(**{**base, **kw})  # type: ignore[arg-type]


def push(port: int, frames: list[bytes]) -> None:
    """One ZMQ multipart message to a PULL socket on loopback ``port``."""
    sock = zmq.Context.instance().socket(zmq.PUSH)
    sock.setsockopt(zmq.LINGER, 2000)
    sock.connect(f"tcp://127.0.0.1:{port}")
    sock.send_multipart(frames)
    sock.close()


def prompt(seed: int, n: int) -> list[int]:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, 500, (n,), generator=g).tolist()


def drive(ex: object, until: Callable[[], bool], timeout_s: float = 60.0) -> None:
    """Step (checking integrity) until ``until()`` holds."""
    deadline = time.monotonic() + timeout_s
    while not until():
        assert time.monotonic() < deadline, f"not reached in {timeout_s}s: {ex.describe()}"
        if not ex.step():
            time.sleep(0.001)
        ex.check_integrity()


def check_results(ex: object, results: list) -> None:
    """Every success's decode KV equals a recompute and its metadata row carried the first
    token; then every rid is released."""
    decode: MooncakeDecode = ex.decode
    for r in results:
        if r.outcome == Outcome.SUCCESS:
            assert_decode_kv_matches(ex, r.rid)
            assert decode.first_tokens[r.rid] == r.first_token
    for r in results:
        decode.release(r.rid)


def assert_no_leaks(ex: object, *workers: DecodeWorker) -> None:
    """Prefill: integrity (the slot ledger balances with nothing request-owned), nothing
    draining or outstanding. Decode: every page and metadata row free, nothing held, no late
    write into a free page."""
    ex.check_integrity()
    assert ex.request_owned_slots() == 0 and not ex.draining_queue
    assert ex.decode.backend.transport.stats()["outstanding"] == 0
    ex.decode.backend.transport.check_integrity()
    for w in workers:
        ok = wait_for(lambda w=w: _idle(w.call("stats")[0]), timeout_s=15)
        stats = w.call("stats")[0]
        assert ok, f"decode worker {w.pid} still holds memory: {stats}"
        assert stats["late_writes"] == 0


def assert_idle(worker: DecodeWorker) -> None:
    assert wait_for(lambda: _idle(worker.call("stats")[0]), timeout_s=15)
    assert worker.call("stats")[0]["late_writes"] == 0


def _idle(s: dict) -> bool:
    return (s["free_tokens"] == s["pool_tokens"] and s["held"] == 0
            and s["metadata_free"] == s["metadata_total"])  # fmt: skip


def test_kv_matches_recompute_and_bad_input_fails_cleanly(workers: dict) -> None:
    steady = workers["steady"]
    ex = make_executor(mk_args(), peer_config=PeerConfig(decode_prefix_len=PAGE),
                       decode_workers=[steady])  # fmt: skip
    decode: MooncakeDecode = ex.decode
    # A second prefill instance of another geometry (K/V heads of 32, not 16).
    other = make_executor(mk_args(head_dim=32), decode_workers=[steady])
    # A third one that goes away while decode waits for its KV: decode's heartbeat fails it.
    gone = make_executor(mk_args(), decode_workers=[steady])
    try:
        # A bootstrap port in use: one error naming the flag, nothing left listening.
        port = decode.backend.transport.bootstrap.port
        listening = set(loopback.tcp_listeners([os.getpid()]))
        with pytest.raises(ValueError, match=f"--disaggregation-bootstrap-port {port}"):
            make_executor(mk_args(disaggregation_bootstrap_port=port), decode_workers=[steady])
        assert set(loopback.tcp_listeners([os.getpid()])) == listening
        hb = gone.decode.create_peer("hb", 40)
        assert wait_for(lambda: hb.poll() == KVPoll.WaitingForInput, 30)
        gone.decode.close()
        # decode's waiting timeout: a link whose room reached WaitingForInput, nothing sent.
        idle_link = decode.create_peer("waits", 40)
        # An unreachable bootstrap endpoint, on the decode side.
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            dead = f"127.0.0.1:{s.getsockname()[1]}"
        steady.call("add", rid="nowhere", room=7, bootstrap_addr=dead, num_tokens=20)
        # A malformed control message to the prefill side's listener, and one to decode's.
        push(decode.backend.transport.listener.port,
             [b"12", b"127.0.0.1", b"not-a-port", b"s", b"", b"0", b"", b"1", b"0",
              b""])  # fmt: skip
        malformed_before = steady.call("stats")[0]["malformed_messages"]
        push(steady.info["control_port"], [b"1", b"9", b"0"])  # STATUS of no KVPoll value
        lengths = [1, 15, 16, 17, 100, 200, 333]
        for i, n in enumerate(lengths):
            ex.submit(f"r{i}", prompt(i, n))
        ex.run_until_idle(check=True)
        other.submit("geom", prompt(99, 50))
        other.run_until_idle(check=True)
        (geom,) = other.pop_results()
        results = {r.rid: r for r in ex.pop_results()}
        assert all(results[f"r{i}"].outcome == Outcome.SUCCESS for i in range(len(lengths)))
        assert all(
            r.decode_prefix_len == (min(PAGE, (n - 1) // PAGE * PAGE))
            for r, n in zip([results[f"r{i}"] for i in range(len(lengths))], lengths, strict=True)
        )
        # Another geometry: that prefill refuses the decode's REGISTER (its item lengths), and
        # its request fails at META, naming the sizes, not by its bootstrap timeout; decode
        # hears STATUS Failed.
        assert geom.outcome == Outcome.ABORTED and "another KV geometry" in geom.error
        assert "[2048]" in geom.error and "[4096]" in geom.error  # a page: head_dim 16 vs 32
        assert wait_for(lambda: other.decode.state("geom")["state"] == "Failed", 30)
        assert "reported the transfer Failed" in other.decode.state("geom")["failure"]
        other.decode.release("geom")
        check_results(ex, list(results.values()))

        assert wait_for(lambda: steady.call("state", rid="nowhere")[0]["state"] == "Failed", 30)
        assert "unreachable" in steady.call("state", rid="nowhere")[0]["failure"]
        steady.call("release", rid="nowhere")
        stats = decode.backend.transport.stats()
        assert stats["malformed_messages"] == 1
        assert any("META: decode port must be an integer" in e for e in stats["errors"])
        worker_stats = steady.call("stats")[0]  # decode names it too, and served on
        assert worker_stats["malformed_messages"] == malformed_before + 1
        assert "status 9 is not a KVPoll value" in worker_stats["last_control_error"]
        assert wait_for(lambda: idle_link.poll() == KVPoll.Failed, 30)
        assert "aborted" in idle_link.failure  # decode's ABORT after its waiting timeout
        assert "WaitingForInput" in decode.state("waits")["failure"]
        decode.release("waits")
        assert wait_for(lambda: "heartbeat" in str(steady.call("state", rid="hb")[0]["failure"]),
                        30)  # fmt: skip
        steady.call("release", rid="hb")  # held (its pages were exposed), freed after the hold

        pids = {os.getpid(), *decode.worker_pids}
        listeners = loopback.tcp_listeners(pids)
        assert {pid for _, pid in listeners} == pids  # every process listens ...
        assert loopback.non_loopback(listeners) == []  # ... on loopback only
        assert_no_leaks(ex, steady)
        assert steady.call("stats")[0]["acked_releases"] >= 1  # the waiting timeout's ABORT_ACK
    finally:
        decode.close()
        other.decode.close()


def test_optimistic_attempts_send_nothing_before_finalize(workers: dict) -> None:
    steady = workers["steady"]
    args = mk_args(optimistic_prefill_attempts=2, disaggregation_force_not_ready_prob=1.0)
    ex = make_executor(args, decode_workers=[steady])
    decode: MooncakeDecode = ex.decode
    decode.hold = lambda rid: rid in ("p0", "p1")  # decode not ready until told
    try:
        for i in range(4):
            ex.submit(f"p{i}", prompt(10 + i, 120))
        rooms = {rid: link.room for rid, link in decode.peers.items()}
        # At each finalize the request's decode pages (exposed by META: p2, p3 long before,
        # their first attempts computed while forced not ready) still hold the free-page
        # pattern: nothing of an attempt that was not finalized was written.
        untouched: dict[str, bool] = {}
        for rid, link in decode.peers.items():

            def init(attempt: int, rid: str = rid, inner: Callable = link.init) -> None:
                _, *kv = decode.pages_kv(rid)
                untouched[rid] = all(bool((t.view(torch.uint8) == POISON).all()) for t in kv)
                inner(attempt)

            link.init = init  # type: ignore[method-assign]
        # p0, p1: computed optimistically (forced yield, then a second attempt) and parked.
        parked = lambda: {r.rid for r in ex.inflight_queue if r.parked} >= {"p0", "p1"}  # noqa: E731
        drive(ex, parked)
        assert not [s for s in decode.send_log if s.rid in ("p0", "p1")]
        for rid in ("p0", "p1"):
            assert decode.state(rid)["state"] == "Bootstrapping"
            decode.unhold(rid)
        ex.run_until_idle(check=True)
        results = ex.pop_results()
        assert all(r.outcome == Outcome.SUCCESS for r in results)
        assert all(r.passes == 2 and r.yields == 1 for r in results)
        finalized = {r.rid: r.passes for r in results}
        assert decode.send_log and all(s.attempt == finalized[s.rid] for s in decode.send_log)
        assert {rid: link.room for rid, link in decode.peers.items()} == rooms
        assert untouched == {f"p{i}": True for i in range(4)}
        check_results(ex, results)
        assert_no_leaks(ex, steady)
    finally:
        decode.close()


def _fail_one(ex: object, victim: DecodeWorker, point: str, action: str, seed: int = 0) -> dict:
    """Submit ``V`` (to ``victim``) and kill or freeze the victim at ``point``; returns when V
    has its result. ``N`` goes to the steady worker once the victim is stopped, and must
    finish first when the victim is frozen (a frozen decode stalls only its own requests)."""
    decode: MooncakeDecode = ex.decode
    stopped = threading.Event()

    def stop_victim() -> None:
        if not stopped.is_set():
            victim.kill() if action == "kill" else victim.freeze()
            stopped.set()

    def hook(rid: str, chunk: int, last: bool, phase: str) -> None:
        chosen = (point == "before_chunk" and chunk == 1) or (
            point == "before_aux" and phase == "before_aux")  # fmt: skip
        if rid == "V" and chosen:
            stop_victim()

    decode.set_transfer_hook(hook)
    decode.hold = lambda rid: rid == "V" and point == "bootstrapping"
    ex.submit("V", prompt(77 + seed, 200))  # a new prompt each time: no prefix hit
    if point == "bootstrapping":
        drive(ex, lambda: decode.state("V")["state"] == "Bootstrapping")
        stop_victim()
    drive(ex, stopped.is_set)
    if action == "freeze" and point == "before_chunk":
        # the prefill side gives up while V's call is blocked: V drains (keeps its slots) until
        # the call returns
        link = decode.peers["V"]
        link.fail("given up by the prefill side during a blocked call (test)")
        drive(ex, lambda: bool(ex.draining_queue))
        (req,) = ex.draining_queue
        assert req.rid == "V" and req.slots is not None and link.inflight_reads() > 0
    ex.submit("N", prompt(177 + seed, 150))
    drive(ex, lambda: "V" in ex.results and "N" in ex.results)
    results = {r.rid: r for r in ex.pop_results()}
    assert results["V"].outcome == Outcome.ABORTED and results["N"].outcome == Outcome.SUCCESS
    if action == "freeze" and point != "bootstrapping":
        assert results["N"].finish_time < results["V"].finish_time
    decode.set_transfer_hook(None)
    return results


@pytest.mark.parametrize("point", ["bootstrapping", "before_chunk", "before_aux"])
def test_killed_decode(workers: dict, point: str) -> None:
    # the frozen-decode test's worker joins here (before that test runs)
    steady, victim, joiner = workers["steady"], workers[f"kill_{point}"], workers["frozen"]
    # optimistic while bootstrapping (it parks); else V waits for its peer, so that every chunk
    # boundary sends (the hook's chunk 1 exists)
    attempts = 1 if point == "bootstrapping" else 0
    ex = make_executor(mk_args(optimistic_prefill_attempts=attempts),
                       decode_workers=[steady, victim])  # fmt: skip
    decode: MooncakeDecode = ex.decode
    decode.route = lambda rid: victim if rid == "V" else joiner if rid == "J" else steady
    try:
        results = _fail_one(ex, victim, point, "kill")
        v = results["V"]
        if point == "bootstrapping":
            # computed optimistically (then parked, or yielded to N), timed out bootstrapping
            assert v.attempts == 1 and v.total_computed_tokens > 0 and "Bootstrapping" in v.error
        else:
            assert "failed" in v.error and ex.stats.transfer_failures == 1
        check_results(ex, list(results.values()))
        # a new decode worker joins after the kill
        decode.add_worker(joiner, owned=False)
        ex.submit("J", prompt(79, 180))
        ex.run_until_idle(check=True)
        (j,) = ex.pop_results()
        assert j.outcome == Outcome.SUCCESS
        check_results(ex, [j])
        assert_no_leaks(ex, steady, joiner)
    finally:
        decode.close()


def test_frozen_decode_at_each_point(workers: dict) -> None:
    """One worker frozen at each point in turn; after it resumes, the late bytes of the failed
    call land in pages it still holds, and the next request on it (which needs those pages:
    its pool has 16) waits until they are released, then gets the right KV."""
    steady, victim = workers["steady"], workers["frozen"]
    ex = make_executor(mk_args(), decode_workers=[steady, victim])
    decode: MooncakeDecode = ex.decode
    decode.route = lambda rid: victim if rid in ("V", "R") else steady
    session = victim.info["session"]
    try:
        for i, point in enumerate(("bootstrapping", "before_chunk", "before_aux")):
            results = _fail_one(ex, victim, point, "freeze", seed=i)
            victim.resume()
            if point == "before_chunk":  # chunk 1 = tokens [64, 128): its failed call lands now
                _, ref_k, _ = ex.model.forward_reference(torch.tensor(prompt(77 + i, 200)))
                want = ref_k[:, 64:128]

                def landed(want: torch.Tensor = want) -> bool:
                    return decode.state("V")["held"] and torch.allclose(
                        decode.pages_kv("V")[1][:, 64:128], want, atol=1e-5
                    )

                assert wait_for(landed, 10), "the failed call's bytes did not land (held pages)"
            if point == "bootstrapping":
                decode.unhold("V")  # META for a failed room: STATUS Failed, ABORT, ack
                assert wait_for(lambda: decode.state("V")["state"] == "Failed", 30)
            check_results(ex, list(results.values()))
            sessions = decode.backend.transport.stats()["sessions"]
            assert wait_for(
                lambda: decode.backend.transport.sessions[session].worker.blacklisted is None, 30
            ), sessions  # probed back after the resume
            ex.submit("R", prompt(277 + i, 200))
            ex.run_until_idle(check=True)
            (r,) = ex.pop_results()
            assert r.outcome == Outcome.SUCCESS
            check_results(ex, [r])
            assert_no_leaks(ex, steady, victim)
        stats = victim.call("stats")[0]
        assert stats["timeout_releases"] == 2 and stats["acked_releases"] >= 1, stats
    finally:
        decode.close()


def test_mla_latent_over_the_transport_and_expected_geometry(workers: dict) -> None:
    """An MLA decode worker's REGISTER (2 latent buffers) is refused by an MHA prefill, whose
    request fails naming both layouts; it then receives an MLA prefill's latent KV byte for
    byte, written from scattered pages with a partial last page."""
    worker = workers["mla"]
    mha = make_executor(mk_args(), decode_workers=[worker])
    try:
        mha.submit("mha", prompt(5, 30))
        mha.run_until_idle(check=True)
        (res,) = mha.pop_results()
        assert res.outcome == Outcome.ABORTED
        assert "registered 2 KV buffers" in res.error and "(mha, " in res.error
        mha.decode.release("mha")
    finally:
        mha.decode.close()
    pool = MLA.make_pool(256)
    for layer in pool.kv_buffer:
        layer.copy_(torch.randn(layer.shape).to(layer.dtype))
    backend = MooncakeBackend(pool, WallClock(), MooncakeConfig(bootstrap_port=0), 8)
    decode = MooncakeDecode(backend, [worker], owned=[])
    try:
        link = decode.create_peer("m", 40)
        assert wait_for(lambda: link.poll() == KVPoll.WaitingForInput, 30)
        link.init(1)
        pages = torch.tensor([9, 3, 4])  # scattered prefill pages; 40 tokens end mid-page
        slots = (pages[:, None] * PAGE + torch.arange(PAGE)).flatten()[:40]
        assert link.send(1, 0, 32, slots[:32], last=False)
        assert link.send(1, 32, 40, slots[32:], last=True, metadata=MetadataRow(0, 123, 0))
        assert wait_for(lambda: link.poll() == KVPoll.Success, 30)
        dpl, kv = decode.received_kv("m")
        want = torch.stack([layer[slots] for layer in pool.kv_buffer])
        assert dpl == 0 and torch.equal(kv, want) and decode.first_tokens["m"] == 123
        decode.release("m")
        assert_idle(worker)
    finally:
        decode.close()
