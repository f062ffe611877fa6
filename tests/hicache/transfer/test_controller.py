"""HiCacheController on CPU streams: acks, deferred frees, layer waits.

Copies that must still be in flight when the test looks are held by gates (a copy delay that
blocks until the test opens it), so what has run when is decided by the test, never by timing.
"""

from __future__ import annotations

import threading

import pytest
import torch

from hicache_prefill.hicache.memory.allocator import TokenToKVPoolAllocator
from hicache_prefill.hicache.memory.device_pool import MHATokenToKVPool, MLATokenToKVPool
from hicache_prefill.hicache.memory.host_pool import SUPPORTED_LAYOUT_IO, make_host_pool
from hicache_prefill.hicache.transfer.controller import HiCacheController
from hicache_prefill.hicache.transfer.streams import make_streams
from tests.support.kv_content import check_device, check_host, write_device

L = 3


def make(
    page: int = 1,
    size: int = 32,
    layout: str = "layer_first",
    io: str = "kernel",
    mla: bool = False,
    delay=0.0,
    ratio: float = 2.0,
    device: str = "cpu",
    streams: str = "thread",
) -> HiCacheController:
    if mla:
        pool = MLATokenToKVPool(size, page, torch.float32, 6, 2, L, device)
    else:
        pool = MHATokenToKVPool(size, page, torch.float32, 2, 4, L, device)
    host = make_host_pool(pool, ratio, 0, layout)
    alloc = TokenToKVPoolAllocator(size, page, device)
    factory = make_streams(device, delay, streams) if device == "cpu" else None
    return HiCacheController(alloc, pool, host, io, streams=factory)


class Gates:
    """A copy delay: the ``i``-th copy a stream runs waits until ``open(stream, i)`` (or
    ``open_all``). The write stream is created first (cpu-stream-0), the load stream next.
    Streams not named in ``gated`` run freely."""

    def __init__(self, gated: tuple[str, ...] = ("write", "load")) -> None:
        self.gated = {{"write": "cpu-stream-0", "load": "cpu-stream-1"}[g] for g in gated}
        self._lock = threading.Lock()
        self._events: dict[tuple[str, int], threading.Event] = {}
        self._calls: dict[str, int] = {}
        self._all = threading.Event()

    def _event(self, stream: str, i: int) -> threading.Event:
        with self._lock:
            return self._events.setdefault((stream, i), threading.Event())

    def __call__(self) -> float:
        name = threading.current_thread().name
        if name not in self.gated:
            return 0.0
        with self._lock:
            i = self._calls.get(name, 0)
            self._calls[name] = i + 1
        ev = self._event(name, i)
        while not ev.is_set() and not self._all.is_set():
            ev.wait(0.01)
        return 0.0

    def open(self, stream: str, i: int) -> None:
        self._event({"write": "cpu-stream-0", "load": "cpu-stream-1"}[stream], i).set()

    def open_all(self) -> None:
        self._all.set()


def finished(c: HiCacheController, check) -> list[int]:
    """Acks of every launched copy: wait for both streams, then poll ``check`` once."""
    c.write_stream.synchronize()
    c.load_stream.synchronize()
    return check()


@pytest.mark.parametrize("mla", [False, True])
@pytest.mark.parametrize("layout,io", sorted(SUPPORTED_LAYOUT_IO))
@pytest.mark.parametrize("page", [1, 16])
def test_backup_evict_load_round_trip(
    mla: bool, layout: str, io: str, page: int, stream_mode: str
) -> None:
    c = make(page=page, size=64, layout=layout, io=io, mla=mla, streams=stream_mode)
    d = c.device_allocator.alloc(32)
    tokens, positions = torch.arange(100, 132), torch.arange(32)
    write_device(c.device_pool, d, tokens, positions)
    h = c.write(d, node_id=7)
    assert h is not None and h.device.type == "cpu" and h.numel() == 32
    c.check_integrity()
    assert finished(c, c.writing_check) == [7]
    check_host(c.host_pool, h, tokens, positions)
    c.evict_device(d)
    assert c.device_allocator.available_size() == 64
    d2 = c.load(h, node_id=8)
    assert d2 is not None and c.start_loading() >= 0
    for layer in range(L):
        c.layer_done_counter.wait_until(layer)
    check_device(c.device_pool, d2, tokens, positions)
    assert finished(c, c.loading_check) == [8]
    c.check_integrity()
    s = c.stats.as_dict()
    assert s["d2h_copies"] == 1 and s["h2d_copies"] == 1
    assert s["d2h_bytes"] == s["h2d_bytes"] == 32 * c.host_pool.size_per_token
    c.close()


def test_device_slot_is_not_reusable_while_a_backup_reads_it() -> None:
    gates = Gates()
    c = make(size=8, delay=gates)
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
    gates.open_all()
    assert c.wait_write([1]) == [1]
    assert c.device_in_flight() == 0 and c.device_allocator.available_size() == 4
    check_host(c.host_pool, h, [1, 2, 3, 4], [0, 1, 2, 3])  # the copy read intact slots
    c.check_integrity()
    c.close()


def test_host_slot_is_not_reusable_while_a_load_reads_it() -> None:
    gates = Gates(gated=("load",))
    c = make(size=8, ratio=1.0, delay=gates)
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
    assert c.loading_check() == []  # the load is held: its host slots stay held too
    assert c.host_in_flight() == 4
    gates.open_all()
    assert finished(c, c.loading_check) == [2]
    assert c.host_in_flight() == 0 and c.host_allocator.available_size() == 8
    check_device(c.device_pool, d2, [5, 6, 7, 8], [0, 1, 2, 3])
    c.close()


def test_write_acks_complete_in_launch_order() -> None:
    gates = Gates()
    c = make(size=16, delay=gates)
    for i in range(4):
        d = c.device_allocator.alloc(4)
        assert c.write(d, node_id=i) is not None
    assert c.writing_check() == []  # nothing ran yet
    gates.open("write", 0)
    gates.open("write", 1)
    c.ack_write_queue[1].finish_event.synchronize()
    assert c.writing_check() == [0, 1]  # a prefix, in order
    gates.open_all()
    assert finished(c, c.writing_check) == [2, 3]
    c.close()


def test_acks_are_counted_then_popped_exactly_n() -> None:
    """What the tensor-parallel tick agrees on: this rank's leading finished acks (0 for an
    empty queue); ``writing_check(n)`` then pops exactly ``n``, ``n`` past the queue is
    refused (nothing popped)."""
    gates = Gates()
    c = make(size=16, delay=gates)
    assert (c.count_finished_writes(), c.count_finished_loads()) == (0, 0)
    for i in range(3):
        c.write(c.device_allocator.alloc(4), node_id=i)
    gates.open("write", 0)
    c.ack_write_queue[0].finish_event.synchronize()
    assert c.count_finished_writes() == 1  # the next copy is held by its gate
    assert c.writing_check(0) == [] and len(c.ack_write_queue) == 3
    with pytest.raises(ValueError, match="n must be an int in \\[0, 3\\]"):
        c.writing_check(4)
    assert c.writing_check(1) == [0] and c.count_finished_writes() == 0
    gates.open_all()
    assert c.writing_check(2) == [1, 2]  # n beyond what had finished waits for those copies
    assert c.count_finished_writes() == 0 and c.loading_check(0) == []
    c.close()


def test_layer_wait_blocks_only_until_that_layer_is_loaded() -> None:
    gates = Gates(gated=("load",))
    c = make(size=8, delay=gates)
    d = c.device_allocator.alloc(4)
    write_device(c.device_pool, d, [1, 2, 3, 4], [0, 1, 2, 3])
    h = c.write(d)
    c.wait_write()
    c.evict_device(d)
    c.layer_done_counter.wait_until(L - 1)  # nothing loading: returns at once (no load event)
    d2 = c.load(h, node_id=3)
    pid = c.start_loading()
    lev = c.layer_done_counter.events[pid]
    assert not lev.load_events[0].query()  # layer 0's copy is held by its gate
    gates.open("load", 0)  # the first callable on the load stream copies layer 0
    c.layer_done_counter.wait_until(0)  # returns once layer 0 is loaded, not the others
    assert lev.load_events[0].query() and not lev.load_events[L - 1].query()
    assert torch.equal(c.device_pool.k_buffer[0][d2], c.device_pool.k_buffer[0][d])
    assert c.loading_check() == []  # not finished: non-blocking, nothing popped
    gates.open_all()
    c.layer_done_counter.wait_until(L - 1)
    assert lev.finish_event.query()
    assert c.loading_check() == [3]
    c.close()


def test_load_waits_for_a_backup_still_writing_its_host_slots() -> None:
    gates = Gates(gated=("write",))
    c = make(size=8, delay=gates)
    d = c.device_allocator.alloc(4)
    write_device(c.device_pool, d, [9, 9, 9, 9], [0, 1, 2, 3])
    h = c.write(d, node_id=1)
    d2 = c.load(h, node_id=2)  # a misbehaving caller: the host copy is not acked yet
    pid = c.start_loading()
    lev = c.layer_done_counter.events[pid]
    c.load_stream.submit(lambda: None)
    fence = c.load_stream.record()
    assert not lev.load_events[0].query() and not fence.query()  # waiting for the backup
    gates.open_all()
    for layer in range(L):
        c.layer_done_counter.wait_until(layer)
    check_device(c.device_pool, d2, [9, 9, 9, 9], [0, 1, 2, 3])
    c.wait_all()
    c.close()


def test_backup_waits_for_a_load_still_writing_its_device_slots() -> None:
    gates = Gates(gated=("load",))
    c = make(size=8, delay=gates)
    d = c.device_allocator.alloc(4)
    write_device(c.device_pool, d, [4, 3, 2, 1], [0, 1, 2, 3])
    h = c.write(d)
    c.wait_write()
    d2 = c.load(h)
    c.start_loading()
    h2 = c.write(d2, node_id=5)  # reads slots the load has not written yet
    assert not c.ack_write_queue[-1].finish_event.query()  # held behind the load
    gates.open_all()
    assert c.wait_write([5]) == [5]
    check_host(c.host_pool, h2, [4, 3, 2, 1], [0, 1, 2, 3])
    c.wait_all()
    c.close()


def test_deferred_free_fires_and_releases_at_that_copys_ack() -> None:
    """Many backups in flight; the tree frees the device slots of two of them (copy 3 and copy
    9) and of slots no copy uses. Unused slots are free at once; each held page comes back at
    its own copy's ack, not before and not at another copy's."""
    gates = Gates(gated=("write",))
    c = make(page=4, size=64, delay=gates)
    slots = [c.device_allocator.alloc(4) for _ in range(12)]
    for i in range(10):
        assert c.write(slots[i], node_id=i) is not None
    free_before = c.device_allocator.available_size()
    c.evict_device(torch.cat([slots[3], slots[10]]))  # slots[10]: no copy reads it
    c.evict_device(slots[9])
    assert c.device_in_flight() == 8
    assert c.device_allocator.available_size() == free_before + 4
    c.check_integrity()
    for i in range(4):
        gates.open("write", i)
    c.ack_write_queue[3].finish_event.synchronize()
    assert c.writing_check() == [0, 1, 2, 3]  # copy 3's ack: its slots come back
    assert c.device_in_flight() == 4
    assert c.device_allocator.available_size() == free_before + 8
    assert not c.device_allocator.is_allocated(slots[3])
    assert c.device_allocator.is_allocated(slots[9])  # copy 9 still reads them
    c.check_integrity()
    gates.open_all()
    assert finished(c, c.writing_check) == [4, 5, 6, 7, 8, 9]
    assert c.device_in_flight() == 0
    assert c.device_allocator.available_size() == free_before + 12
    c.check_integrity()
    c.close()


def test_frees_do_not_scan_the_copies_in_flight() -> None:
    """Freeing asks the per-page busy counts, never the list of copies (whose scan made every
    free cost O(copies in flight))."""
    gates = Gates(gated=("write",))
    c = make(page=1, size=256, delay=gates)
    for i in range(100):
        c.write(c.device_allocator.alloc(2), node_id=i)
    other = c.device_allocator.alloc(8)
    host_other = c.host_allocator.alloc(8)

    def no_scan():
        raise AssertionError("scanned the copies in flight")

    c.inflight_slots = no_scan
    c.evict_device(other)
    c.evict_host(host_other)
    assert c.device_in_flight() == 0 and c.host_in_flight() == 0
    gates.open_all()
    assert len(finished(c, c.writing_check)) == 100
    del c.inflight_slots
    c.check_integrity()
    c.close()


def test_full_pools_return_none_and_change_nothing(stream_mode: str) -> None:
    c = make(size=8, ratio=0.5, streams=stream_mode)  # host: 4 slots
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
def test_bad_calls_raise_and_change_nothing(call, stream_mode: str) -> None:
    c = make(page=4, size=16, streams=stream_mode)
    d = c.device_allocator.alloc(8)
    before = (c.device_allocator.available_size(), c.host_allocator.available_size())
    with pytest.raises(ValueError):
        call(c, d)
    assert (c.device_allocator.available_size(), c.host_allocator.available_size()) == before
    assert not c.ack_write_queue and not c.load_queue
    c.check_integrity()
    c.close()


def test_double_evict_raises(stream_mode: str) -> None:
    c = make(size=8, streams=stream_mode)
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


def test_backup_of_slots_a_queued_load_will_write_is_refused(stream_mode: str) -> None:
    c = make(size=8, streams=stream_mode)
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
