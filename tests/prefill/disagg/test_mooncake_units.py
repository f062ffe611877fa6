"""The Mooncake transport's pieces that need no engine and no second process: control messages
and their framing, the KV geometry and metadata rows, the address of every item, the bootstrap
endpoint, and the prefill side's refusal of a decode of another geometry or a bad META."""

from __future__ import annotations

import json
import socket
import urllib.request

import numpy as np
import pytest
import torch

from hicache_prefill.hicache.memory.device_pool import MHATokenToKVPool, MLATokenToKVPool
from hicache_prefill.prefill.disagg.mooncake.bootstrap import (
    BootstrapServer,
    BootstrapUnreachable,
    fetch_route,
)
from hicache_prefill.prefill.disagg.mooncake.engine import MAX_ITEMS_PER_CALL, KVTransferEngine
from hicache_prefill.prefill.disagg.mooncake.layout import (
    KVGeometry,
    MetadataBuffers,
    layer_buffers,
    pool_region,
)
from hicache_prefill.prefill.disagg.mooncake.sender import PrefillTransport
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
    encode_frames,
    parse_to_decode,
    parse_to_prefill,
    read_frames,
)
from hicache_prefill.prefill.disagg.protocol import KVPoll


def _reader(data: bytes):  # noqa: ANN202
    buf = bytearray(data)

    def read(n: int) -> bytes:
        out = bytes(buf[:n])
        del buf[:n]
        return out

    return read


def _register(geometry: KVGeometry, session: str = "127.0.0.1:15000") -> Register:
    n = len(geometry.item_lens())
    return Register("127.0.0.1", 4000, session, tuple(range(1 << 20, (1 << 20) + n)),
                    (1, 2, 3), tuple(geometry.item_lens()), (64, 64, 64),
                    geometry.to_json())  # fmt: skip


# ---------------------------------------------------------------- messages
def test_messages_round_trip_through_their_frames() -> None:
    geo = KVGeometry("mha", 2, 16, "float32", 2, 16, 16)
    msgs = [
        _register(geo),
        Meta(5, "127.0.0.1", 4000, "127.0.0.1:15000", (3, 4, 9), 7, 16),
        Abort(5, "127.0.0.1", 4000),
    ]
    for m in msgs:
        frames = read_frames(_reader(encode_frames(m.to_frames())))
        assert parse_to_prefill(frames) == m
    for m in (Status(5, int(KVPoll.Success)), AbortAck(5)):
        assert parse_to_decode(m.to_frames()) == m


@pytest.mark.parametrize(
    "frames, message",
    [
        ([], "an empty message"),
        ([b"12", b"127.0.0.1"], "META: 2 frames, expected 9"),
        ([b"x", b"ip", b"1", b"s", b"", b"0", b"", b"1", b"0"], "META: room must be an integer"),
        ([b"1", b"ip", b"1", b"s", b"abc", b"0", b"", b"1", b"0"], "packed int32"),
        ([b"ABORT", b"1", b"ip"], "ABORT: 3 frames, expected 4"),
        ([b"None"] + [b""] * 12, "REGISTER: geometry is not JSON"),
        ([b"None"] + [b""] * 3 + [b"\0" * 8] + [b""] * 8, "REGISTER: 1 kv ptrs but 0 item lens"),
    ],
)
def test_malformed_prefill_messages_name_what_is_wrong(frames: list, message: str) -> None:
    with pytest.raises(ControlMessageError, match=message):
        parse_to_prefill(frames)


def test_malformed_decode_messages_and_frames() -> None:
    with pytest.raises(ControlMessageError, match="status 9 is not a KVPoll value"):
        parse_to_decode([b"1", b"9", b"0"])
    with pytest.raises(ControlMessageError, match="frames in one message"):
        read_frames(_reader(np.array([1000], dtype=">u4").tobytes()))
    with pytest.raises(EOFError):
        read_frames(_reader(encode_frames([b"abc"])[:-1]))


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


def test_metadata_rows() -> None:
    rows = MetadataBuffers(4)
    assert rows.row_lens == [64, 64, 64] and len(rows.regions()) == 3
    rows.set_row(2, first_token=17, cached_tokens=48, room=(1 << 62) + 5)
    assert rows.get_row(2) == (17, 48, (1 << 62) + 5) and rows.get_row(1) == (0, 0, 0)
    rows.clear_row(2)
    assert rows.get_row(2) == (0, 0, 0)
    with pytest.raises(ValueError, match="metadata index 4 is not a row"):
        rows.set_row(4, 1, 0, 1)


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
def test_bootstrap_routes_and_port_in_use() -> None:
    server = BootstrapServer("127.0.0.1", 0, {"page_size": 16}, {"rank_ip": "127.0.0.1",
                                                                  "rank_port": 1234})  # fmt: skip
    try:
        info, rank = fetch_route(server.addr)
        assert info == {"page_size": 16} and rank["rank_port"] == 1234
        base = f"http://{server.addr}"
        assert urllib.request.urlopen(f"{base}/health").read() == b"OK"
        with pytest.raises(urllib.error.HTTPError) as err:
            urllib.request.urlopen(f"{base}/route?prefill_dp_rank=0")
        assert err.value.code == 400
        with pytest.raises(ValueError, match=f"--disaggregation-bootstrap-port {server.port}"):
            BootstrapServer("127.0.0.1", server.port, {}, {})
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
    t.close()


def test_register_of_another_geometry_is_refused_and_fails_its_rooms(transport) -> None:
    theirs = KVGeometry("mha", 2, 16, "float32", 2, 32, 32)
    transport._on_message(_register(theirs).to_frames())
    assert transport.sessions == {}  # no worker, no engine for it
    why = transport.rejected["127.0.0.1:15000"]
    assert "another KV geometry" in why and "head_dim: 16 vs 32" in why
    room = transport.create_room(11, "r", 40)
    transport._on_message(Meta(11, "127.0.0.1", 4000, "127.0.0.1:15000", (1, 2, 3), 0, 0)
                          .to_frames())  # fmt: skip
    assert room.status == KVPoll.Failed and room.failure == why


@pytest.mark.parametrize(
    "meta, message",
    [
        (Meta(11, "127.0.0.1", 4000, "127.0.0.1:9", (1, 2, 3), 0, 0), "unregistered decode"),
        (Meta(11, "127.0.0.1", 4000, "s", (1, 2, 3), 0, 0), "unregistered decode"),
    ],
)
def test_meta_from_an_unregistered_session_fails_the_room(transport, meta, message) -> None:
    room = transport.create_room(11, "r", 40)
    transport._on_message(meta.to_frames())
    assert room.status == KVPoll.Failed and message in room.failure
    assert transport.errors and message in transport.errors[-1]


def test_abort_of_an_unknown_room_is_acked(transport) -> None:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen()
        port = s.getsockname()[1]
        transport._on_message(Abort(99, "127.0.0.1", port).to_frames())
        conn, _ = s.accept()
        with conn:
            frames = read_frames(conn.recv)
    assert parse_to_decode(frames) == AbortAck(99)


def test_server_info_carries_the_geometry(transport) -> None:
    info, rank = fetch_route(transport.bootstrap.addr)
    assert KVGeometry.from_json(info["kv_geometry"]) == transport.geometry
    assert rank == {"rank_ip": "127.0.0.1", "rank_port": transport.listener.port}
    assert json.loads(info["kv_geometry"])["head_dim"] == 16


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
