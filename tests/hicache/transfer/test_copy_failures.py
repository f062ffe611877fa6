"""HiCacheController when a copy fails, in both CPU stream modes.

Inline streams (CUDA's launch semantics): the failing call raises one error naming the op and
argument, and the controller is exactly as before the call. Thread streams: the call returns,
the copy fails on the worker, its ack reports the failure (``take_failure``), and the stream
keeps working. Failures are injected into every op the controller reaches: the kernel ops of
each layout and io backend (direct ops included), the host pool's per-layer load and all-layer
backup, and the index move.
"""

from __future__ import annotations

import threading

import pytest
import torch

from hicache_prefill.hicache.memory.allocator import TokenToKVPoolAllocator
from hicache_prefill.hicache.memory.device_pool import MHATokenToKVPool, MLATokenToKVPool
from hicache_prefill.hicache.memory.host_pool import make_host_pool
from hicache_prefill.hicache.transfer.controller import HiCacheController
from hicache_prefill.hicache.transfer.errors import BackupError, LoadBackError
from hicache_prefill.hicache.transfer.streams import make_streams
from tests.support.faults import CopyFaults, InjectedFault
from tests.support.kv_content import check_device, check_host, write_device

L = 3
TOKENS, POSITIONS = list(range(40, 48)), list(range(8))

# (layout, io, mla) -> the kernel op a backup and a per-layer load call
OPS = {
    ("layer_first", "kernel", False): ("transfer_kv_all_layer", "transfer_kv_per_layer"),
    ("layer_first", "kernel", True): ("transfer_kv_all_layer_mla", "transfer_kv_per_layer_mla"),
    ("page_first", "kernel", False): ("transfer_kv_all_layer_lf_pf", "transfer_kv_per_layer_pf_lf"),
    ("layer_first", "direct", False): ("transfer_kv_direct", "transfer_kv_direct"),
    ("page_first_direct", "direct", True): (
        "transfer_kv_all_layer_direct_lf_pf",
        "transfer_kv_per_layer_direct_pf_lf",
    ),
}
CASES = sorted(OPS)


def _id(case: tuple[str, str, bool]) -> str:
    return f"{case[0]}-{case[1]}-{'mla' if case[2] else 'mha'}"


def make(layout: str, io: str, mla: bool, mode: str, page: int = 4) -> HiCacheController:
    size = 16
    if mla:
        pool = MLATokenToKVPool(size, page, torch.float32, 6, 2, L, "cpu")
    else:
        pool = MHATokenToKVPool(size, page, torch.float32, 2, 4, L, "cpu")
    host = make_host_pool(pool, 2.0, 0, layout)
    alloc = TokenToKVPoolAllocator(size, page, "cpu")
    return HiCacheController(alloc, pool, host, io, streams=make_streams("cpu", 0.0, mode))


def snapshot(c: HiCacheController) -> tuple:
    """What a failed call must leave as it was."""
    return (
        c.device_allocator.available_size(),
        c.host_allocator.available_size(),
        len(c.ack_write_queue),
        len(c.ack_load_queue),
        [op.node_id for op in c.load_queue],
        c.layer_done_counter.consumer_index,
        sorted(c.layer_done_counter.events),
        c._busy.host.copy().tolist(),
        c._busy.host_written.copy().tolist(),
    )


def backed_up(c: HiCacheController) -> tuple[torch.Tensor, torch.Tensor]:
    """Device slots with known KV and their acked host copy (no fault planned yet)."""
    d = c.device_allocator.alloc(8)
    write_device(c.device_pool, d, TOKENS, POSITIONS)
    h = c.write(d, node_id=1)
    assert c.wait_write([1]) == [1] and c.take_failure(1) is None
    return d, h


def works(c: HiCacheController) -> None:
    """A backup and a load back, both checked bit for bit: nothing stuck to the streams."""
    d = c.device_allocator.alloc(8)
    write_device(c.device_pool, d, TOKENS, POSITIONS)
    h = c.write(d, node_id=50)
    assert c.wait_write([50]) == [50] and c.take_failure(50) is None
    check_host(c.host_pool, h, TOKENS, POSITIONS)
    d2 = c.load(h, node_id=51)
    c.start_loading()
    for layer in range(L):
        c.layer_done_counter.wait_until(layer)
    c.wait_loads()
    assert c.loading_check() == [51] and c.take_failure(51) is None
    check_device(c.device_pool, d2, TOKENS, POSITIONS)
    c.evict_device(torch.cat([d, d2]))
    c.evict_host(h)
    c.check_integrity()


@pytest.mark.parametrize("case", CASES, ids=_id)
def test_failed_backup(case, stream_mode: str) -> None:
    c = make(*case, stream_mode)
    backup_op = OPS[case][0]
    d = c.device_allocator.alloc(8)
    write_device(c.device_pool, d, TOKENS, POSITIONS)
    before = snapshot(c)
    with CopyFaults().fail_calls(backup_op, [0]) as faults:
        if stream_mode == "inline":
            with pytest.raises(BackupError, match=r"backup_from_device_all_layer\(") as info:
                c.write(d, node_id=7)
            assert isinstance(info.value.__cause__, InjectedFault)
            assert info.value.node_ids == [7]
            assert snapshot(c) == before  # host slots freed, nothing queued
        else:
            h = c.write(d, node_id=7)
            assert h is not None
            assert c.wait_write([7]) == [7]
            failure = c.take_failure(7)
            assert isinstance(failure, BackupError) and isinstance(failure.cause, InjectedFault)
            assert c.take_failure(7) is None  # handed out once
            c.evict_host(h)  # the caller's slots, as after a successful ack
            assert snapshot(c) == before
        assert faults.failures == [backup_op]
    assert c.stats.d2h_failed_copies == 1 and c.stats.d2h_copies == 0
    c.check_integrity()
    c.evict_device(d)
    works(c)
    c.close()


@pytest.mark.parametrize("case", CASES, ids=_id)
@pytest.mark.parametrize("layer", [0, L - 1])
def test_failed_load_layer(case, layer: int, stream_mode: str) -> None:
    c = make(*case, stream_mode)
    load_op = OPS[case][1]
    d, h = backed_up(c)
    c.evict_device(d)
    d2 = c.load(h, node_id=9)
    before = snapshot(c)
    with CopyFaults().fail_calls(load_op, [layer]):
        if stream_mode == "inline":
            with pytest.raises(LoadBackError, match=rf"layer_id={layer}\)") as info:
                c.start_loading()
            assert isinstance(info.value.__cause__, InjectedFault)
            assert snapshot(c) == before  # still queued, counter as before
            assert c.cancel_loads() == [9]
        else:
            c.start_loading()
            for ok in range(layer):
                c.layer_done_counter.wait_until(ok)
            with pytest.raises(LoadBackError, match=rf"layer_id={layer}\)"):
                c.layer_done_counter.wait_until(layer)  # its KV must not be read
            c.wait_loads()
            assert c.loading_check() == [9]
            failure = c.take_failure(9)
            assert isinstance(failure, LoadBackError) and f"layer_id={layer}" in str(failure)
        c.check_integrity()
    c.evict_device(d2)
    assert c.stats.h2d_failed_copies == 1 and c.stats.h2d_copies == 0
    assert c.device_allocator.available_size() == 16
    c.check_integrity()
    check_host(c.host_pool, h, TOKENS, POSITIONS)  # the host copy is intact
    c.evict_host(h)
    works(c)
    c.close()


@pytest.mark.parametrize(
    "target,direction",
    [
        ("backup_from_device_all_layer", "d2h"),
        ("load_to_device_per_layer", "h2d"),
        ("move_indices", "d2h"),
    ],
)
def test_failures_in_the_host_pool_calls_and_the_index_move(target, direction, stream_mode):
    c = make("layer_first", "kernel", False, stream_mode)
    d, h = backed_up(c) if direction == "h2d" else (c.device_allocator.alloc(8), None)
    if h is not None:
        c.evict_device(d)
        d = c.load(h, node_id=3)
    with CopyFaults().fail_calls(target, [0]):
        if direction == "d2h" and stream_mode == "inline":
            with pytest.raises(BackupError):
                c.write(d, node_id=3)
        elif direction == "d2h":
            c.evict_host(c.write(d, node_id=3))  # freed while in flight: held to the ack
            c.wait_write()
            assert isinstance(c.take_failure(3), BackupError)
        elif stream_mode == "inline":
            with pytest.raises(LoadBackError, match="layer_id=0"):
                c.start_loading()
            c.cancel_loads()
        else:
            c.start_loading()
            with pytest.raises(LoadBackError):
                c.layer_done_counter.wait_until(L - 1)
            c.wait_loads()
            c.loading_check()
            assert isinstance(c.take_failure(3), LoadBackError)
    c.check_integrity()
    c.evict_device(d)
    if h is not None:
        c.evict_host(h)
    assert c.host_in_flight() == 0 and c.device_allocator.available_size() == 16
    works(c)
    c.close()


def test_out_of_range_slots_are_refused_before_anything_is_allocated(stream_mode) -> None:
    c = make("layer_first", "direct", False, stream_mode)
    before = snapshot(c)
    with pytest.raises(ValueError, match="device_indices out of range"):
        c.write(torch.arange(100, 108), node_id=1)
    assert snapshot(c) == before
    c.check_integrity()
    c.close()


def test_copy_time_starts_on_the_side_stream_after_its_waits() -> None:
    """A backup launched while a load is in flight waits for it; its timing starts after that
    wait (recorded on the write stream), not at the event the compute stream recorded. The load
    is held at a gate until the backup was launched, so the order is the test's."""
    gate = threading.Event()

    def delay() -> float:  # the load stream (created second) waits for the gate
        if threading.current_thread().name == "cpu-stream-1":
            gate.wait()
        return 0.0

    size, page = 16, 4
    pool = MHATokenToKVPool(size, page, torch.float32, 2, 4, L, "cpu")
    host = make_host_pool(pool, 2.0, 0, "layer_first")
    alloc = TokenToKVPoolAllocator(size, page, "cpu")
    c = HiCacheController(alloc, pool, host, "direct", streams=make_streams("cpu", delay))
    d = c.device_allocator.alloc(8)
    h = c.write(d, node_id=1)
    c.wait_write([1])
    c.evict_device(d)
    c.load(h, node_id=2)
    c.start_loading()
    c.write(c.device_allocator.alloc(8), node_id=3)
    load_ack, write_ack = c.ack_load_queue[-1], c.ack_write_queue[-1]
    gate.set()
    c.wait_all()
    assert write_ack.copy_start_event is not None and load_ack.copy_start_event is not None
    assert write_ack.start_event.recorded_at < load_ack.finish_event.recorded_at
    assert write_ack.copy_start_event.recorded_at >= load_ack.finish_event.recorded_at
    assert load_ack.copy_start_event.recorded_at >= load_ack.start_event.recorded_at
    c.close()
