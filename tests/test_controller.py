"""HiCacheController on CPU streams with injected copy delays: acks, deferred frees, layer waits."""

from __future__ import annotations

import threading
import time

import pytest
import torch

from hicache.allocator import TokenToKVPoolAllocator
from hicache.controller import HiCacheController
from hicache.memory_pool import MHATokenToKVPool, MLATokenToKVPool
from hicache.memory_pool_host import make_host_pool
from hicache.memory_pool_host_base import SUPPORTED_LAYOUT_IO
from hicache.streams import CpuStreams
from tests.kv_content import check_device, check_host, write_device

L = 3


def make(
    page: int = 1, size: int = 32, layout: str = "layer_first", io: str = "kernel",
    mla: bool = False, delay=0.0, ratio: float = 2.0, device: str = "cpu",
) -> HiCacheController:
    if mla:
        pool = MLATokenToKVPool(size, page, torch.float32, 6, 2, L, device)
    else:
        pool = MHATokenToKVPool(size, page, torch.float32, 2, 4, L, device)
    host = make_host_pool(pool, ratio, 0, layout)
    alloc = TokenToKVPoolAllocator(size, page, device)
    streams = CpuStreams(delay) if device == "cpu" else None
    return HiCacheController(alloc, pool, host, io, streams=streams)


def by_stream(write: float, load: float):
    """A delay callable: the write stream is created first (cpu-stream-0), the load stream next."""
    table = {"cpu-stream-0": write, "cpu-stream-1": load}
    return lambda: table[threading.current_thread().name]


def poll(fn, timeout: float = 5.0) -> list[int]:
    out: list[int] = []
    end = time.perf_counter() + timeout
    while time.perf_counter() < end:
        out += fn()
        if out:
            return out
        time.sleep(0.002)
    raise AssertionError("no ack within timeout")


@pytest.mark.parametrize("mla", [False, True])
@pytest.mark.parametrize("layout,io", sorted(SUPPORTED_LAYOUT_IO))
@pytest.mark.parametrize("page", [1, 16])
def test_backup_evict_load_round_trip(mla: bool, layout: str, io: str, page: int) -> None:
    c = make(page=page, size=64, layout=layout, io=io, mla=mla, delay=0.001)
    d = c.device_allocator.alloc(32)
    tokens, positions = torch.arange(100, 132), torch.arange(32)
    write_device(c.device_pool, d, tokens, positions)
    h = c.write(d, node_id=7)
    assert h is not None and h.device.type == "cpu" and h.numel() == 32
    c.check_integrity()
    assert poll(c.writing_check) == [7]
    check_host(c.host_pool, h, tokens, positions)
    c.evict_device(d)
    assert c.device_allocator.available_size() == 64
    d2 = c.load(h, node_id=8)
    assert d2 is not None and c.start_loading() >= 0
    for layer in range(L):
        c.layer_done_counter.wait_until(layer)
    check_device(c.device_pool, d2, tokens, positions)
    assert poll(c.loading_check) == [8]
    c.check_integrity()
    s = c.stats.as_dict()
    assert s["d2h_copies"] == 1 and s["h2d_copies"] == 1
    assert s["d2h_bytes"] == s["h2d_bytes"] == 32 * c.host_pool.size_per_token
    c.close()


def test_device_slot_is_not_reusable_while_a_backup_reads_it() -> None:
    c = make(size=8, delay=0.2)
    d = c.device_allocator.alloc(4)
    write_device(c.device_pool, d, [1, 2, 3, 4], [0, 1, 2, 3])
    h = c.write(d, node_id=1)
    c.evict_device(d)  # the tree frees while the copy is in flight
    assert c.device_in_flight() == 4 and c.device_allocator.available_size() == 4
    c.check_integrity()
    other = c.device_allocator.alloc(4)
    assert not bool(torch.isin(other, d).any())
    assert c.device_allocator.alloc(4) is None
    with pytest.raises(ValueError, match="already freed"):
        c.evict_device(d)
    assert c.wait_write([1]) == [1]
    assert c.device_in_flight() == 0 and c.device_allocator.available_size() == 4
    check_host(c.host_pool, h, [1, 2, 3, 4], [0, 1, 2, 3])  # the copy read intact slots
    c.check_integrity()
    c.close()


def test_host_slot_is_not_reusable_while_a_load_reads_it() -> None:
    c = make(size=8, ratio=1.0, delay=0.1)
    d = c.device_allocator.alloc(4)
    write_device(c.device_pool, d, [5, 6, 7, 8], [0, 1, 2, 3])
    h = c.write(d, node_id=1)
    c.wait_write()
    c.evict_device(d)
    d2 = c.load(h, node_id=2)
    c.evict_host(h)  # queued, not started: still held
    assert c.host_in_flight() == 4 and c.host_allocator.available_size() == 4
    c.start_loading()
    c.check_integrity()
    assert c.host_allocator.alloc(8) is None
    assert poll(c.loading_check) == [2]
    assert c.host_in_flight() == 0 and c.host_allocator.available_size() == 8
    check_device(c.device_pool, d2, [5, 6, 7, 8], [0, 1, 2, 3])
    c.close()


def test_write_acks_complete_in_launch_order() -> None:
    delays = iter([0.15, 0.01, 0.01, 0.01])
    c = make(size=16, delay=lambda: next(delays))
    ids = []
    for i in range(4):
        d = c.device_allocator.alloc(4)
        assert c.write(d, node_id=i) is not None
        ids.append(i)
    seen: list[int] = []
    while len(seen) < 4:
        got = c.writing_check()
        assert got == ids[len(seen): len(seen) + len(got)]  # always a prefix, in order
        seen += got
        time.sleep(0.005)
    assert seen == [0, 1, 2, 3]
    c.close()


def test_layer_wait_blocks_only_until_that_layer_is_loaded() -> None:
    c = make(size=8, delay=by_stream(0.0, 0.25))
    d = c.device_allocator.alloc(4)
    write_device(c.device_pool, d, [1, 2, 3, 4], [0, 1, 2, 3])
    h = c.write(d)
    c.wait_write()
    c.evict_device(d)
    t0 = time.perf_counter()
    c.layer_done_counter.wait_until(L - 1)  # nothing loading: no wait
    assert time.perf_counter() - t0 < 0.05
    d2 = c.load(h, node_id=3)
    pid = c.start_loading()
    lev = c.layer_done_counter.events[pid]
    c.layer_done_counter.wait_until(0)
    waited = time.perf_counter() - t0
    assert 0.2 < waited < 0.6
    assert lev.load_events[0].query() and not lev.load_events[L - 1].query()
    assert torch.equal(c.device_pool.k_buffer[0][d2], c.device_pool.k_buffer[0][d])
    assert c.loading_check() == []  # not finished: non-blocking, nothing popped
    c.layer_done_counter.wait_until(L - 1)
    assert lev.finish_event.query()
    assert c.loading_check() == [3]
    c.close()


def test_load_waits_for_a_backup_still_writing_its_host_slots() -> None:
    c = make(size=8, delay=by_stream(0.3, 0.0))
    d = c.device_allocator.alloc(4)
    write_device(c.device_pool, d, [9, 9, 9, 9], [0, 1, 2, 3])
    h = c.write(d, node_id=1)
    d2 = c.load(h, node_id=2)  # a misbehaving caller: the host copy is not acked yet
    c.start_loading()
    for layer in range(L):
        c.layer_done_counter.wait_until(layer)
    check_device(c.device_pool, d2, [9, 9, 9, 9], [0, 1, 2, 3])
    c.wait_all()
    c.close()


def test_backup_waits_for_a_load_still_writing_its_device_slots() -> None:
    c = make(size=8, delay=by_stream(0.0, 0.1))
    d = c.device_allocator.alloc(4)
    write_device(c.device_pool, d, [4, 3, 2, 1], [0, 1, 2, 3])
    h = c.write(d)
    c.wait_write()
    d2 = c.load(h)
    c.start_loading()
    h2 = c.write(d2, node_id=5)  # reads slots the load has not written yet
    assert c.wait_write([5]) == [5]
    check_host(c.host_pool, h2, [4, 3, 2, 1], [0, 1, 2, 3])
    c.wait_all()
    c.close()


def test_full_pools_return_none_and_change_nothing() -> None:
    c = make(size=8, ratio=0.5)  # host: 4 slots
    d = c.device_allocator.alloc(8)
    assert c.write(d) is None and c.host_allocator.available_size() == 4
    h = c.write(d[:4])
    c.wait_write()
    assert c.load(h) is None and not c.load_queue
    assert c.start_loading() == -1
    c.check_integrity()
    c.close()


@pytest.mark.parametrize(
    "call",
    [
        lambda c, d: c.write(d.to(torch.int32)),
        lambda c, d: c.write(d[:3]),  # page 4: not whole pages
        lambda c, d: c.load(torch.tensor([0, 1, 2], dtype=torch.int64)),
        lambda c, d: c.load(torch.arange(100, 104)),
        lambda c, d: c.evict_device(d[1:5]),
        lambda c, d: c.evict_host(torch.arange(0, 4)),  # not allocated
    ],
)
def test_bad_calls_raise_and_change_nothing(call) -> None:
    c = make(page=4, size=16)
    d = c.device_allocator.alloc(8)
    before = (c.device_allocator.available_size(), c.host_allocator.available_size())
    with pytest.raises(ValueError):
        call(c, d)
    assert (c.device_allocator.available_size(), c.host_allocator.available_size()) == before
    assert not c.ack_write_queue and not c.load_queue
    c.check_integrity()
    c.close()


def test_double_evict_raises() -> None:
    c = make(size=8)
    d = c.device_allocator.alloc(4)
    c.evict_device(d)
    with pytest.raises(ValueError):
        c.evict_device(d)
    c.check_integrity()
    c.close()


def test_unsupported_io_backend_for_layout() -> None:
    with pytest.raises(ValueError, match="io_backend"):
        make(layout="page_first", io="direct")


@pytest.mark.gpu
@pytest.mark.parametrize("layout,io", sorted(SUPPORTED_LAYOUT_IO))
def test_cuda_round_trip_with_pinned_host_pool(layout: str, io: str) -> None:
    c = make(page=16, size=128, layout=layout, io=io, device="cuda")
    assert c.host_pool.pinned and c.host_pool.kv_buffer.is_pinned()
    d = c.device_allocator.alloc(64)
    tokens, positions = torch.arange(64), torch.arange(64)
    write_device(c.device_pool, d, tokens, positions)
    h = c.write(d, node_id=1)
    assert c.wait_write([1]) == [1]
    check_host(c.host_pool, h, tokens, positions)
    c.evict_device(d)
    d2 = c.load(h, node_id=2)
    c.start_loading()
    for layer in range(L):
        c.layer_done_counter.wait_until(layer)  # a stream wait: the host does not block
    torch.cuda.current_stream().synchronize()
    check_device(c.device_pool, d2, tokens, positions)
    assert c.wait_all()[1] == [2]
    c.host_pool.destroy()


def test_backup_of_slots_a_queued_load_will_write_is_refused() -> None:
    c = make(size=8)
    d = c.device_allocator.alloc(4)
    h = c.write(d)
    c.wait_write()
    d2 = c.load(h)
    with pytest.raises(ValueError, match="start_loading"):
        c.write(d2)
    assert c.host_allocator.available_size() == 12
    c.start_loading()
    assert c.write(d2) is not None  # launched loads are waited for instead
    c.wait_all()
    c.close()
