"""What a single-leaf eviction inside the ``bench_cache_ops`` trace costs, and why it grows.

``python -m bench.cache_ops.evict_profile [--sizes ...] [--pages ...] [--steps N] [--out FILE]``

The project's tree plays the trace of ``bench_cache_ops`` (filled to N tokens, then ``--steps``
steps evicting 1% of N after each 1% inserted, one leaf every 10th step), once with that
schedule and once evicting a fixed 100 tokens each time (as at 10K tokens), so that eviction runs
about as often at every size. For every single-leaf eviction it records:

- the work: heap pops and stale-entry refreshes of the LRU queue (``lru_queues``), tokens freed,
  entries in the queue;
- the time: the whole eviction, the allocator's ``free`` inside it (``free``), the rest
  (``tree``: the queue, the unlink, the parent's bookkeeping);
- on every other single-leaf eviction instead (that one untimed, as the check warms it), the
  allocator's check of the leaf's slots run twice just before (``check_free``: the validation
  ``free`` starts with; read-only): ``cold`` is the first run, as the eviction would find it,
  ``warm`` the second, a microsecond later, on the same data.

If the work is the same at every size and schedule while ``cold`` grows and ``warm`` does not,
what grows is how cold the eviction path is when it runs rarely, not what it does. Medians over
the evictions; microseconds.
"""

from __future__ import annotations

import argparse
import heapq
import json
import statistics
import time
from pathlib import Path
from typing import Any

import hicache.tree.lru_queues as lru_queues
from bench.cache_ops.trace import MultiTurnTrace, ProjectDriver, play_step, timed_evict
from hicache.memory.allocator import page_ceil

FIXED_TOKENS = 100  # 1% of the smallest tree of the bench


class _CountingHeap:
    """``heapq`` with its calls counted (installed in ``lru_queues`` while a profile runs)."""

    def __init__(self) -> None:
        self.pops = self.refreshes = 0

    def heappop(self, heap: list) -> Any:
        self.pops += 1
        return heapq.heappop(heap)

    def heapreplace(self, heap: list, item: Any) -> Any:
        self.refreshes += 1
        return heapq.heapreplace(heap, item)

    heappush = staticmethod(heapq.heappush)
    heapify = staticmethod(heapq.heapify)


def profile_evict(
    tokens: int, page_size: int, steps: int, evict_tokens: int | None = None
) -> dict[str, Any]:
    """Single-leaf evictions of ``steps`` trace steps on a tree of ``tokens`` (module doc);
    ``evict_tokens``: tokens per periodic eviction (default 1% of ``tokens``)."""
    counter = _CountingHeap()
    saved = lru_queues.heapq
    lru_queues.heapq = counter  # type: ignore[assignment]
    try:
        trace = iter(MultiTurnTrace(tokens, seed=0))
        d = ProjectDriver(page_ceil(tokens + 16_384 + tokens // 50, page_size), page_size)
        while d.size() < tokens:
            play_step(d, next(trace), None)
        share = tokens // 100 if evict_tokens is None else evict_tokens
        chunk = max(page_size, share // page_size * page_size)
        clock = time.perf_counter_ns
        rows: list[dict[str, float]] = []
        checks: list[dict[str, float]] = []
        balance = 0
        for s in range(steps):
            balance += play_step(d, next(trace), None)[1]
            if balance >= chunk:
                balance -= timed_evict(d, chunk)[1]
            if s % 10 != 5:
                continue
            leaf = d.tree._device_queue.peek()
            if leaf is None:
                continue
            if len(checks) < len(rows):  # every other eviction: the check alone (it warms free)
                t0 = clock()
                d.allocator.check_free(leaf.value)
                t1 = clock()
                d.allocator.check_free(leaf.value)
                t2 = clock()
                checks.append(
                    {"check_free_cold": (t1 - t0) / 1e3, "check_free_warm": (t2 - t1) / 1e3}
                )
                balance -= d.evict(page_size)
                continue
            pops, refreshes = counter.pops, counter.refreshes
            us, freed, in_free = timed_evict(d, page_size)
            balance -= freed
            rows.append(
                {
                    "total": us,
                    "free": in_free or 0.0,
                    "tree": us - (in_free or 0.0),
                    "tokens_freed": freed,
                    "pops": counter.pops - pops,
                    "refreshes": counter.refreshes - refreshes,
                    "queue_entries": len(d.tree._device_queue),
                }
            )
        d.check()
    finally:
        lru_queues.heapq = saved
    out: dict[str, Any] = {
        "tokens": tokens,
        "page_size": page_size,
        "evict_tokens": chunk,
        "evictions": len(rows),
        "nodes": len(d.tree.all_nodes()),
    }
    for samples in (rows, checks):
        for k in samples[0] if samples else ():
            out[k] = round(statistics.median(r[k] for r in samples), 2)
    return out


COLS = ("total", "free", "tree", "check_free_cold", "check_free_warm")
WORK = ("tokens_freed", "pops", "refreshes", "queue_entries")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--sizes", type=int, nargs="*", default=[10_000, 1_000_000])
    parser.add_argument("--pages", type=int, nargs="*", default=[1, 16])
    parser.add_argument("--steps", type=int, default=1000)
    parser.add_argument("--out", type=Path, default=None, help="Write the rows as JSON here.")
    args = parser.parse_args(argv)
    print("single-leaf eviction in the trace: median microseconds (and work) per eviction")
    head = f"{'tokens':>8} {'page':>4} {'evict':>6}" + "".join(f"{c:>16}" for c in COLS)
    print(head + "".join(f"{c:>14}" for c in WORK))
    rows = []
    for ps in args.pages:
        for n in args.sizes:
            for amount in (None, FIXED_TOKENS):
                r = profile_evict(n, ps, args.steps, amount)
                rows.append(r)
                line = f"{n:>8} {ps:>4} {r['evict_tokens']:>6}"
                line += "".join(f"{r.get(c, 0.0):>16.1f}" for c in COLS)
                print(line + "".join(f"{r.get(c, 0.0):>14.1f}" for c in WORK), flush=True)
    if args.out is not None:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps({"unit": "microseconds", "rows": rows}, indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
