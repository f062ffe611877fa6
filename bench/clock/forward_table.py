"""The forward-pass half of the deterministic mode's calibration (``bench.clock.calibrate``).

``calibrate_forward`` times the real model's ``forward_extend`` over a grid of batch shapes (new
tokens ``n``, prefix tokens read ``p``), in interleaved rounds (every shape once per round,
shuffled) so that a burst of load on a shared machine hits every shape alike; the median per
shape makes a ``ForwardTable``. A batch's cost is the bilinear interpolation of the table at each
request's ``(n, p)`` (linear extrapolation past the grid; below the smallest ``n`` the smallest
``n``'s time), summed over the requests, less ``pair_saving_s`` per extra request (what one
forward of two requests saves against two forwards, measured on two-request batches of the
grid). Interpolation, unlike a fitted formula, reproduces every measured shape exactly, so the
costs move only as much as the measurements do. Times: ``bench.common.call_timer``.
"""

from __future__ import annotations

import bisect
import logging
import random
import statistics
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from bench.common import call_timer, sync_device

logger = logging.getLogger(__name__)


Shape = tuple[int, int]
"""``(new_tokens, prefix_tokens)`` of one request in a batch."""



def _axis(xs: Sequence[int], x: float) -> tuple[int, float]:
    """Cell ``i`` and weight ``w`` of ``x`` on ascending ``xs``: ``(1 - w) * f[i] + w * f[i+1]``
    (``w > 1`` past the end: linear extrapolation; ``x`` below ``xs[0]`` counts as ``xs[0]``)."""
    if x <= xs[0]:
        return 0, 0.0
    i = min(bisect.bisect_right(xs, x) - 1, len(xs) - 2)
    return i, (x - xs[i]) / (xs[i + 1] - xs[i])


@dataclass
class ForwardTable:
    """Forward-pass cost: ``cost(batch)`` in seconds, from ``single[i][j]`` (median seconds of
    one request of ``ns[i]`` new and ``ps[j]`` prefix tokens) and ``pair_saving_s``."""

    ns: list[int]
    ps: list[int]
    single: list[list[float]]
    pair_saving_s: float = 0.0
    points: list[dict[str, Any]] = field(default_factory=list)

    def __post_init__(self) -> None:
        if len(self.ns) < 2 or len(self.ps) < 2:
            raise ValueError("ns and ps need at least two values each")
        if self.ns != sorted(set(self.ns)) or self.ps != sorted(set(self.ps)):
            raise ValueError("ns and ps must be strictly ascending")
        if [len(r) for r in self.single] != [len(self.ps)] * len(self.ns):
            raise ValueError(f"single must be {len(self.ns)} x {len(self.ps)}")

    def one(self, n: int, p: int) -> float:
        """Seconds of a forward of one request (``n`` new, ``p`` prefix tokens)."""
        i, u = _axis(self.ns, n)
        j, v = _axis(self.ps, p)
        f = self.single
        lo = (1 - v) * f[i][j] + v * f[i][j + 1]
        hi = (1 - v) * f[i + 1][j] + v * f[i + 1][j + 1]
        return max((1 - u) * lo + u * hi, 0.0)

    def cost(self, batch: Sequence[Shape]) -> float:
        if not batch:
            return 0.0
        total = sum(self.one(n, p) for n, p in batch) - (len(batch) - 1) * self.pair_saving_s
        return max(total, max(self.one(n, p) for n, p in batch))

    def as_dict(self) -> dict[str, Any]:
        return {"ns": self.ns, "ps": self.ps, "single_s": self.single,
                "pair_saving_s": self.pair_saving_s, "points": self.points}  # fmt: skip


def table_from(measured: Sequence[tuple[Sequence[Shape], list[float]]]) -> ForwardTable:
    """The table of single-request medians (a full ``ns x ps`` grid is required) and the median
    saving of the two-request batches (0 when none, never negative)."""
    singles = {tuple(b[0]): statistics.median(s) for b, s in measured if len(b) == 1}
    ns = sorted({n for n, _ in singles})
    ps = sorted({p for _, p in singles})
    missing = [(n, p) for n in ns for p in ps if (n, p) not in singles]
    if missing:
        raise ValueError(f"measured lacks single-request shapes {missing}")
    table = ForwardTable(ns, ps, [[singles[(n, p)] for p in ps] for n in ns])
    savings = [
        sum(table.one(n, p) for n, p in b) - statistics.median(s)
        for b, s in measured
        if len(b) == 2
    ]
    table.pair_saving_s = max(0.0, statistics.median(savings)) if savings else 0.0
    for b, s in measured:
        table.points.append({"batch": [list(x) for x in b], "median_s": statistics.median(s),
                             "min_s": min(s), "max_s": max(s),
                             "model_s": table.cost(b)})  # fmt: skip
    return table


def forward_grid(max_new: int, max_prefix: int, page_size: int) -> list[list[Shape]]:
    """Shapes to measure: ``n`` from one page doubling up to ``max_new``, ``p`` at 0, 1/4, 1/2
    and all of ``max_prefix`` (page-aligned), and two-request batches at a few sizes."""
    ns, n = [], page_size
    while n < max_new:
        ns.append(n)
        n *= 2
    ns.append(max(max_new, 2 * page_size) if len(ns) < 1 else max_new)
    ps = sorted({(max_prefix * f // 4) // page_size * page_size for f in (0, 1, 2, 4)})
    if len(ps) < 2:
        ps.append(page_size)
    grid: list[list[Shape]] = [[(n, p)] for n in ns for p in ps]
    for n in ns[len(ns) // 2 :]:
        half = max(page_size, n // 2 // page_size * page_size)
        grid.append([(half, ps[-1]), (half, ps[len(ps) // 2])])
    return grid


def calibrate_forward(
    model: Any,
    make_pool: Callable[[int], Any],
    grid: Sequence[Sequence[Shape]],
    rounds: int = 15,
    seed: int = 0,
    timer: str | None = None,
) -> ForwardTable:
    """Time ``model.forward_extend`` on every batch of ``grid``, ``rounds`` interleaved rounds,
    and tabulate the medians (``table_from``). ``make_pool(num_slots)`` builds a device pool of
    the model's geometry (its slots are overwritten). Slots are scattered pages, as the
    allocator hands them out. ``timer``: ``bench.common.call_timer``'s."""
    from prefill.model.paged import ExtendInput

    need = max(sum(n + p for n, p in b) for b in grid)
    pool = make_pool(need)
    page = pool.page_size
    rng = random.Random(seed)
    pages = list(range(1, need // page + 1))
    vocab = model.config.vocab_size
    gen = torch.Generator().manual_seed(seed)
    device = pool.device

    def inputs(batch: Sequence[Shape]) -> list[Any]:
        rng.shuffle(pages)
        slots = torch.cat([torch.arange(q * page, (q + 1) * page) for q in pages])
        out, at = [], 0
        for n, p in batch:
            ids = torch.randint(1, vocab, (n,), generator=gen)
            out.append(ExtendInput(ids, slots[at : at + p + n].to(device), p))
            at += p + n
        return out

    samples: dict[int, list[float]] = {i: [] for i in range(len(grid))}
    order = list(range(len(grid)))
    clock = call_timer(device, timer)
    model.forward_extend(pool, inputs(grid[0]))  # warm-up
    for _ in range(rounds):
        rng.shuffle(order)
        for i in order:
            batch = inputs(grid[i])
            sync_device(device)
            t0 = clock()
            model.forward_extend(pool, batch)
            sync_device(device)
            samples[i].append(clock() - t0)
    del pool
    return table_from([(grid[i], samples[i]) for i in range(len(grid))])
