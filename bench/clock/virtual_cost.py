"""What the deterministic benchmark mode charges to the executor's virtual clock.

The real model still computes every forward and the cache still moves every byte (integrity and
KV content are real); only *time* comes from the calibration (``bench.clock.calibrate``):

- **Forward**: ``Calibration.forward.cost`` of the batch's shapes, which ``RecordingModel``
  records as the executor calls ``forward_extend``; each layer takes ``1 / layers`` of it.
- **H2D load back** (load stream): a launch (``start_loading``) of ``T`` tokens occupies the
  load stream for ``layers`` calls of ``h2d.seconds(T * bytes_per_token / layers)``; layer ``i``
  is ready when its copy ends (FIFO after earlier loads), and the forward's layer ``i`` starts
  once layer ``i - 1`` computed and layer ``i`` loaded: the overlap the controller's per-layer
  events give. Layer 0's copy runs while the forward waits for it; every later layer's copy
  runs beside the previous layer's compute and is charged its co-run slowdown at the cost of
  the forward that consumes the load (``corun.copy_factor_at``; the booking is resized when
  that forward is charged). On CPU streams a load starts no earlier than its forward: the
  stream thread waits for the interpreter while the scheduler's Python between the launch and
  the forward runs (measured: the wall runs' forwards block ~1-2 ms in layer 0's wait, which
  a load starting at its launch hid behind the launch's host time).
- **D2H backup** (write stream): each backup (``write``) occupies the write stream for
  ``d2h.seconds(bytes)``, FIFO, beside compute, and starts after the newest load in flight (as
  the controller orders it); a wait for a backup (``wait_write``: write_back eviction)
  advances the clock to that backup's end. On a machine without CUDA both streams are one FIFO
  (the controller's CPU stream threads copy under one lock).
- **Co-run slowdown**: compute that overlaps a running copy is ``corun.factor_at(cost)`` times
  slower (``cost``: the forward's own cost; a short forward is slowed more than a long one),
  and a copy's overlap with compute ``corun.copy_factor_at(cost)`` times
  (``bench.clock.streams_model``; both measured at several forward shapes,
  ``bench.clock.corun``); a slowed copy's ack comes later.
- **Acks at their modelled time**: a copy's ack is popped by the tree's ack poll only once the
  clock passed the copy's modelled end (``count_finished_writes`` / ``count_finished_loads``
  answer at most that many), and ``next_ack_time`` tells the executor when the next one ends
  (``OptimisticPrefillExecutor(modelled_copies=...)``). Between steps the driver waits for the
  real copies to finish (``settle``, popping nothing), so which acks are popped when depends
  on the clock only, never on thread timing. ``release_acks`` ends the gating (the audit
  drains every ack).
- **KV transfer to decode**: ``bench.clock.transport.TransferModel``: by default the decode
  side's own read of a send, charged where it happens (``install_decode``); on a machine
  without CUDA it takes the same lock as the stream copies, so it waits for the modelled FIFO
  and occupies it.
- **Host time**: ``bench.clock.host_meter.HostMeter`` (the scheduler thread's calls).

Wrapping: ``install`` replaces five methods of one controller *instance* (``write``,
``wait_write``, ``start_loading``, ``count_finished_writes``, ``count_finished_loads``) with
timed pass-throughs; ``install_decode`` sets the decode side's ``copy_hook``; nothing else
changes.
"""

from __future__ import annotations

import logging
from typing import Any

from bench.clock.calibrate import Calibration, Shape
from bench.clock.host_meter import HostMeter
from bench.clock.streams_model import Booking, CopyTimeline
from hicache.transfer.streams import CpuStreams

logger = logging.getLogger(__name__)

__all__ = ["CostAccountant", "RecordingModel"]


class RecordingModel:
    """The paged model, unchanged, with the shapes ``[(new, prefix), ...]`` of the last
    ``forward_extend`` batch kept in ``last_shapes``; the forward's own time is excluded from
    host time when a ``meter`` is set. Every other attribute is the model's."""

    def __init__(self, model: Any, meter: HostMeter | None = None) -> None:
        self._model = model
        self.meter = meter
        self.last_shapes: list[Shape] = []

    def forward_extend(self, pool: Any, batch: Any, *args: Any, **kwargs: Any) -> Any:
        self.last_shapes = [(int(r.input_ids.numel()), int(r.prefix_len)) for r in batch]
        if self.meter is None:
            return self._model.forward_extend(pool, batch, *args, **kwargs)
        with self.meter.excluded():
            return self._model.forward_extend(pool, batch, *args, **kwargs)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._model, name)


class CostAccountant:
    """The executor's ``cost_model`` and ``modelled_copies`` on a virtual clock, plus the copy
    streams' timelines (see the module docstring).

    ``__call__(new_tokens, prefix_tokens)`` is called by the executor after each forward, with
    the clock still at the forward's start; it returns the seconds to charge (compute, slowed
    where it overlaps a copy, plus any wait for layers still loading). Counters (seconds):
    ``compute_s``, ``corun_extra_s``, ``load_wait_s``, ``write_wait_s``, ``h2d_busy_s``,
    ``d2h_busy_s``, ``transfer_s`` (of which ``transfer_wait_s`` waiting for the CPU copy lock),
    ``write_backlog_max_s``; ``acks_held`` counts ack polls
    that left a finished copy unpopped because its modelled end was still ahead.
    """

    def __init__(
        self, calibration: Calibration, clock: Any, model: RecordingModel,
        meter: HostMeter | None = None,
    ) -> None:  # fmt: skip
        self.cal = calibration
        self.clock = clock
        self.model = model
        self.meter = meter
        self.layers = calibration.num_layers
        self.corun = calibration.corun
        self.transfer = calibration.transfer
        self.timeline = CopyTimeline()  # replaced at install (shared on CPU streams)
        self.bytes_per_token = 0
        self.controller: Any = None
        self.gate_acks = True
        self._done: dict[int, tuple[Any, Booking]] = {}  # id(ack) -> (ack, its modelled copy)
        # The newest load's (ack, booking, seconds per layer), until a forward consumes it.
        self._pending_load: tuple[Any, Booking, float] | None = None
        self.compute_s = 0.0
        self.corun_extra_s = 0.0
        self.load_wait_s = 0.0
        self.write_wait_s = 0.0
        self.h2d_busy_s = 0.0
        self.d2h_busy_s = 0.0
        self.transfer_s = 0.0
        self.transfer_wait_s = 0.0
        self.write_backlog_max_s = 0.0
        self.acks_held = 0
        self.forwards = 0

    # ------------------------------------------------------------------ executor hooks
    def __call__(self, new_tokens: int, prefix_tokens: int) -> float:
        shapes = self.model.last_shapes
        if sum(n for n, _ in shapes) != new_tokens:  # not the batch just recorded
            shapes = [(new_tokens, prefix_tokens)]
        compute = self.cal.forward.cost(shapes)
        factor = self.corun.factor_at(compute)
        copy_factor = self.corun.copy_factor_at(compute)
        start = self.clock.now()
        ready = self._loaded_layers(copy_factor, start)
        self.timeline.trim(start)
        end = start
        per_layer = compute / self.layers
        waited = 0.0
        for layer in range(self.layers):
            if layer < len(ready) and ready[layer] > end:
                waited += ready[layer] - end
                end = ready[layer]
            end = self.timeline.compute_end(end, per_layer, factor)
        self.timeline.stretch_copies(start, end, copy_factor)
        self.compute_s += compute
        self.load_wait_s += waited
        self.corun_extra_s += max(0.0, (end - start) - compute - waited)
        self.forwards += 1
        return end - start

    def _loaded_layers(self, copy_factor: float, forward_start: float) -> list[float]:
        """When each layer of the load launched for this forward is ready: layer 0 copied
        alone, every later one beside the previous layer's compute at ``copy_factor`` (the
        factor of this forward's cost); its booking is resized to match. On CPU streams the
        load starts no earlier than the forward (``forward_start``): the stream thread shares
        the interpreter with the scheduler thread, whose Python between the launch and the
        forward holds it. Empty without a load, or when its ack left the queue before this
        forward (the load was cancelled): it is not this forward's."""
        if self._pending_load is None:
            return []
        ack, bk, per_layer = self._pending_load
        self._pending_load = None
        c = self.controller
        if c is not None and not any(a is ack for a in c.ack_load_queue):
            self.h2d_busy_s += bk.duration  # cancelled or acked before any forward: as booked
            return []
        beside = per_layer * copy_factor
        self.h2d_busy_s += per_layer + (self.layers - 1) * beside
        start = max(bk.start, forward_start) if self.timeline.shared else None
        self.timeline.resize(bk, per_layer + (self.layers - 1) * beside, start)
        return [bk.start + per_layer + i * beside for i in range(self.layers)]

    def next_ack_time(self) -> float | None:
        """The earliest modelled end of a copy whose ack is not popped yet."""
        c = self.controller
        if c is None or not self.gate_acks:
            return None
        ends = [self._end(a) for a in (*c.ack_write_queue, *c.ack_load_queue)]
        return min(ends) if ends else None

    def settle(self) -> None:
        """Wait for the real copies in flight to finish, popping no ack (between steps)."""
        c = self.controller
        if c is None:
            return
        for ack in (*c.ack_write_queue, *c.ack_load_queue):
            ack.finish_event.synchronize()

    def release_acks(self) -> None:
        """Stop holding acks back (every finished copy may be popped)."""
        self.gate_acks = False

    # ------------------------------------------------------------------ controller hooks
    def _end(self, ack: Any) -> float:
        entry = self._done.get(id(ack))
        return entry[1].end if entry is not None and entry[0] is ack else 0.0

    def _register(self, ack: Any, booking: Booking) -> None:
        if len(self._done) > 4096:  # drop popped acks
            c = self.controller
            live = {id(a) for a in (*c.ack_write_queue, *c.ack_load_queue)}
            self._done = {k: v for k, v in self._done.items() if k in live}
        self._done[id(ack)] = (ack, booking)

    def _gated(self, queue: Any, real: int) -> int:
        if not self.gate_acks:
            return real
        now = self.clock.now()
        n = 0
        for ack in queue:
            if n >= real or self._end(ack) > now:
                break
            n += 1
        self.acks_held += int(n < real)
        return n

    def install(self, controller: Any) -> None:
        """Time ``controller``'s copies on the virtual streams (instance attributes only)."""
        self.controller = controller
        self.timeline = CopyTimeline(shared=isinstance(controller.streams, CpuStreams))
        self.bytes_per_token = int(controller.host_pool.size_per_token)
        write, wait_write = controller.write, controller.wait_write
        start_loading = controller.start_loading
        finished_writes = controller.count_finished_writes
        finished_loads = controller.count_finished_loads

        def timed_write(device_indices: Any, node_id: int = -1) -> Any:
            queued = len(controller.ack_write_queue)
            loads = [self._end(a) for a in controller.ack_load_queue]  # the newest: the last
            host = write(device_indices, node_id=node_id)
            if host is not None and len(controller.ack_write_queue) > queued:
                secs = self.cal.d2h.seconds(host.numel() * self.bytes_per_token)
                now = self.clock.now()
                bk = self.timeline.occupy("write", now, secs, loads[-1] if loads else 0.0)
                self._register(controller.ack_write_queue[-1], bk)
                self.d2h_busy_s += secs
                self.write_backlog_max_s = max(self.write_backlog_max_s, bk.end - now)
            return host

        def timed_wait_write(node_ids: list[int] | None = None) -> list[int]:
            wanted = None if node_ids is None else set(node_ids)
            targets = [a for a in controller.ack_write_queue
                       if wanted is None or wanted.intersection(a.node_ids)]  # fmt: skip
            until = max((self._end(a) for a in targets), default=0.0)
            now = self.clock.now()
            if until > now:
                self.clock.advance(until - now)
                self.write_wait_s += until - now
            if self.meter is None:
                return wait_write(node_ids)
            with self.meter.excluded():
                return wait_write(node_ids)

        def timed_start_loading() -> int:
            tokens = sum(int(op.host_indices.numel()) for op in controller.load_queue)
            queued = len(controller.ack_load_queue)
            pid = start_loading()
            if tokens and len(controller.ack_load_queue) > queued:
                per_layer = self.cal.h2d.seconds(tokens * self.bytes_per_token // self.layers)
                # Booked at the copies' own speed; the forward that consumes it sets the
                # co-run speed of layers 1.. (``_loaded_layers``).
                total = per_layer * self.layers
                bk = self.timeline.occupy("load", self.clock.now(), total, stretchable=False)
                self._register(controller.ack_load_queue[-1], bk)
                if self._pending_load is not None:  # launched without a forward: as booked
                    self.h2d_busy_s += self._pending_load[1].duration
                self._pending_load = (controller.ack_load_queue[-1], bk, per_layer)
            return pid

        controller.write = timed_write
        controller.wait_write = timed_wait_write
        controller.start_loading = timed_start_loading
        controller.count_finished_writes = lambda: self._gated(
            controller.ack_write_queue, finished_writes()
        )
        controller.count_finished_loads = lambda: self._gated(
            controller.ack_load_queue, finished_loads()
        )

    def install_decode(self, decode: Any) -> None:
        """Charge the decode side's reads of sends (``DecodeSide.copy_hook``): the in-process
        copy is excluded from host time and, with a ``blocking`` transfer model (the default,
        the copy's own measured rate), its modelled time is charged where it runs."""

        def read(nbytes: int, copy: Any) -> None:
            if self.meter is None:
                copy()
            else:
                with self.meter.excluded():
                    copy()
            if self.transfer.blocking:
                secs = self.transfer.seconds(nbytes)
                now = self.clock.now()
                if self.timeline.shared:  # CPU: the read waits for the copy lock
                    bk = self.timeline.occupy("write", now, secs)
                    self.transfer_wait_s += bk.start - now
                    secs = bk.end - now
                self.clock.advance(secs)
                self.transfer_s += secs

        decode.copy_hook = read

    def as_dict(self) -> dict[str, Any]:
        return {
            "forwards": self.forwards,
            "compute_s": self.compute_s,
            "corun_extra_s": self.corun_extra_s,
            "corun": self.corun.as_dict(),
            "load_wait_s": self.load_wait_s,
            "write_wait_s": self.write_wait_s,
            "h2d_busy_s": self.h2d_busy_s,
            "d2h_busy_s": self.d2h_busy_s,
            "transfer_s": self.transfer_s,
            "transfer_wait_s": self.transfer_wait_s,
            "transfer": self.transfer.as_dict(),
            "write_backlog_max_s": self.write_backlog_max_s,
            "acks_held": self.acks_held,
            "host": None if self.meter is None else self.meter.as_dict(),
        }
