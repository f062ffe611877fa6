"""Where ``match_prefix`` and ``insert`` spend their time on the ``bench_cache_ops`` trace.

``python -m bench.cache_ops.profile [--sizes ...] [--pages ...] [--steps N] [--keys array list]``

The project's tree plays the trace (filled to N tokens, then ``--steps`` steps with the bench's
eviction schedule). Each call is timed as it runs; right after it, on the same key and the path it
matched, the parts of its work are timed again one by one, so they are measured on the real data
without instrumenting the tree:

- ``convert``: the key to packed bytes (``keys.key_bytes``: a buffer copy for ``array('q')``, one
  ``struct.pack`` for a list);
- ``lookup``: the child lookups by first page, one per matched node;
- ``compare``: the ``memcmp`` of each matched edge (``bytes.startswith``);
- ``cat``: ``torch.cat`` of the matched nodes' device slots (match only);
- ``clone``: the copy of the new leaf's slots (insert only).

``warm`` (match only): the same match run again right after it, on the same key and path (it
splits nothing, and the stamps it writes stay the newest, so the trace's LRU order is kept): the
walk's cost when its code and data are in cache.

The parts run warm (just after the call), so they add up to less than the call; ``rest`` is the
call less the parts: Python work per node (the walk's loop, ``descend``, the LRU refresh, the
counts), the result, and the cache misses of a cold tree. Nodes per walk and splits per call are
counted (a split creates a node: node ids before and after). Medians over the steps (a shared
CPU preempts a few calls); microseconds.
"""

from __future__ import annotations

import argparse
import statistics
import time
from typing import Any

import torch

from bench.cache_ops.trace import MultiTurnTrace, ProjectDriver, ProjectListDriver, play_step
from hicache.memory.allocator import page_ceil
from hicache.tree.keys import key_bytes
from hicache.tree.node import TreeNode

PARTS = ("convert", "lookup", "compare", "cat", "clone")


def _path(tree: Any, node: TreeNode) -> list[TreeNode]:
    path = []
    while node is not tree.root_node:
        path.append(node)
        node = node.parent
    return path[::-1]


def _covering(tree: Any, kb: bytes) -> list[TreeNode]:
    """The nodes whose edges ``kb`` covers whole, from the root (reads only)."""
    path, node, off = [], tree.root_node, 0
    while off < len(kb):
        x = node.children.get(kb[off : off + tree.page_bytes])
        if x is None or not kb.startswith(x.tokens, off):
            break
        path.append(x)
        off += len(x.tokens)
        node = x
    return path


def _parts(
    tree: Any, key: Any, read: int, path: list[TreeNode], leaf: TreeNode | None
) -> dict[str, float]:
    """The parts of a walk over ``path`` (and the copy of ``leaf``'s slots), timed again;
    ``read``: the tokens of ``key`` the call converted."""
    clock = time.perf_counter_ns
    pb = tree.page_bytes
    part = key if read >= len(key) else key[:read]
    t0 = clock()
    kb = key_bytes(part)
    t1 = clock()
    off, parent = 0, tree.root_node
    for x in path:
        parent.children.get(kb[off : off + pb])
        off += len(x.tokens)
        parent = x
    t2 = clock()
    off = 0
    for x in path:
        kb.startswith(x.tokens, off)
        off += len(x.tokens)
    t3 = clock()
    values = [x.value for x in path if x.value is not None]
    t4 = clock()
    if values and leaf is None:
        torch.cat(values)
    t5 = clock()
    if leaf is not None:
        leaf.value.clone()
    t6 = clock()
    return {
        "convert": (t1 - t0) / 1e3,
        "lookup": (t2 - t1) / 1e3,
        "compare": (t3 - t2) / 1e3,
        "cat": (t5 - t4) / 1e3,
        "clone": (t6 - t5) / 1e3,
    }


def profile(tokens: int, page_size: int, steps: int, driver: type) -> dict[str, Any]:
    """Profile of ``steps`` trace steps on a tree of ``tokens`` (see the module docstring)."""
    trace = iter(MultiTurnTrace(tokens, seed=0))
    d = driver(page_ceil(tokens + 16_384 + tokens // 50, page_size), page_size)
    while d.size() < tokens:
        play_step(d, next(trace), None)
    tree = d.tree
    clock = time.perf_counter_ns
    rows: dict[str, list[dict[str, float]]] = {"match": [], "insert": []}
    chunk = max(page_size, tokens // 100 // page_size * page_size)
    balance = 0
    for s in range(steps):
        step = next(trace)
        key = d.prepare(step.key)
        ids = next(TreeNode._ids)
        t0 = clock()
        m = tree.match_prefix(key)
        total = (clock() - t0) / 1e3
        splits = next(TreeNode._ids) - ids - 1
        t0 = clock()
        tree.match_prefix(key)  # the same walk again, warm (no split; stamps stay the newest)
        warm = (clock() - t0) / 1e3
        path = _path(tree, m.last_host_node)
        rows["match"].append(
            {
                "total": total,
                "warm": warm,
                "nodes": len(path),
                "splits": splits,
                **_parts(tree, key, len(key), path, None),
            }
        )
        tree.inc_lock_ref(m.last_device_node)
        matched = m.device_indices.numel()
        need = len(step.key) - matched
        slots = d.alloc(need)
        if slots is None:
            d.evict(need - d.available())
            slots = d.alloc(need)
        full = torch.cat([m.device_indices, slots])
        ids = next(TreeNode._ids)
        t0 = clock()
        present = tree.insert(key, full)
        total = (clock() - t0) / 1e3
        created = next(TreeNode._ids) - ids - 1
        path = _covering(tree, key_bytes(key))
        leaf = path[-1] if path and path[-1].id > ids else None  # the leaf this insert made
        walked = path[:-1] if leaf is not None else path
        rows["insert"].append(
            {
                "total": total,
                "warm": 0.0,  # a second insert of the key would do other work (no new leaf)
                "nodes": len(walked),
                "splits": created - (leaf is not None),
                **_parts(tree, key, len(key), walked, leaf),
            }
        )
        if present > matched:
            d.free(full[matched:present])
        tree.dec_lock_ref(m.last_device_node)
        balance += need
        if balance >= chunk:
            balance -= d.evict(chunk)
        if s % 10 == 5:
            balance -= d.evict(page_size)
    d.check()
    out: dict[str, Any] = {"tokens": tokens, "page_size": page_size, "keys": driver.name}
    for op, samples in rows.items():
        med = {k: statistics.median(r[k] for r in samples) for k in ("total", "warm", *PARTS)}
        med["rest"] = med["total"] - sum(med[p] for p in PARTS)
        med["nodes"] = statistics.fmean(r["nodes"] for r in samples)
        med["splits"] = statistics.fmean(r["splits"] for r in samples)
        out[op] = {k: round(v, 2) for k, v in med.items()}
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--sizes", type=int, nargs="*", default=[10_000, 100_000, 1_000_000])
    parser.add_argument("--pages", type=int, nargs="*", default=[1, 16])
    parser.add_argument("--steps", type=int, default=1000)
    parser.add_argument("--keys", nargs="*", default=["array", "list"], choices=["array", "list"])
    args = parser.parse_args(argv)
    drivers = {"array": ProjectDriver, "list": ProjectListDriver}
    print("median microseconds per call; parts re-timed warm after the call; rest = total - parts")
    head = f"{'tokens':>8} {'page':>4} {'keys':>6} {'op':>6} {'total':>7} {'warm':>6}"
    head += "".join(f"{p:>8}" for p in (*PARTS, "rest")) + f"{'nodes':>7}{'splits':>7}"
    print(head)
    for keys in args.keys:
        for ps in args.pages:
            for n in args.sizes:
                r = profile(n, ps, args.steps, drivers[keys])
                for op in ("match", "insert"):
                    c = r[op]
                    line = f"{n:>8} {ps:>4} {keys:>6} {op:>6} {c['total']:>7.1f}"
                    line += f" {c['warm']:>6.1f}" if op == "match" else f" {'-':>6}"
                    line += "".join(f"{c[p]:>8.1f}" for p in (*PARTS, "rest"))
                    print(line + f"{c['nodes']:>7.1f}{c['splits']:>7.3f}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
