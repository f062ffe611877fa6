"""Streams and events: the CPU worker-thread implementation, and the CUDA one on a GPU."""

from __future__ import annotations

import threading
import time

import pytest
import torch

from hicache_prefill.hicache.transfer.streams import (
    CpuEvent,
    CpuStreams,
    CudaStreams,
    InlineStreams,
    make_streams,
)


def test_cpu_stream_runs_in_order_without_blocking_the_caller() -> None:
    gate = threading.Event()

    def delay() -> float:  # every submitted callable waits for the gate
        gate.wait()
        return 0.0

    streams = CpuStreams(delay=delay)
    s = streams.new_stream()
    out: list[int] = []
    for i in range(3):
        s.submit(lambda i=i: out.append(i))  # would never return if submit waited
    ev = s.record()
    assert out == [] and not ev.query() and not s.query()
    gate.set()
    ev.synchronize()
    assert out == [0, 1, 2] and ev.query()
    s.synchronize()
    assert s.query()
    streams.close()


def test_events_fire_in_order_and_unrecorded_event_is_complete() -> None:
    streams = CpuStreams(delay=0.01)
    s = streams.new_stream()
    assert streams.new_event().query()  # never recorded: complete, as in CUDA
    events = []
    for _ in range(4):
        s.submit(lambda: None)
        events.append(s.record())
    events[1].synchronize()
    assert events[0].query() and events[1].query()
    events[-1].synchronize()
    assert all(e.query() for e in events)
    assert events[0].elapsed_time(events[-1]) > 0
    streams.close()


def test_compute_stream_is_the_caller() -> None:
    streams = CpuStreams()
    ran = []
    streams.compute.submit(lambda: ran.append(1))
    assert ran == [1] and streams.compute.record().query()


def test_stream_wait_event_orders_two_streams() -> None:
    gate = threading.Event()

    def delay() -> float:  # stream a's work waits for the gate, stream b's does not
        if threading.current_thread().name == "cpu-stream-0":
            gate.wait()
        return 0.0

    streams = CpuStreams(delay=delay)
    a, b = streams.new_stream(), streams.new_stream()
    out: list[str] = []
    a.submit(lambda: out.append("a"))
    ev = a.record()
    b.wait_event(ev)
    b.submit(lambda: out.append("b"))
    fence = b.record()
    assert not fence.query() and out == []  # b waits for a, which waits for the gate
    gate.set()
    b.synchronize()
    assert out == ["a", "b"]
    streams.close()


def test_wait_event_binds_to_the_record_at_call_time() -> None:
    streams = CpuStreams()
    a, b = streams.new_stream(), streams.new_stream()
    gate = threading.Event()
    ev = CpuEvent()
    a.submit(gate.wait)
    ev.record(a)  # pending until gate opens
    b.wait_event(ev)
    b.submit(lambda: None)
    time.sleep(0.05)
    assert not b.query()
    ev.record(streams.compute)  # a re-record must not release b's earlier wait
    time.sleep(0.05)
    assert not b.query()
    gate.set()
    b.synchronize()
    streams.close()


def test_failed_callable_goes_to_the_next_event_and_does_not_stick() -> None:
    streams = CpuStreams()
    s = streams.new_stream()
    s.submit(lambda: 1 / 0)
    failed = s.record()
    failed.synchronize()  # still fires, carrying the error
    assert isinstance(failed.error, ZeroDivisionError)
    out: list[int] = []
    s.submit(lambda: out.append(1))
    ok = s.record()
    ok.synchronize()
    assert ok.error is None and out == [1]  # later work is not affected
    s.synchronize()  # the error went to its event: nothing left to raise
    s.submit(lambda: 1 / 0)  # no event follows: synchronize raises it, once
    with pytest.raises(RuntimeError, match="ZeroDivisionError"):
        s.synchronize()
    s.synchronize()
    streams.close()


def test_inline_stream_runs_at_submit_and_raises_there() -> None:
    streams = make_streams("cpu", mode="inline")
    assert isinstance(streams, InlineStreams)
    s = streams.new_stream(high_priority=True)
    out: list[int] = []
    s.submit(lambda: out.append(1))
    assert out == [1]  # ran on the caller's thread, before submit returned
    ev = s.record()
    assert ev.query() and ev.error is None
    with pytest.raises(ZeroDivisionError):
        s.submit(lambda: 1 / 0)
    s.submit(lambda: out.append(2))  # the stream goes on
    assert out == [1, 2] and s.query()
    s.wait_event(streams.compute.record())


def test_make_streams_modes() -> None:
    assert isinstance(make_streams("cpu", mode="thread"), CpuStreams)
    with pytest.raises(ValueError, match="streams mode"):
        make_streams("cpu", mode="async")


def test_make_streams_picks_cpu_without_cuda() -> None:
    assert isinstance(make_streams("cpu"), CpuStreams)


@pytest.mark.gpu
def test_cuda_side_stream_waits_for_compute_event() -> None:
    streams = CudaStreams("cuda")
    side = streams.new_stream()
    src = torch.zeros(1 << 20, device="cuda")
    dst = torch.empty_like(src)
    torch.cuda.synchronize()
    torch.cuda._sleep(50_000_000)  # keep the compute stream busy
    src.fill_(3.0)
    ev = streams.compute.record(streams.new_event())
    side.wait_event(ev)
    side.submit(lambda: dst.copy_(src))
    done = side.record(streams.new_event(enable_timing=False))
    done.synchronize()
    assert bool((dst == 3.0).all())
    assert side.query()


@pytest.mark.gpu
def test_cuda_high_priority_stream_is_above_the_compute_stream() -> None:
    streams = CudaStreams("cuda")
    high, plain = streams.new_stream(high_priority=True), streams.new_stream()
    assert high.stream.priority < plain.stream.priority == streams.compute.stream.priority
    with pytest.raises(ValueError, match="thread"):
        make_streams("cuda", mode="thread")
    assert isinstance(make_streams("cuda", mode="inline"), CudaStreams)
