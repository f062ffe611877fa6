"""The Mooncake transport's pieces that need no engine and no second process: SGLang's control
messages frame for frame, the KV geometry and SGLang's metadata buffers, the address of every
item, the bootstrap endpoint's routes and payloads, and the prefill side's control plane over
ZMQ: refusing a decode of another geometry or an unserved mode, a bad META, a REGISTER that
would rewrite a live session, and replies to endpoints no REGISTER named."""

from __future__ import annotations

import dataclasses
import json
import struct
import time
import urllib.error
import urllib.request

import numpy as np
import pytest
import torch
import zmq

from hicache_prefill.hicache.memory.device_pool import MHATokenToKVPool, MLATokenToKVPool
from hicache_prefill.prefill.disagg.mooncake.bootstrap import (
    BootstrapServer,
    BootstrapUnreachable,
    fetch_route,
    http,
)
from hicache_prefill.prefill.disagg.mooncake.channel import Pusher
from hicache_prefill.prefill.disagg.mooncake.engine import MAX_ITEMS_PER_CALL, KVTransferEngine
from hicache_prefill.prefill.disagg.mooncake.layout import (
    KVGeometry,
    MetadataBuffers,
    layer_buffers,
    pool_region,
)
from hicache_prefill.prefill.disagg.mooncake.sender import ControlLimits, PrefillTransport
from hicache_prefill.prefill.disagg.mooncake.session_worker import (
    Job,
    SourceMemory,
    coalesce,
    kv_items,
)
from hicache_prefill.prefill.disagg.mooncake.wire import (
    Abort,
    AbortAck,
    ControlMessageError,
    Meta,
    Register,
    Status,
    parse_to_decode,
    parse_to_prefill,
)
from hicache_prefill.prefill.disagg.protocol import KVPoll


def _register(geometry: KVGeometry, session: str = "127.0.0.1:15000", port: int = 4000,
              aux: int = 10) -> Register:  # fmt: skip
    n = len(geometry.item_lens())
    return Register("127.0.0.1", port, session, tuple(range(1 << 20, (1 << 20) + n)),
                    tuple(range(1, aux + 1)), tuple(geometry.item_lens()))  # fmt: skip


# ---------------------------------------------------------------- messages
def test_messages_have_sglangs_frames_and_round_trip() -> None:
    geo = KVGeometry("mha", 2, 16, "float32", 2, 16, 16)
    reg = _register(geo)
    frames = reg.to_frames()
    assert len(frames) == 20 and frames[0] == b"None" and frames[3] == b"127.0.0.1:15000"
    assert frames[9] == b"2048" and frames[16:18] == [b"1", b"0"]  # kv_item_len, dcp size/rank
    assert struct.unpack("<4Q", frames[19]) == (2048,) * 4  # per-layer item lengths, last
    meta = Meta(5, "127.0.0.1", 4000, "127.0.0.1:15000", (3, 4, 9), 7, 16)
    mf = meta.to_frames()
    assert len(mf) == 10 and np.frombuffer(mf[4], dtype="<i4").tolist() == [3, 4, 9]
    assert mf[5] == b"7" and mf[7] == b"1" and mf[8] == b"16" and mf[9] == b""
    for m in (reg, meta, Abort(5), Abort(5, "127.0.0.1", 4000), Abort(5, "127.0.0.1", 4000, 3)):
        assert parse_to_prefill(m.to_frames()) == m
    assert [len(Abort(5, "h", 1, g).to_frames()) for g in (None, 2)] == [4, 5]
    for m in (Status(5, int(KVPoll.Success)), AbortAck(5), AbortAck(5, 0, 9)):
        assert parse_to_decode(m.to_frames()) == m
    assert Status(5, 4).to_frames() == [b"5", b"4", b"0"]
    assert AbortAck(5, 0, 9).to_frames() == [b"ABORT_ACK", b"5", b"0", b"9"]
    # An older peer's 10-frame REGISTER: every buffer has frame 9's item length.
    old = parse_to_prefill(frames[:10])
    assert old.kv_item_lens == (2048,) * 4 and old.dcp_size == 1


@pytest.mark.parametrize(
    "frames, message",
    [
        ([], "an empty message"),
        ([b"12", b"127.0.0.1"], "META: 2 frames, expected 10"),
        ([b"x", b"ip", b"1", b"s", b"\0" * 4, b"0", b"", b"1", b"0", b""], "META: room must be an"),
        ([b"1", b"ip", b"1", b"s", b"abc", b"0", b"", b"1", b"0", b""], "packed int32"),
        ([b"ABORT"], "ABORT: 1 frames"),
        ([b"ABORT", b"r"], "ABORT: room must be an integer"),
        ([b"None"] + [b""] * 8, "REGISTER: 9 frames, expected 20"),
        (
            [b"None", b"ip", b"1", b"s", b"\0" * 8, b"", b"", b"0", b"1", b"64"]
            + [b""] * 9
            + [b"\0" * 16],
            "REGISTER: 1 kv ptrs but 2 item lens",
        ),
        ([b"BOOTSTRAP", b"1", b"ip", b"1"], "BOOTSTRAP: not served"),
        ([b"None", b"ip", b"1", b"s", b"\0" * 8 * 5000] + [b""] * 15, "5000 entries"),
        ([b"1", b"ip", b"1", b"s", b"\0" * 4 * ((1 << 20) + 1), b"0", b"", b"1", b"0", b""],
         "1048577 destination pages"),
    ],
)
def test_malformed_prefill_messages_name_what_is_wrong(frames: list, message: str) -> None:
    with pytest.raises(ControlMessageError, match=message):
        parse_to_prefill(frames)


def test_malformed_decode_messages() -> None:
    with pytest.raises(ControlMessageError, match="status 9 is not a KVPoll value"):
        parse_to_decode([b"1", b"9", b"0"])
    with pytest.raises(ControlMessageError, match="ABORT_ACK: 2 frames"):
        parse_to_decode([b"ABORT_ACK", b"1"])


# ---------------------------------------------------------------- geometry and rows
def test_geometry_of_pools_and_its_mismatches() -> None:
    mha = MHATokenToKVPool(64, 16, torch.float32, 2, 16, 3, "cpu", v_head_dim=8)
    geo = KVGeometry.from_pool(mha)
    assert geo == KVGeometry.from_json(geo.to_json())
    assert geo.item_lens() == [16 * 2 * 16 * 4] * 3 + [16 * 2 * 8 * 4] * 3
    assert [b.data_ptr() for b in layer_buffers(mha)] == (
        [t.data_ptr() for t in mha.k_buffer] + [t.data_ptr() for t in mha.v_buffer])  # fmt: skip
    assert pool_region(mha)[1] == mha.mem_bytes()
    mla = MLATokenToKVPool(64, 16, torch.bfloat16, 32, 8, 2, "cpu")
    lat = KVGeometry.from_pool(mla)
    assert (lat.kind, lat.item_lens()) == ("mla", [16 * 40 * 2] * 2)
    assert isinstance(lat.make_pool(32), MLATokenToKVPool)
    assert geo.mismatches(lat)[0] == "kind: 'mha' vs 'mla'"
    other = KVGeometry("mha", 3, 16, "float32", 2, 32, 8)
    assert geo.mismatches(other) == ["head_dim: 16 vs 32"]
    with pytest.raises(ValueError, match="geometry head_dim must be a positive integer"):
        KVGeometry("mha", 3, 16, "float32", 2, 0, 8)
    with pytest.raises(ValueError, match="unknown fields"):
        KVGeometry.from_json('{"kind": "mha", "heads": 2}')


def test_metadata_rows_are_sglangs_ten_buffers() -> None:
    rows = MetadataBuffers(4)
    # output ids, cached tokens, logprob val/idx, top logprobs val/idx, top-k p/index, hidden
    # states (16 float32 without speculative decoding), bootstrap room: SGLang's row lengths
    assert rows.row_lens == [64, 64, 64, 64, 512, 512, 64, 128, 64, 64]
    assert len(rows.regions()) == len(rows.ptrs) == 10
    rows.output_token_logprobs_val[2] = 7.0  # a previous owner's leftovers
    rows.set_row(2, first_token=17, cached_tokens=48, room=(1 << 62) + 5, by_tier=(16, 24, 8))
    assert rows.get_row(2) == (17, 48, (1 << 62) + 5) and rows.get_row(1) == (0, 0, 0)
    assert rows.cached_tokens[2, :7].tolist() == [48, 16, 24, 8, 0, 0, 0]
    assert not rows.output_token_logprobs_val[2].any()  # zeroed: a decode reads them
    rows.clear_row(2)
    assert rows.get_row(2) == (0, 0, 0)
    with pytest.raises(ValueError, match="metadata index 4 is not a row"):
        rows.set_row(4, 1, 0, 1)
    assert KVGeometry("mha", 1, 16, "bfloat16", 1, 8, 8).kv_cache_dtype_str() == "auto"
    assert KVGeometry("mha", 1, 16, "float8_e4m3fn", 1, 8, 8).kv_cache_dtype_str() == "fp8_e4m3"


# ---------------------------------------------------------------- items
def test_runs_are_contiguous_on_both_sides() -> None:
    src = np.array([4, 5, 6, 9, 10, 11, 12])
    dst = np.array([1, 2, 7, 8, 9, 3, 4])
    s0, d0, n = coalesce(src, dst)
    # (4,1)(5,2) | (6,7) | (9,8)(10,9) | (11,3)(12,4)
    assert (s0.tolist(), d0.tolist(), n.tolist()) == ([4, 6, 9, 11], [1, 7, 8, 3], [2, 1, 2, 2])
    assert [x.size for x in coalesce(src[:0], dst[:0])] == [0, 0, 0]


def test_items_address_every_layer_buffer_by_page() -> None:
    geo = KVGeometry("mha", 2, 4, "float32", 1, 2, 2)
    lens = tuple(geo.item_lens())  # 32 bytes a page
    src = SourceMemory((1000, 2000, 3000, 4000), lens, (), (), ())
    reg = _register(geo)
    job = Job(1, "r", 0, np.array([5, 6, 8]), np.array([2, 3, 4]), last=False)
    srcs, dsts, nbytes = kv_items(src, reg, job)
    # runs (5->2, 2 pages) and (8->4, 1 page), for each of the 4 layer buffers
    assert srcs == [p + s * 32 for p in src.layer_ptrs for s in (5, 8)]
    assert dsts == [p + d * 32 for p in reg.kv_ptrs for d in (2, 4)]
    assert nbytes == [64, 32] * 4


# ---------------------------------------------------------------- bootstrap endpoint
SERVER_INFO_KEYS = {  # dataclasses.asdict(PrefillServerInfo) of SGLang 0.5.23, kv_layout popped
    "attn_tp_size", "attn_cp_size", "dp_size", "pp_size", "page_size", "kv_cache_dtype",
    "follow_bootstrap_room", "enable_dsa_cache_layer_split", "decode_allocation_policy",
    "enable_kv_cache_sharding", "prefill_http_port", "target_tp_rank", "target_tp_ranks",
    "target_cp_ranks", "target_pp_ranks", "required_dst_info_num",
    "required_prefill_response_num",
}  # fmt: skip


def _status(url: str, method: str = "GET", body: object = None) -> tuple[int, bytes]:
    data = json.dumps(body).encode() if body is not None else None
    req = urllib.request.Request(url, data=data, method=method)
    try:
        with urllib.request.urlopen(req, timeout=5) as r:
            return r.status, r.read()
    except urllib.error.HTTPError as e:
        return e.code, e.read()


def test_bootstrap_routes_as_sglangs_and_port_in_use() -> None:
    server = BootstrapServer("127.0.0.1", 0)
    base = f"http://{server.addr}"
    allm1 = "/route?prefill_dp_rank=-1&prefill_cp_rank=-1&target_tp_rank=-1&target_pp_rank=-1"
    rank0 = "/route?prefill_dp_rank=0&prefill_cp_rank=0&target_tp_rank=0&target_pp_rank=0"
    try:
        assert _status(base + "/health") == (200, b"OK")
        assert _status(base + allm1)[0] == 503  # no rank registered yet
        assert _status(base + "/route?prefill_dp_rank=0")[0] == 400
        assert _status(base + "/route", "PUT", {"attn_tp_size": 1})[0] == 400
        pool = MHATokenToKVPool(64, 16, torch.float32, 2, 16, 2, "cpu")
        t = PrefillTransport.__new__(PrefillTransport)  # only its registration payload
        t.host, t.page_size, t.geometry = "127.0.0.1", 16, KVGeometry.from_pool(pool)
        t.listener = type("L", (), {"port": 4321})()
        assert _status(base + "/route", "PUT", t.rank_registration()) == (200, b"OK")
        code, body = _status(base + allm1)
        info = json.loads(body)
        assert code == 200 and set(info) == SERVER_INFO_KEYS
        assert (info["page_size"], info["kv_cache_dtype"], info["attn_tp_size"]) == (16, "auto", 1)
        assert info["decode_allocation_policy"] == "early" and info["follow_bootstrap_room"]
        assert json.loads(_status(base + rank0)[1]) == {"rank_ip": "127.0.0.1", "rank_port": 4321}
        assert _status(base + rank0.replace("target_tp_rank=0", "target_tp_rank=1"))[0] == 404
        dp = {"bootstrap_room": 9, "dp_rank": 0}
        assert _status(base + "/register_dp_rank", "POST", dp)[0] == 200
        assert json.loads(_status(base + "/query_dp_ranks", "POST",
                                  {"bootstrap_rooms": [9, 10]})[1]) == {"9": 0}  # fmt: skip
        assert fetch_route(server.addr) == (info, {"rank_ip": "127.0.0.1", "rank_port": 4321})
        with pytest.raises(ValueError, match=f"--disaggregation-bootstrap-port {server.port}"):
            BootstrapServer("127.0.0.1", server.port)
    finally:
        server.close()
    with pytest.raises(BootstrapUnreachable, match=server.addr):
        fetch_route(server.addr, timeout_s=1)


# ---------------------------------------------------------------- prefill-side control plane
@pytest.fixture
def transport():  # noqa: ANN201
    pool = MHATokenToKVPool(256, 16, torch.float32, 2, 16, 2, "cpu")
    t = PrefillTransport(pool, MetadataBuffers(8), "127.0.0.1", 0)
    yield t
    t.check_integrity()
    t.close()


class _Endpoint:
    """A decode rank's PULL socket: what the prefill side pushed to it."""

    def __init__(self) -> None:
        self.sock = zmq.Context.instance().socket(zmq.PULL)
        self.sock.setsockopt(zmq.LINGER, 0)
        self.port = self.sock.bind_to_random_port("tcp://127.0.0.1")

    def recv(self, timeout_s: float = 2.0) -> list[bytes] | None:
        if self.sock.poll(int(timeout_s * 1000)):
            return self.sock.recv_multipart()
        return None

    def close(self) -> None:
        self.sock.close(linger=0)


@pytest.fixture
def endpoint():  # noqa: ANN201
    e = _Endpoint()
    yield e
    e.close()


def test_register_of_another_geometry_is_refused_and_fails_its_rooms(transport, endpoint) -> None:
    theirs = KVGeometry("mha", 2, 16, "float32", 2, 32, 32)
    transport._on_message(_register(theirs, port=endpoint.port).to_frames())
    assert transport.sessions == {}  # no worker, no engine for it
    why = transport.rejected["127.0.0.1:15000"]
    assert "another KV geometry" in why and "[4096]" in why and "[2048]" in why
    room = transport.create_room(11, "r", 40)
    transport._on_message(Meta(11, "127.0.0.1", endpoint.port, "127.0.0.1:15000", (1, 2, 3),
                               0, 0).to_frames())  # fmt: skip
    assert room.status == KVPoll.Failed and room.failure == why
    assert endpoint.recv() == [b"11", b"0", b"0"]  # STATUS Failed to the endpoint it registered


@pytest.mark.parametrize(
    "change, message",
    [
        (dict(attn_tp_size=2), "attention TP 2"),
        (dict(dcp_size=2), "decode context parallelism"),
        (dict(kv_layer_ids=(0, 1)), "hybrid model"),
        (dict(aux_ptrs=(1, 2, 3)), "3 metadata buffers"),
    ],
)
def test_register_of_an_unserved_mode_is_refused(transport, change, message) -> None:
    reg = dataclasses.replace(_register(KVGeometry.from_pool(transport.pool)), **change)
    transport._on_message(reg.to_frames())
    assert transport.sessions == {} and message in transport.rejected[reg.session]


def test_meta_from_an_unregistered_session_fails_the_room(transport) -> None:
    room = transport.create_room(11, "r", 40)
    transport._on_message(Meta(11, "127.0.0.1", 4000, "127.0.0.1:9", (1, 2, 3), 0, 0).to_frames())
    assert room.status == KVPoll.Failed and "unregistered decode" in room.failure
    assert transport.errors and "unregistered decode" in transport.errors[-1]


def test_replies_go_only_to_registered_endpoints(transport, endpoint) -> None:
    stranger = _Endpoint()
    try:
        # META and ABORT for unknown rooms naming an endpoint no REGISTER named: no reply
        transport._on_message(Meta(77, "127.0.0.1", stranger.port, "s", (1,), 0, 0).to_frames())
        transport._on_message(Abort(78, "127.0.0.1", stranger.port, 1).to_frames())
        assert stranger.recv(0.5) is None and transport.counts["unknown_room"] == 1
        # a registered decode's ABORT (with a generation) of a room this rank forgot: acked
        transport._on_message(_register(KVGeometry.from_pool(transport.pool),
                                        port=endpoint.port).to_frames())  # fmt: skip
        transport._on_message(Abort(99, "127.0.0.1", endpoint.port, 5).to_frames())
        assert endpoint.recv() == [b"ABORT_ACK", b"99", b"0", b"5"]
        transport._on_message(Abort(98, "127.0.0.1", endpoint.port).to_frames())
        assert endpoint.recv(0.5) is None  # no generation: no ack (SGLang's deferred release)
    finally:
        stranger.close()


def test_register_never_rewrites_a_live_session(transport, endpoint) -> None:
    geo = KVGeometry.from_pool(transport.pool)
    transport._on_message(_register(geo, port=endpoint.port).to_frames())
    session = transport.sessions["127.0.0.1:15000"]
    forged = dataclasses.replace(_register(geo, port=endpoint.port + 1), kv_ptrs=(1,) * 4)
    with pytest.raises(ControlMessageError, match="live decode session 127.0.0.1:15000"):
        transport._on_message(forged.to_frames())
    bad = dataclasses.replace(forged, attn_tp_size=2)
    with pytest.raises(ControlMessageError, match="live session refused"):
        transport._on_message(bad.to_frames())
    assert transport.sessions["127.0.0.1:15000"] is session and session.reg.kv_ptrs[0] == 1 << 20
    transport._on_message(_register(geo, port=endpoint.port).to_frames())  # its own: idempotent
    assert transport.sessions["127.0.0.1:15000"] is session


# ---------------------------------------------------------------- engine calls
class _RecordingTE:
    """Stands in for Mooncake's ``TransferEngine``: records each batch call; ``fail_at``
    makes that call (0-based) return -1."""

    def __init__(self, fail_at: int | None = None) -> None:
        self.calls: list[tuple[str, list[int], list[int], list[int]]] = []
        self.fail_at = fail_at

    def batch_transfer_sync_write(self, session, srcs, dsts, lens) -> int:  # noqa: ANN001
        self.calls.append((session, srcs, dsts, lens))
        return -1 if len(self.calls) - 1 == self.fail_at else 0


def test_a_write_is_cut_into_calls_of_at_most_1024_items_and_stops_at_a_failure() -> None:
    assert MAX_ITEMS_PER_CALL == 1024
    n = 2 * MAX_ITEMS_PER_CALL + 452
    srcs, dsts, lens = list(range(n)), list(range(10**6, 10**6 + n)), [64] * n
    engine = KVTransferEngine.__new__(KVTransferEngine)  # no Mooncake engine behind it
    engine._te = _RecordingTE()
    assert engine.write("s", srcs, dsts, lens) == 0
    assert [len(c[1]) for c in engine._te.calls] == [1024, 1024, 452]
    assert [x for c in engine._te.calls for x in c[1]] == srcs  # in order, each item once
    assert [x for c in engine._te.calls for x in c[2]] == dsts
    engine._te = _RecordingTE(fail_at=1)
    assert engine.write("s", srcs, dsts, lens) == -1
    assert len(engine._te.calls) == 2  # nothing after the failed call


def test_a_meta_before_its_room_waits_and_a_late_one_is_failed(transport, endpoint) -> None:
    geo = KVGeometry.from_pool(transport.pool)
    transport._on_message(_register(geo, port=endpoint.port).to_frames())
    # the router reached decode first: its META waits for the room (SGLang keeps it too)
    meta = Meta(21, "127.0.0.1", endpoint.port, "127.0.0.1:15000", (1, 2, 3), 0, 0)
    transport._on_message(meta.to_frames())
    assert transport.stats()["early_metas"] == 1 and transport.counts["unknown_room"] == 0
    room = transport.create_room(21, "r", 40)
    assert room.status == KVPoll.WaitingForInput and room.meta == meta
    assert transport.stats()["early_metas"] == 0
    # a META after the room concluded (its bootstrap timed out): STATUS Failed to that decode
    transport.fail_room(room, "timed out (test)")
    assert endpoint.recv() == [b"21", b"0", b"0"]
    assert 21 not in transport.rooms
    transport._on_message(meta.to_frames())
    assert endpoint.recv() == [b"21", b"0", b"0"]
    assert transport.stats()["early_metas"] == 0


def test_early_metas_are_bounded_in_number_and_age() -> None:
    pool = MHATokenToKVPool(256, 16, torch.float32, 2, 16, 2, "cpu")
    limits = ControlLimits(early_metas=4, early_meta_s=0.5)
    t = PrefillTransport(pool, MetadataBuffers(8), "127.0.0.1", 0, limits=limits)
    try:
        t._on_message(_register(KVGeometry.from_pool(pool)).to_frames())
        for room in range(100, 110):
            t._on_message(Meta(room, "127.0.0.1", 4000, "127.0.0.1:15000", (1, 2, 3), 0,
                               0).to_frames())  # fmt: skip
        assert sorted(t._early) == [106, 107, 108, 109]  # the oldest went first
        assert t.create_room(100, "old", 40).status == KVPoll.Bootstrapping
        time.sleep(1.2)  # the housekeeper drops the stale ones
        assert t.stats()["early_metas"] == 0
        assert t.create_room(109, "late", 40).status == KVPoll.Bootstrapping
    finally:
        t.close()


def test_the_opt_in_shared_secret_keeps_out_who_lacks_it() -> None:
    pool = MHATokenToKVPool(256, 16, torch.float32, 2, 16, 2, "cpu")
    t = PrefillTransport(pool, MetadataBuffers(8), "127.0.0.1", 0, secret="s3cret")
    geo = KVGeometry.from_pool(pool)
    try:
        base = f"http://{t.bootstrap.addr}"
        assert _status(base + "/health")[0] == 403  # SGLang's decode, or anyone without it
        assert http(t.bootstrap.addr, "/health", secret="s3cret") == b"OK"
        assert fetch_route(t.bootstrap.addr, secret="s3cret")[1]["rank_port"] == t.listener.port
        endpoint = ("127.0.0.1", t.listener.port)
        plain, wrong, right = Pusher(), Pusher(secret="other"), Pusher(secret="s3cret")
        try:
            plain.push(endpoint, _register(geo, "127.0.0.1:1").to_frames())
            wrong.push(endpoint, _register(geo, "127.0.0.1:2").to_frames())
            right.push(endpoint, _register(geo, "127.0.0.1:3").to_frames())
            deadline = time.monotonic() + 10
            while "127.0.0.1:3" not in t.sessions and time.monotonic() < deadline:
                time.sleep(0.01)
            time.sleep(0.3)
            assert set(t.sessions) == {"127.0.0.1:3"} and t.listener.messages == 1
        finally:
            for p in (plain, wrong, right):
                p.close()
    finally:
        t.close()
