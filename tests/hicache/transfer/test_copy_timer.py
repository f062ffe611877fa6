"""A controller with a ``CopyTimer``: each ack carries its modelled end, is popped only once the
timer's clock passed it, copies of one direction queue behind each other, a backup starts after
the newest load, and a blocking wait moves the clock to the copy's end."""

from __future__ import annotations

import pytest
import torch

from hicache_prefill.hicache.memory.allocator import TokenToKVPoolAllocator
from hicache_prefill.hicache.memory.device_pool import MHATokenToKVPool
from hicache_prefill.hicache.memory.host_pool import make_host_pool
from hicache_prefill.hicache.transfer.controller import HiCacheController
from hicache_prefill.hicache.transfer.streams import make_streams
from hicache_prefill.prefill.clock import VirtualClock


def approx(x: float) -> object:
    return pytest.approx(x, rel=1e-9, abs=1e-12)


class Timer:
    """1 ms per copy plus 0.1 ms per token, on a virtual clock."""

    def __init__(self) -> None:
        self.clock = VirtualClock()

    def now(self) -> float:
        return self.clock.now()

    def wait_until(self, t: float) -> None:
        self.clock.wait_until(t)

    def copy_seconds(self, direction: str, tokens: int) -> float:
        return 1e-3 + 1e-4 * tokens


def make(timer: Timer) -> HiCacheController:
    pool = MHATokenToKVPool(64, 1, torch.float32, 2, 4, 2, "cpu")
    host = make_host_pool(pool, 2.0, 0, "layer_first")
    alloc = TokenToKVPoolAllocator(64, 1, "cpu")
    return HiCacheController(
        alloc, pool, host, "kernel", streams=make_streams("cpu", 0.0, "inline"), copy_timer=timer
    )


def test_backups_are_acked_at_their_modelled_end_in_fifo_order() -> None:
    timer = Timer()
    c = make(timer)
    c.write(c.device_allocator.alloc(10), node_id=1)  # ends at 2 ms
    c.write(c.device_allocator.alloc(20), node_id=2)  # queues behind: ends at 2 + 3 = 5 ms
    assert [a.ready_at for a in c.ack_write_queue] == [approx(2e-3), approx(5e-3)]
    assert c.count_finished_writes() == 0 and c.writing_check() == []
    assert c.next_ack_time() == approx(2e-3)
    timer.clock.wait_until(2e-3)
    assert c.writing_check() == [1]
    assert c.next_ack_time() == approx(5e-3)
    assert c.wait_write([2]) == [2]  # a blocking wait moves the clock to the copy's end
    assert timer.now() == approx(5e-3)
    assert c.next_ack_time() is None
    c.check_integrity()


def test_a_backup_starts_after_the_newest_load_and_loads_report_their_end() -> None:
    timer = Timer()
    c = make(timer)
    d = c.device_allocator.alloc(10)
    h = c.write(d, node_id=1)
    timer.clock.wait_until(1.0)
    c.wait_all()
    c.evict_device(d)
    assert c.load(h, node_id=2) is not None
    c.start_loading()
    assert c.loads_ready_at() == approx(1.0 + 2e-3)
    c.write(c.device_allocator.alloc(5), node_id=3)
    assert c.ack_write_queue[-1].ready_at == approx(1.0 + 2e-3 + 1.5e-3)
    assert c.count_finished_loads() == 0
    timer.clock.wait_until(1.0 + 2e-3)
    assert c.loading_check() == [2]
    assert c.loads_ready_at() is None
    c.check_integrity()


def test_without_a_timer_acks_carry_no_time() -> None:
    pool = MHATokenToKVPool(16, 1, torch.float32, 2, 4, 2, "cpu")
    alloc = TokenToKVPoolAllocator(16, 1, "cpu")
    c = HiCacheController(
        alloc,
        pool,
        make_host_pool(pool, 2.0, 0, "layer_first"),
        "kernel",
        streams=make_streams("cpu", 0.0, "inline"),
    )
    c.write(alloc.alloc(4), node_id=1)
    assert c.ack_write_queue[0].ready_at is None and c.next_ack_time() is None
    assert c.writing_check() == [1]
