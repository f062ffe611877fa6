"""Per-layer load events (SGLang ``LayerDoneCounter`` / ``LayerLoadingEvent``): the forward pass
waits for layer ``i``'s load only (through ``HiRadixCache.layer_wait``)."""

from __future__ import annotations

from hicache_prefill.hicache.transfer.errors import LoadBackError
from hicache_prefill.hicache.transfer.streams import Event, Streams


class LayerLoadingEvent:
    """Per-layer load events of one ``start_loading`` call and the node ids it loads."""

    def __init__(
        self,
        num_layers: int,
        streams: Streams,
        node_ids: list[int] | None = None,
    ) -> None:
        self.node_ids = list(node_ids or ())
        self.start_event = streams.new_event(enable_timing=True)
        self.load_events = [
            streams.new_event(enable_timing=(i == num_layers - 1)) for i in range(num_layers)
        ]

    @property
    def finish_event(self) -> Event:
        return self.load_events[-1]


class LayerDoneCounter:
    """Lets layer ``i``'s attention wait for layer ``i``'s load only (SGLang's name).

    ``wait_until(layer)``: on CUDA the compute stream waits; on CPU the caller blocks, and raises
    ``LoadBackError`` when a layer up to it failed while it ran (the KV must not be read).
    """

    def __init__(self, num_layers: int, streams: Streams) -> None:
        self.num_layers = num_layers
        self.streams = streams
        self.events: dict[int, LayerLoadingEvent] = {}
        self._next_id = 0
        self.consumer_index = -1

    def update_producer(self, node_ids: list[int] | None = None) -> int:
        pid = self._next_id
        self._next_id += 1
        self.events[pid] = LayerLoadingEvent(self.num_layers, self.streams, node_ids)
        return pid

    def set_consumer(self, index: int) -> None:
        self.consumer_index = index

    def wait_until(self, threshold: int) -> None:
        if not 0 <= threshold < self.num_layers:
            raise ValueError(f"layer must be in [0, {self.num_layers}), got {threshold}")
        ev = self.events.get(self.consumer_index)
        if ev is None:
            return
        self.streams.compute.wait_event(ev.load_events[threshold])
        for layer in range(threshold + 1):
            error = ev.load_events[layer].error
            if error is not None:
                raise LoadBackError(
                    f"load_to_device_per_layer(layer_id={layer})",
                    f"the load of node ids {ev.node_ids} failed while it ran; layer "
                    f"{threshold}'s KV must not be read",
                    ev.node_ids,
                    error,
                ) from error

    def release(self, index: int) -> None:
        self.events.pop(index, None)
