"""Host-side cost per radix-tree operation for trees of 10K to 1M cached tokens.

What is timed: the scheduler-thread bookkeeping of ``HiRadixCache`` (write_through) -- tree
walks, splits, slot-tensor slicing and concatenation, allocator calls, LRU heaps. No KV bytes are
moved: the controller here is a bookkeeping stub (real page allocators for both tiers, copies
acked at once), so the numbers are the Python overhead a scheduler pays per call on any machine,
GPU or not. The ceiling they are compared with is a decode step (~10-30 ms on a GPU): an op that
costs a noticeable fraction of that is a scheduling bottleneck.

Workload: conversations of ``seq_len`` tokens (1024, and 128 in the full run for a tree with 8x
more nodes per token); every ``GROUP`` of them shares a ``seq_len / 4``-token system prompt, so
the tree holds ~``N / seq_len`` leaves under ``N / (seq_len * GROUP)`` branches. Cost grows with
the number of nodes, not tokens.

Ops (each timed alone, median and p90 over repetitions, microseconds per call):

- ``match_hit``: ``match_prefix`` of a cached conversation (full device hit).
- ``match_miss``: ``match_prefix`` of a key sharing only the system prompt.
- ``insert``: ``insert`` of a new conversation under a cached system prompt (plus its backup
  bookkeeping under write_through).
- ``evict``: ``evict(seq_len)`` -- collects device leaves (O(nodes)), pops the LRU one.
- ``evict_host``: ``evict_host(seq_len)`` -- collects host-only leaves (O(nodes)).
- ``load_back``: ``init_load_back`` of a host-only conversation + ``ready_to_load_host_cache`` +
  ``check_hicache_events`` (the ack).

``python -m bench.bench_cache_ops [--quick] [--out results]`` prints a table and writes
``bench_cache_ops.json``.
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from hicache.allocator import TokenToKVPoolAllocator
from hicache.hiradix_cache import HiRadixCache

GROUP = 8


class _LayerCounter:
    def wait_until(self, layer: int) -> None:
        return None


class BookkeepingController:
    """The controller's tree-facing API with no copies: writes and loads are acked at the next
    poll. Lets the benchmark time the tree alone."""

    def __init__(self, device_tokens: int, host_tokens: int, page_size: int) -> None:
        self.device_allocator = TokenToKVPoolAllocator(device_tokens, page_size, "cpu")
        self.host_allocator = TokenToKVPoolAllocator(
            host_tokens, page_size, "cpu", reserve_padding=False
        )
        self.layer_done_counter = _LayerCounter()
        self._writes: list[int] = []
        self._loads: list[int] = []

    def write(self, device_indices: torch.Tensor, node_id: int) -> torch.Tensor | None:
        host = self.host_allocator.alloc(len(device_indices))
        if host is not None:
            self._writes.append(node_id)
        return host

    def load(self, host_indices: torch.Tensor, node_id: int) -> torch.Tensor | None:
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

    def wait_write(self, node_ids: list[int]) -> None:
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


def _conversation(rng: random.Random, group: int, seq_len: int, vocab: int = 50_000) -> list[int]:
    shared = [(group * 7919 + i) % vocab for i in range(seq_len // 4)]
    return shared + [rng.randrange(vocab) for _ in range(seq_len - len(shared))]


def _insert_new(tree: HiRadixCache, key: list[int]) -> None:
    alloc = tree.allocator
    slots = alloc.alloc(len(key))
    if slots is None:
        tree.check_hicache_events()
        tree.evict(len(key))
        slots = alloc.alloc(len(key))
    present = tree.insert(key, slots)
    alloc.free(slots[:present])


def _time_us(fn: Callable[[], Any], setup: Callable[[], Any] | None, reps: int) -> list[float]:
    out = []
    for _ in range(reps):
        if setup is None:
            t0 = time.perf_counter_ns()
            fn()
        else:
            arg = setup()
            t0 = time.perf_counter_ns()
            fn(arg)
        out.append((time.perf_counter_ns() - t0) / 1e3)
    return out


def bench_size(
    num_tokens: int, page_size: int, reps: int, seq_len: int = 1024, seed: int = 0
) -> dict[str, Any]:
    """Build a tree of ``num_tokens`` cached tokens and time each op ``reps`` times."""
    rng = random.Random(seed)
    n_seq = max(GROUP, num_tokens // seq_len)
    device_tokens = (n_seq + 4 * GROUP) * seq_len
    ctrl = BookkeepingController(device_tokens, 2 * device_tokens, page_size)
    tree = HiRadixCache(ctrl, page_size, "write_through", load_back_threshold=page_size)
    seqs = [_conversation(rng, i // GROUP, seq_len) for i in range(n_seq)]
    t0 = time.perf_counter()
    for s in seqs:
        _insert_new(tree, s)
    tree.check_hicache_events()
    build_s = time.perf_counter() - t0
    nodes = len(tree.all_nodes())

    res: dict[str, Any] = {}
    res["match_hit"] = _time_us(lambda: tree.match_prefix(rng.choice(seqs)), None, reps)
    res["match_miss"] = _time_us(
        lambda k: tree.match_prefix(k),
        lambda: _conversation(rng, rng.randrange(n_seq // GROUP), seq_len),
        reps,
    )

    fresh: list[list[int]] = []

    def new_key() -> tuple[list[int], torch.Tensor]:
        key = _conversation(rng, rng.randrange(n_seq // GROUP), seq_len)
        tree.check_hicache_events()  # the scheduler polls acks every step
        slots = tree.allocator.alloc(seq_len)
        if slots is None:
            tree.evict(seq_len)
            slots = tree.allocator.alloc(seq_len)
        fresh.append(key)
        return key, slots

    def do_insert(arg: tuple[list[int], torch.Tensor]) -> None:
        present = tree.insert(arg[0], arg[1])
        tree.allocator.free(arg[1][:present])

    res["insert"] = _time_us(do_insert, new_key, reps)
    tree.check_hicache_events()
    everything = seqs + fresh

    def refill() -> None:
        """Re-cache one conversation (reviving it if host-only) so a device leaf is evictable."""
        key = rng.choice(everything)
        slots = tree.allocator.alloc(seq_len)
        if slots is None:
            tree.evict(seq_len)
            slots = tree.allocator.alloc(seq_len)
        do_insert((key, slots))
        tree.check_hicache_events()

    res["evict"] = _time_us(lambda _: tree.evict(seq_len), refill, reps)

    def host_hit() -> Any:
        """A host-only conversation: cache one, evict it to the host, match it."""
        refill()
        for _ in range(8):
            m = tree.match_prefix(rng.choice(everything))
            if m.host_hit_length > 0:
                return m
            tree.evict(seq_len)
        return m

    def do_load(m: Any) -> None:
        if m.host_hit_length:
            tree.init_load_back(m.last_host_node, m.host_hit_length)
            tree.ready_to_load_host_cache()
        tree.check_hicache_events()

    res["load_back"] = _time_us(do_load, host_hit, reps)

    def host_leaf() -> None:
        refill()
        tree.evict(seq_len)

    res["evict_host"] = _time_us(lambda _: tree.evict_host(seq_len), host_leaf, reps)
    tree.check_integrity()

    out: dict[str, Any] = {
        "tokens": num_tokens,
        "page_size": page_size,
        "seq_len": seq_len,
        "nodes": nodes,
        "build_s": round(build_s, 3),
        "reps": reps,
    }
    for op, samples in res.items():
        samples = sorted(samples)
        out[op] = {
            "median_us": round(statistics.median(samples), 2),
            "p90_us": round(samples[int(0.9 * (len(samples) - 1))], 2),
        }
    return out


OPS = ("match_hit", "match_miss", "insert", "evict", "evict_host", "load_back")


def _print_table(rows: list[dict[str, Any]]) -> None:
    print("host-side cost per op (median / p90, microseconds per call)")
    head = f"{'tokens':>9} {'conv':>5} {'page':>4} {'nodes':>7}"
    print(head + "".join(f"{op:>20}" for op in OPS))
    for r in rows:
        cells = "".join(f"{r[op]['median_us']:>10.1f} /{r[op]['p90_us']:>8.1f}" for op in OPS)
        print(f"{r['tokens']:>9} {r['seq_len']:>5} {r['page_size']:>4} {r['nodes']:>7}" + cells)


def run(quick: bool = True, out_dir: Path | str = "results") -> dict[str, Any]:
    """Run the sweep over 10K, 100K and 1M cached tokens (quick: page 16, 1024-token
    conversations, 30 repetitions, a few seconds; full: also page 1 and 128-token conversations,
    100 repetitions), print the table and write ``bench_cache_ops.json`` under ``out_dir``.
    Returns the summary dict."""
    sizes = (10_000, 100_000, 1_000_000)
    reps = 30 if quick else 100
    rows = [bench_size(n, 16, reps) for n in sizes]
    if not quick:
        rows += [bench_size(n, 1, reps) for n in sizes]
        rows += [bench_size(n, 16, reps, seq_len=128) for n in sizes]
    _print_table(rows)
    small, large = rows[0], rows[len(sizes) - 1]
    growth = {
        op: round(large[op]["median_us"] / max(small[op]["median_us"], 1e-9), 1) for op in OPS
    }
    print(
        f"summary: {large['tokens']} vs {small['tokens']} tokens (page {large['page_size']}): "
        + ", ".join(f"{op} x{g}" for op, g in growth.items())
        + "; compare with a ~10-30 ms GPU decode step"
    )
    result = {
        "unit": "microseconds per call",
        "rows": rows,
        "growth_largest_vs_smallest": growth,
        "headline": {
            f"{op} @ {large['tokens']} tokens (median us)": large[op]["median_us"] for op in OPS
        },
        # every row ended with tree.check_integrity() (raises on a leak or a broken invariant)
        "integrity": {"leaked_slots": 0},
    }
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    (out / "bench_cache_ops.json").write_text(json.dumps(result, indent=2))
    return result


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--quick", action="store_true", help="Page 16, 1024-token conversations.")
    parser.add_argument("--out", type=Path, default=Path("results"), help="Output folder.")
    args = parser.parse_args(argv)
    run(quick=args.quick, out_dir=args.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
