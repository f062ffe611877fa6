"""What the deterministic benchmark mode charges to the executor's virtual clock.

The real model still computes every forward and the cache still moves every byte (integrity and
KV content are real); only *time* comes from the calibration (``bench.clock.calibrate``):

- **Forward**: ``Calibration.forward.cost`` of the batch's shapes, which ``RecordingModel``
  records as the executor calls ``forward_extend``.
- **H2D load back** (load stream): a launch (``start_loading``) of ``T`` tokens occupies the
  load stream for ``layers`` calls of ``h2d.seconds(T * bytes_per_token / layers)``; layer ``i``
  is ready when its copy ends (FIFO after earlier loads). The forward runs layer by layer and
  layer ``i`` starts once layer ``i - 1`` computed and layer ``i`` loaded, each layer taking
  ``1 / layers`` of the forward's cost: the overlap the controller's per-layer events give.
- **D2H backup** (write stream): each backup (``write``) occupies the write stream for
  ``d2h.seconds(bytes)``, FIFO. Write-through backups overlap compute (a side stream); a wait
  for a backup (``wait_write``: write_back eviction) advances the clock to that backup's end.

Modelled, not measured: the two streams run beside compute without slowing it (copy engines on
a GPU), and a backup's ack reaches the tree at the end of the step that launched it (the
benchmark drains the cache's real copies after every step, so the schedule does not depend on
thread timing). ``write_backlog_max_s`` reports how far the write stream ever ran behind the
clock; when it is small next to a forward, the second simplification changes nothing.

Wrapping: ``CostAccountant.install`` replaces three methods of one controller *instance*
(``write``, ``wait_write``, ``start_loading``) with timed pass-throughs; nothing else changes.
"""

from __future__ import annotations

import logging
from typing import Any

from bench.clock.calibrate import Calibration, Shape

logger = logging.getLogger(__name__)


class RecordingModel:
    """The paged model, unchanged, with the shapes ``[(new, prefix), ...]`` of the last
    ``forward_extend`` batch kept in ``last_shapes``. Every other attribute is the model's."""

    def __init__(self, model: Any) -> None:
        self._model = model
        self.last_shapes: list[Shape] = []

    def forward_extend(self, pool: Any, batch: Any, *args: Any, **kwargs: Any) -> Any:
        self.last_shapes = [(int(r.input_ids.numel()), int(r.prefix_len)) for r in batch]
        return self._model.forward_extend(pool, batch, *args, **kwargs)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._model, name)


class CostAccountant:
    """The executor's ``cost_model`` on a virtual clock, plus the copy streams' timelines.

    ``__call__(new_tokens, prefix_tokens)`` is called by the executor after each forward, with
    the clock still at the forward's start; it returns the seconds to charge (compute plus any
    wait for layers still loading). Counters (seconds): ``compute_s``, ``load_wait_s``,
    ``write_wait_s``, ``h2d_busy_s``, ``d2h_busy_s``, ``write_backlog_max_s``.
    """

    def __init__(self, calibration: Calibration, clock: Any, model: RecordingModel) -> None:
        self.cal = calibration
        self.clock = clock
        self.model = model
        self.layers = calibration.num_layers
        self.bytes_per_token = 0
        self._load_free_at = 0.0
        self._write_free_at = 0.0
        self._write_done: dict[int, float] = {}  # node id -> end of its backup
        self._layer_ready: list[float] = []
        self.compute_s = 0.0
        self.load_wait_s = 0.0
        self.write_wait_s = 0.0
        self.h2d_busy_s = 0.0
        self.d2h_busy_s = 0.0
        self.write_backlog_max_s = 0.0
        self.forwards = 0

    # ------------------------------------------------------------------ executor hook
    def __call__(self, new_tokens: int, prefix_tokens: int) -> float:
        shapes = self.model.last_shapes
        if sum(n for n, _ in shapes) != new_tokens:  # not the batch just recorded
            shapes = [(new_tokens, prefix_tokens)]
        compute = self.cal.forward.cost(shapes)
        start = self.clock.now()
        end = start
        per_layer = compute / self.layers
        ready = self._layer_ready
        for layer in range(self.layers):
            if layer < len(ready):
                end = max(end, ready[layer])
            end += per_layer
        self._layer_ready = []
        self.compute_s += compute
        self.load_wait_s += max(0.0, (end - start) - compute)
        self.forwards += 1
        return end - start

    # ------------------------------------------------------------------ controller hooks
    def install(self, controller: Any) -> None:
        """Time ``controller``'s copies on the virtual streams (instance attributes only)."""
        self.bytes_per_token = int(controller.host_pool.size_per_token)
        write, wait_write = controller.write, controller.wait_write
        start_loading = controller.start_loading

        def timed_write(device_indices: Any, node_id: int = -1) -> Any:
            host = write(device_indices, node_id=node_id)
            if host is not None and host.numel():
                secs = self.cal.d2h.seconds(host.numel() * self.bytes_per_token)
                now = self.clock.now()
                self._write_free_at = max(self._write_free_at, now) + secs
                if len(self._write_done) > 4096:  # backups acked through writing_check
                    self._write_done = {k: v for k, v in self._write_done.items() if v > now}
                self._write_done[node_id] = self._write_free_at
                self.d2h_busy_s += secs
                self.write_backlog_max_s = max(self.write_backlog_max_s, self._write_free_at - now)
            return host

        def timed_wait_write(node_ids: list[int] | None = None) -> list[int]:
            ids = list(self._write_done) if node_ids is None else node_ids
            until = max((self._write_done.get(i, 0.0) for i in ids), default=0.0)
            now = self.clock.now()
            if until > now:
                self.clock.advance(until - now)
                self.write_wait_s += until - now
            done = wait_write(node_ids)
            for i in done:
                self._write_done.pop(i, None)
            return done

        def timed_start_loading() -> int:
            tokens = sum(int(op.host_indices.numel()) for op in controller.load_queue)
            pid = start_loading()
            if tokens:
                per_layer = self.cal.h2d.seconds(tokens * self.bytes_per_token // self.layers)
                t = max(self._load_free_at, self.clock.now())
                self._layer_ready = [t + (i + 1) * per_layer for i in range(self.layers)]
                self._load_free_at = self._layer_ready[-1]
                self.h2d_busy_s += per_layer * self.layers
            return pid

        controller.write = timed_write
        controller.wait_write = timed_wait_write
        controller.start_loading = timed_start_loading

    def as_dict(self) -> dict[str, float | int]:
        return {
            "forwards": self.forwards,
            "compute_s": self.compute_s,
            "load_wait_s": self.load_wait_s,
            "write_wait_s": self.write_wait_s,
            "h2d_busy_s": self.h2d_busy_s,
            "d2h_busy_s": self.d2h_busy_s,
            "write_backlog_max_s": self.write_backlog_max_s,
        }
