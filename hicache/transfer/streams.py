"""Streams and events, once for CUDA and once for a machine without it (``make_streams``).

An event never recorded counts as complete, as in CUDA. ``CpuStreams`` (``"thread"``): a side
stream is a worker thread; a callable's exception goes to the next event recorded on that stream
(``Event.error``) or the next ``synchronize``. ``InlineStreams`` (``"inline"``): ``submit`` runs on
the caller's thread and raises there, as a CUDA launch. On CPU the compute stream is the caller,
and a delay is slept before every side-stream callable.
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from collections.abc import Callable
from typing import Protocol

import torch

logger = logging.getLogger(__name__)

Delay = float | Callable[[], float]

# Serializes the callables of every CPU side stream (the Triton interpreter is not thread-safe).
CPU_COPY_LOCK = threading.Lock()


STREAM_MODES = ("thread", "inline")  # CPU stream kinds of ``make_streams``


def _sleep(delay: Delay) -> None:
    d = delay() if callable(delay) else delay
    if d > 0:
        time.sleep(d)


# torch clamps a stream priority into the device's range; lower is higher, the default is 0.
HIGH_PRIORITY = -1


class Event(Protocol):
    error: BaseException | None

    def record(self, stream: Stream | None = None) -> None: ...
    def query(self) -> bool: ...
    def synchronize(self) -> None: ...
    def elapsed_time(self, end: Event) -> float: ...


class Stream(Protocol):
    def submit(self, fn: Callable[[], object]) -> None: ...
    def record(self, event: Event | None = None) -> Event: ...
    def wait_event(self, event: Event) -> None: ...
    def query(self) -> bool: ...
    def synchronize(self) -> None: ...


class Streams(Protocol):
    """Factory for one device's streams and events; ``compute`` is the forward pass's stream."""

    @property
    def compute(self) -> Stream: ...
    def new_stream(self, high_priority: bool = False) -> Stream: ...
    def new_event(self, enable_timing: bool = False) -> Event: ...


class CudaEvent:
    """A ``torch.cuda.Event``; ``error`` stays ``None`` (a failed launch raises in ``submit``)."""

    error: BaseException | None = None

    def __init__(self, enable_timing: bool = False) -> None:
        self.event = torch.cuda.Event(enable_timing=enable_timing)

    def record(self, stream: Stream | None = None) -> None:
        s = stream.stream if isinstance(stream, CudaStream) else None
        self.event.record(s)

    def query(self) -> bool:
        return self.event.query()

    def synchronize(self) -> None:
        self.event.synchronize()

    def elapsed_time(self, end: CudaEvent) -> float:
        return self.event.elapsed_time(end.event)


class CudaStream:
    """A ``torch.cuda.Stream``; ``submit`` launches ``fn``'s kernels on it, never blocking."""

    def __init__(self, stream: torch.cuda.Stream) -> None:
        self.stream = stream

    def submit(self, fn: Callable[[], object]) -> None:
        with torch.cuda.stream(self.stream):
            fn()

    def record(self, event: Event | None = None) -> Event:
        ev = event if event is not None else CudaEvent()
        ev.record(self)
        return ev

    def wait_event(self, event: CudaEvent) -> None:
        self.stream.wait_event(event.event)

    def query(self) -> bool:
        return self.stream.query()

    def synchronize(self) -> None:
        self.stream.synchronize()


class CudaStreams:
    """Streams on one CUDA device; ``compute`` is whatever stream is current when asked."""

    def __init__(self, device: torch.device | str | None = None) -> None:
        self.device = torch.device(device if device is not None else "cuda")

    @property
    def compute(self) -> CudaStream:
        return CudaStream(torch.cuda.current_stream(self.device))

    def new_stream(self, high_priority: bool = False) -> CudaStream:
        priority = HIGH_PRIORITY if high_priority else 0
        return CudaStream(torch.cuda.Stream(self.device, priority=priority))

    def new_event(self, enable_timing: bool = False) -> CudaEvent:
        return CudaEvent(enable_timing)


class CpuEvent:
    """Each ``record`` arms a fresh flag that the stream sets when reached. ``error``: what failed
    on a thread stream since its previous record."""

    def __init__(self) -> None:
        self._flag: threading.Event | None = None
        self.recorded_at: float | None = None  # time.perf_counter() when the flag was set
        self.error: BaseException | None = None

    def record(self, stream: Stream | None = None) -> None:
        flag = threading.Event()
        self._flag = flag
        self.recorded_at = None
        self.error = None

        def fire(error: BaseException | None = None) -> None:
            self.error = error
            self.recorded_at = time.perf_counter()
            flag.set()

        if stream is None or isinstance(stream, CpuComputeStream):  # InlineStream included
            fire()
        elif isinstance(stream, CpuStream):
            stream._put_record(fire)
        else:
            raise ValueError(f"stream must be a CPU stream, got {type(stream).__name__}")

    def query(self) -> bool:
        flag = self._flag
        return flag is None or flag.is_set()

    def synchronize(self) -> None:
        flag = self._flag
        if flag is not None:
            flag.wait()

    def elapsed_time(self, end: Event) -> float:
        """Milliseconds from when this event fired to when ``end`` fired (0 if either has not)."""
        if not isinstance(end, CpuEvent) or self.recorded_at is None or end.recorded_at is None:
            return 0.0
        return (end.recorded_at - self.recorded_at) * 1e3

    def _waiter(self) -> Callable[[], object]:
        """A wait on the record current now (a later re-record does not move it), as CUDA."""
        flag = self._flag
        return (lambda: None) if flag is None else flag.wait


class CpuComputeStream:
    """The calling thread: submitted work runs inline; a wait blocks the caller."""

    def submit(self, fn: Callable[[], object]) -> None:
        fn()

    def record(self, event: Event | None = None) -> Event:
        ev = event if event is not None else CpuEvent()
        ev.record(self)
        return ev

    def wait_event(self, event: Event) -> None:
        event.synchronize()

    def query(self) -> bool:
        return True

    def synchronize(self) -> None:
        return None


class CpuStream:
    """One daemon worker thread running submitted callables in order."""

    def __init__(self, delay: Delay = 0.0, name: str = "cpu-stream") -> None:
        self.delay = delay
        self.name = name
        self._queue: queue.Queue[tuple[Callable[[], object], bool] | None] = queue.Queue()
        self._pending = 0
        self._cv = threading.Condition()
        self._error: BaseException | None = None
        self._closed = False
        self._thread = threading.Thread(target=self._run, name=name, daemon=True)
        self._thread.start()

    def submit(self, fn: Callable[[], object]) -> None:
        self._put(fn, delayed=True)

    def record(self, event: Event | None = None) -> Event:
        ev = event if event is not None else CpuEvent()
        ev.record(self)
        return ev

    def wait_event(self, event: CpuEvent) -> None:
        """Later work on this stream starts only after ``event`` completes; the caller goes on."""
        self._put(event._waiter(), delayed=False)

    def query(self) -> bool:
        with self._cv:
            return self._pending == 0

    def synchronize(self) -> None:
        """Block until everything submitted so far has run; raise, once, the error of a callable
        that no later event took."""
        with self._cv:
            while self._pending:
                self._cv.wait()
        error = self._take_error()
        if error is not None:
            raise RuntimeError(f"{self.name}: a submitted callable failed: {error!r}") from error

    def close(self) -> None:
        """Finish queued work, then stop the worker thread."""
        if not self._closed:
            self._closed = True
            self._queue.put(None)
            self._thread.join()

    def _put(self, fn: Callable[[], object], delayed: bool) -> None:
        if self._closed:
            raise RuntimeError(f"{self.name} is closed")
        with self._cv:
            self._pending += 1
        self._queue.put((fn, delayed))

    def _put_record(self, fire: Callable[[BaseException | None], None]) -> None:
        """Queue an event's record: when reached, the event takes the stream's pending error."""
        self._put(lambda: fire(self._take_error()), delayed=False)

    def _take_error(self) -> BaseException | None:
        with self._cv:
            error, self._error = self._error, None
        return error

    def _run(self) -> None:
        while True:
            item = self._queue.get()
            if item is None:
                return
            fn, delayed = item
            try:
                if delayed:
                    _sleep(self.delay)
                    with CPU_COPY_LOCK:
                        fn()
                else:
                    fn()
            except BaseException as e:  # noqa: BLE001 - handed to the next event (or synchronize)
                logger.exception("%s: submitted callable failed", self.name)
                with self._cv:
                    if self._error is None:
                        self._error = e
            finally:
                with self._cv:
                    self._pending -= 1
                    self._cv.notify_all()


class CpuStreams:
    """CPU streams; ``delay`` (seconds or a callable) is given to every new side stream."""

    _stream_cls: type[CpuStream | InlineStream] = CpuStream
    _stream_name = "cpu-stream"

    def __init__(self, delay: Delay = 0.0) -> None:
        self.delay = delay
        self._compute = CpuComputeStream()
        self._streams: list[CpuStream | InlineStream] = []

    @property
    def compute(self) -> CpuComputeStream:
        return self._compute

    def new_stream(self, high_priority: bool = False) -> CpuStream | InlineStream:
        """``high_priority`` is ignored: a CPU has no stream priorities."""
        s = self._stream_cls(self.delay, name=f"{self._stream_name}-{len(self._streams)}")
        self._streams.append(s)
        return s

    def new_event(self, enable_timing: bool = False) -> CpuEvent:
        return CpuEvent()  # always timed

    def close(self) -> None:
        for s in self._streams:
            s.close()


class InlineStream(CpuComputeStream):
    """``submit`` runs ``fn`` now on the caller's thread (after the delay) and lets its exception
    propagate; events recorded here fire at once."""

    def __init__(self, delay: Delay = 0.0, name: str = "inline-stream") -> None:
        self.delay = delay
        self.name = name

    def submit(self, fn: Callable[[], object]) -> None:
        _sleep(self.delay)
        with CPU_COPY_LOCK:
            fn()

    def close(self) -> None:
        return None


class InlineStreams(CpuStreams):
    """CPU streams with CUDA's launch semantics (``mode="inline"``)."""

    _stream_cls = InlineStream
    _stream_name = "inline-stream"


def make_streams(
    device: torch.device | str, delay: Delay = 0.0, mode: str | None = None
) -> CudaStreams | CpuStreams | InlineStreams:
    """The streams of ``device``; ``mode`` (CPU): ``None`` / ``"thread"`` or ``"inline"``. On
    CUDA ``delay`` is unused and ``"inline"`` is what CUDA streams do already."""
    device = torch.device(device)
    if mode is not None and mode not in STREAM_MODES:
        raise ValueError(f"streams mode must be one of {STREAM_MODES}, got {mode!r}")
    if device.type == "cuda":
        if mode == "thread":
            raise ValueError(
                "streams='thread' emulates CUDA streams with CPU threads; the device is "
                f"{device}: use the default (None) or 'inline'"
            )
        return CudaStreams(device)
    if mode == "inline":
        return InlineStreams(delay)
    return CpuStreams(delay)
