"""Two-tier eviction costs of ``bench_cache_ops``, with the real controller on CPU streams.

- ``inflight``: a write_through tree with 100 backed-up leaves and 0 / 1000 / 3000 backups in
  flight (held by a gate on the write stream): the cost of ``evict`` of the 100 leaves and of
  ``evict_host`` of them afterwards. Before per-page busy counts every freed node rescanned every
  copy in flight.
- ``write_back``: a write_back tree whose host pool (N tokens, 10K to 1M) is full of host-only
  leaves; the cost of evicting 200 device leaves, each of whose backups must first host-evict
  the least recently used host leaf, against the same eviction with room on the host. Before
  the host-eviction queue every such backup scanned the tree. Measured twice: with the real
  controller (the time includes waiting for the 200 copies, which run on a CPU thread that
  competes for the GIL) and with a bookkeeping controller that acks every copy at once (real
  allocators, no bytes), which isolates the tree's O(evicted x log tree) part.

Geometry is tiny (one layer, one head of 4 floats) and copies use the ``direct`` io backend.
Each timed call starts from a collected heap (``gc.collect()``), so a garbage collection that
earlier allocations made due does not land in one configuration and not the other.
"""

from __future__ import annotations

import gc
import threading
import time
from types import SimpleNamespace
from typing import Any

import torch

from hicache.builder import KVCache, build_kv_cache
from hicache.memory.allocator import TokenToKVPoolAllocator
from hicache.tree.hiradix_cache import HiRadixCache
from server_args import ServerArgs


class _Gate:
    """A copy delay that holds every copy while closed."""

    def __init__(self) -> None:
        self.event = threading.Event()
        self.event.set()

    def __call__(self) -> float:
        self.event.wait()
        return 0.0


def _cache(policy: str, page: int, device_tokens: int, host_tokens: int, gate: _Gate) -> KVCache:
    args = ServerArgs(
        device="cpu",
        dtype="float32",
        num_layers=1,
        head_num=1,
        head_dim=4,
        max_total_tokens=device_tokens,
        page_size=page,
        enable_hierarchical_cache=True,
        hicache_ratio=host_tokens / device_tokens,
        hicache_write_policy=policy,
        hicache_mem_layout="layer_first",
        hicache_io_backend="direct",
    )
    return build_kv_cache(args, copy_delay=gate)


def _insert(kv: KVCache, key: list[int]) -> None:
    slots = kv.allocator.alloc(len(key))
    if slots is None:
        kv.tree.evict(len(key))
        slots = kv.allocator.alloc(len(key))
    present = kv.tree.insert(key, slots)
    kv.allocator.free(slots[:present])


def _drain(kv: KVCache) -> None:
    kv.controller.write_stream.synchronize()
    kv.controller.load_stream.synchronize()
    kv.tree.check_hicache_events()


def measure_inflight(
    copies: int, leaves: int = 100, leaf: int = 8, reps: int = 3, max_copies: int = 3000
) -> dict:
    """Median ms of evicting ``leaves`` backed-up leaves (device, then host) with ``copies``
    backups in flight (pools sized for ``max_copies``, so only the copies differ)."""
    dev_ms, host_ms = [], []
    for _ in range(reps):
        gate = _Gate()
        total = (leaves + max_copies) * leaf
        kv = _cache("write_through", 1, total + 64, 2 * total + 64, gate)
        try:
            for i in range(leaves):
                _insert(kv, list(range(i * leaf, (i + 1) * leaf)))
            _drain(kv)
            gate.event.clear()
            base = leaves * leaf
            for i in range(copies):
                _insert(kv, list(range(base + i * leaf, base + (i + 1) * leaf)))
            assert len(kv.controller.ack_write_queue) == copies
            gc.collect()
            t0 = time.perf_counter()
            freed = kv.tree.evict(leaves * leaf)
            t1 = time.perf_counter()
            freed_host = kv.tree.evict_host(leaves * leaf)
            t2 = time.perf_counter()
            assert freed == freed_host == leaves * leaf, (freed, freed_host)
            dev_ms.append((t1 - t0) * 1e3)
            host_ms.append((t2 - t1) * 1e3)
            gate.event.set()
            _drain(kv)
            kv.check_integrity()
        finally:
            gate.event.set()
            kv.close()
    return {
        "copies_in_flight": copies,
        "evict_ms": round(sorted(dev_ms)[len(dev_ms) // 2], 3),
        "evict_host_ms": round(sorted(host_ms)[len(host_ms) // 2], 3),
    }


class BookkeepingController:
    """The controller's tree-facing calls with real page allocators and no copies: every write
    and load is acked at the next poll (or wait). Lets a benchmark time the tree alone."""

    def __init__(self, device_tokens: int, host_tokens: int, page_size: int) -> None:
        self.device_allocator = TokenToKVPoolAllocator(device_tokens, page_size, "cpu")
        self.host_allocator = TokenToKVPoolAllocator(
            host_tokens, page_size, "cpu", reserve_padding=False
        )
        self.layer_done_counter = SimpleNamespace(wait_until=lambda layer: None)
        self._writes: list[int] = []
        self._loads: list[int] = []

    def write(self, device_indices: torch.Tensor, node_id: int = -1) -> torch.Tensor | None:
        host = self.host_allocator.alloc(len(device_indices))
        if host is not None:
            self._writes.append(node_id)
        return host

    def load(self, host_indices: torch.Tensor, node_id: int = -1) -> torch.Tensor | None:
        dev = self.device_allocator.alloc(len(host_indices))
        if dev is not None:
            self._loads.append(node_id)
        return dev

    def start_loading(self) -> int:
        return 0

    def writing_check(self) -> list[int]:
        out, self._writes = self._writes, []
        return out

    def loading_check(self) -> list[int]:
        out, self._loads = self._loads, []
        return out

    def wait_write(self, node_ids: list[int] | None = None) -> list[int]:
        wanted = set(self._writes if node_ids is None else node_ids)
        self._writes = [i for i in self._writes if i not in wanted]
        return list(wanted)

    def take_failure(self, node_id: int) -> None:
        """No copies, so none fails."""
        return None

    def evict_device(self, indices: torch.Tensor) -> int:
        self.device_allocator.free(indices)
        return len(indices)

    def evict_host(self, indices: torch.Tensor) -> int:
        self.host_allocator.free(indices)
        return len(indices)

    def check_integrity(self) -> None:
        self.device_allocator.check_integrity()
        self.host_allocator.check_integrity()


class _Bookkeeping:
    """A ``KVCache``-like pair of a ``BookkeepingController`` and its write_back tree."""

    def __init__(self, page: int, device_tokens: int, host_tokens: int) -> None:
        self.controller = BookkeepingController(device_tokens, host_tokens, page)
        self.allocator = self.controller.device_allocator
        self.host_pool = self.controller.host_allocator  # available_size() is all we read
        self.tree = HiRadixCache(self.controller, page, "write_back")

    def check_integrity(self) -> None:
        self.tree.check_integrity()

    def close(self) -> None:
        return None


def measure_write_back(
    host_tokens: int, full: bool, real: bool, leaves: int = 200, leaf: int = 256
) -> float:
    """ms of a write_back eviction of ``leaves`` device leaves, with the host pool (of
    ``host_tokens``) ``full`` of host-only leaves or with room for the backups; ``real``:
    through the real controller, else the bookkeeping one."""
    page = 16
    device_tokens = leaves * leaf + 1024
    if real:
        gate = _Gate()
        host = host_tokens + (0 if full else leaves * leaf)
        kv: Any = _cache("write_back", page, device_tokens, host, gate)
    else:
        kv = _Bookkeeping(page, device_tokens, host_tokens + (0 if full else leaves * leaf))
    tree = kv.tree
    try:
        next_key = 0

        def fresh() -> list[int]:
            nonlocal next_key
            next_key += 1
            return [next_key] + [7] * (leaf - 1)

        filled = 0
        while filled + leaf <= host_tokens:  # host-only leaves, batch by batch
            batch = min(leaves, (host_tokens - filled) // leaf)
            for _ in range(batch):
                _insert(kv, fresh())
            tree.evict(batch * leaf)
            filled += batch * leaf
        for _ in range(leaves):
            _insert(kv, fresh())
        gc.collect()
        t0 = time.perf_counter()
        freed = tree.evict(leaves * leaf)
        ms = (time.perf_counter() - t0) * 1e3
        assert freed == leaves * leaf, freed
        kv.check_integrity()
    finally:
        kv.close()
    return ms


def run_pressure(quick: bool) -> dict[str, Any]:
    """Both measurements, printed and returned."""
    # Interleaved repetitions (0, 1000, 3000, 0, ...): drift on a shared machine hits all three.
    reps = 3 if quick else 7
    runs = [[measure_inflight(c, reps=1) for c in (0, 1000, 3000)] for _ in range(reps)]
    inflight = []
    for i, c in enumerate((0, 1000, 3000)):
        ev = sorted(r[i]["evict_ms"] for r in runs)
        eh = sorted(r[i]["evict_host_ms"] for r in runs)
        inflight.append(
            {"copies_in_flight": c, "evict_ms": ev[reps // 2], "evict_host_ms": eh[reps // 2]}
        )
    print(
        "eviction with copies in flight (write_through, 100 leaves of 8 tokens, ms per call, "
        f"median of {reps})"
    )
    print(f"{'copies':>8} {'evict':>10} {'evict_host':>12}")
    for r in inflight:
        print(f"{r['copies_in_flight']:>8} {r['evict_ms']:>10.3f} {r['evict_host_ms']:>12.3f}")
    base = inflight[0]
    ratio = {
        "evict": round(inflight[-1]["evict_ms"] / max(base["evict_ms"], 1e-9), 2),
        "evict_host": round(inflight[-1]["evict_host_ms"] / max(base["evict_host_ms"], 1e-9), 2),
    }
    print(f"3000 vs 0 copies in flight: evict x{ratio['evict']}, evict_host x{ratio['evict_host']}")

    sizes = (10_000, 100_000, 1_000_000)
    write_back = []
    for n in sizes:
        row: dict[str, Any] = {"host_tokens": n, "host_only_leaves": n // 256}
        for real in (False, True):
            for full in (False, True):
                name = f"{'real' if real else 'bookkeeping'}_{'host_full' if full else 'room'}"
                ms = sorted(measure_write_back(n, full, real) for _ in range(1 if quick else 3))
                row[name + "_ms"] = round(ms[len(ms) // 2], 2)
        write_back.append(row)
    print(
        "write_back eviction of 200 leaves of 256 tokens, host room vs host full "
        f"(ms per call{'' if quick else ', median of 3'})"
    )
    print(
        f"{'host tokens':>12} {'host leaves':>12} {'bookkeeping: room':>18} {'full':>8}"
        f" {'real controller: room':>22} {'full':>8}"
    )
    for r in write_back:
        print(
            f"{r['host_tokens']:>12} {r['host_only_leaves']:>12} "
            f"{r['bookkeeping_room_ms']:>18.2f} {r['bookkeeping_host_full_ms']:>8.2f} "
            f"{r['real_room_ms']:>22.2f} {r['real_host_full_ms']:>8.2f}"
        )
    return {"inflight": inflight, "inflight_3000_vs_0": ratio, "write_back": write_back}
