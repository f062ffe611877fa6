"""Calibration of the deterministic benchmark mode: what a forward pass and a KV copy cost on this
machine, measured in the run, so the executor can be scheduled on a virtual clock.

- ``calibrate_forward``: time of the real model's ``forward_extend`` over a grid of batch shapes
  (new tokens ``n``, prefix tokens read ``p``), measured in interleaved rounds (every shape once
  per round, shuffled) so that a burst of load on a shared machine hits every shape alike; the
  median per shape makes a table. A batch's cost is the bilinear interpolation of the table at
  each request's ``(n, p)`` (linear extrapolation past the grid; below the smallest ``n`` the
  smallest ``n``'s time), summed over the requests, less ``pair_saving_s`` per extra request
  (what one forward of two requests saves against two forwards, measured on two-request batches
  of the grid). Interpolation, unlike a fitted formula, reproduces every measured shape exactly,
  so the costs move only as much as the measurements do.
- ``calibrate_copies``: the cache's own copy ops (``load_to_device_per_layer``,
  ``backup_from_device_all_layer``, the configured io backend) over a few sizes, fitted as
  ``t = per_call + bytes / bytes_per_s``.

Times are seconds: on CUDA wall time around a device synchronization; on a CPU the calling
thread's CPU time (``time.thread_time``), so that other jobs on a shared machine, which only
deschedule the thread, do not move the calibration.
"""

from __future__ import annotations

import bisect
import logging
import random
import statistics
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

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
) -> ForwardTable:
    """Time ``model.forward_extend`` on every batch of ``grid``, ``rounds`` interleaved rounds,
    and tabulate the medians (``table_from``). ``make_pool(num_slots)`` builds a device pool of
    the model's geometry (its slots are overwritten). Slots are scattered pages, as the
    allocator hands them out."""
    from prefill.model import ExtendInput

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
    clock = _timer(device)
    model.forward_extend(pool, inputs(grid[0]))  # warm-up
    for _ in range(rounds):
        rng.shuffle(order)
        for i in order:
            batch = inputs(grid[i])
            _sync(device)
            t0 = clock()
            model.forward_extend(pool, batch)
            _sync(device)
            samples[i].append(clock() - t0)
    del pool
    return table_from([(grid[i], samples[i]) for i in range(len(grid))])


@dataclass
class CopyFit:
    """One copy direction: ``seconds(nbytes, calls) = calls * per_call_s + nbytes /
    bytes_per_s``."""

    direction: str
    per_call_s: float
    bytes_per_s: float
    points: list[dict[str, Any]] = field(default_factory=list)

    def seconds(self, nbytes: int, calls: int = 1) -> float:
        return calls * self.per_call_s + nbytes / self.bytes_per_s

    def as_dict(self) -> dict[str, Any]:
        return {"direction": self.direction, "per_call_s": self.per_call_s,
                "gb_per_s": self.bytes_per_s / 1e9, "points": self.points}  # fmt: skip


def fit_copy(direction: str, measured: Sequence[tuple[int, int, float]]) -> CopyFit:
    """Least squares of ``(nbytes, calls, seconds)`` as ``calls * a + nbytes / bw`` (``a >= 0``;
    relative error). Raises ``ValueError`` with fewer than two sizes or a non-positive time."""
    if len({b for b, _, _ in measured}) < 2 or any(s <= 0 for _, _, s in measured):
        raise ValueError("need at least two byte counts and positive times")
    x = torch.tensor([[c, b] for b, c, _ in measured], dtype=torch.float64)
    t = torch.tensor([s for _, _, s in measured], dtype=torch.float64)
    sol = torch.linalg.lstsq(x / t[:, None], torch.ones_like(t)[:, None]).solution[:, 0]
    per_call, per_byte = float(sol[0]), float(sol[1])
    if per_call < 0 or per_byte <= 0:  # no usable intercept: pure bandwidth through the points
        per_call = 0.0
        per_byte = float((x[:, 1] / t).sum() / (x[:, 1] ** 2 / t**2).sum())
    fit = CopyFit(direction, per_call, 1.0 / per_byte)
    for nbytes, calls, secs in measured:
        pred = fit.seconds(nbytes, calls)
        fit.points.append({"bytes": nbytes, "calls": calls, "median_s": secs, "fit_s": pred,
                           "rel_err": (pred - secs) / secs})  # fmt: skip
    return fit


def calibrate_copies(cache: Any, sizes: Sequence[int], reps: int = 7) -> tuple[
    CopyFit, CopyFit
]:  # fmt: skip
    """``(h2d, d2h)`` fits from the cache's own copy ops (its io backend and host layout) at
    ``sizes`` tokens: H2D one call per layer (a load back), D2H one all-layer call (a backup).
    Overwrites pool contents: use a cache that holds nothing yet."""
    host, dev, io = cache.host_pool, cache.device_pool, cache.controller.io_backend
    page, layers = dev.page_size, dev.layer_num
    per_token = host.size_per_token
    gen = torch.Generator().manual_seed(0)
    h2d, d2h = [], []
    for tokens in sizes:
        pages = tokens // page
        if pages < 1 or pages > min(dev.size, host.size) // page:
            continue
        dpages = torch.randperm(dev.size // page, generator=gen)[:pages] + 1  # page 0: padding
        hpages = torch.randperm(host.size // page, generator=gen)[:pages]
        d_idx = (dpages[:, None] * page + torch.arange(page)).flatten()
        h_idx = (hpages[:, None] * page + torch.arange(page)).flatten()
        if io == "kernel":
            h_arg, d_arg = h_idx.to(dev.device), d_idx.to(dev.device)
        else:
            order = h_idx.argsort() if host.layout == "layer_first" else torch.arange(h_idx.numel())
            h_arg, d_arg = h_idx[order], d_idx[order]

        def load(h: torch.Tensor = h_arg, d: torch.Tensor = d_arg) -> None:
            for layer in range(layers):
                host.load_to_device_per_layer(dev, h, d, layer, io)

        def backup(h: torch.Tensor = h_arg, d: torch.Tensor = d_arg) -> None:
            host.backup_from_device_all_layer(dev, h, d, io)

        nbytes = tokens * per_token
        h2d.append((nbytes, layers, _time_calls(load, dev.device, reps)))
        d2h.append((nbytes, 1, _time_calls(backup, dev.device, reps)))
    return fit_copy("h2d", h2d), fit_copy("d2h", d2h)


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _timer(device: torch.device) -> Callable[[], float]:
    """CUDA: wall time (around a synchronization). CPU: this thread's CPU time, which time spent
    descheduled by other jobs on a shared machine does not inflate (torch runs the ops on the
    calling thread: the benchmarks set one intra-op thread)."""
    return time.perf_counter if device.type == "cuda" else time.thread_time


def _time_calls(fn: Callable[[], Any], device: torch.device, reps: int) -> float:
    """Median seconds of ``reps`` calls of ``fn`` after one warm-up call (``_timer``)."""
    clock = _timer(device)
    fn()
    samples = []
    for _ in range(reps):
        _sync(device)
        t0 = clock()
        fn()
        _sync(device)
        samples.append(clock() - t0)
    return statistics.median(samples)


@dataclass
class Calibration:
    """Everything the virtual clock charges: forward table, both copy fits, how long it took."""

    forward: ForwardTable
    h2d: CopyFit
    d2h: CopyFit
    num_layers: int
    wall_s: float = 0.0

    def as_dict(self) -> dict[str, Any]:
        return {"forward": self.forward.as_dict(), "h2d": self.h2d.as_dict(),
                "d2h": self.d2h.as_dict(), "num_layers": self.num_layers,
                "wall_s": self.wall_s}  # fmt: skip


def calibrate_run(
    args: Any, model: Any, max_new: int, max_prefix: int, rounds: int | None = None
) -> Calibration:
    """The calibration of one benchmark run: ``model``'s forward over ``forward_grid(max_new,
    max_prefix)`` and the copies of a cache built from ``args`` (hierarchical; it is closed and
    its host pool released before returning). ``rounds``: 5 on CUDA (GPU times repeat closely),
    15 on a CPU (shared cores: the median needs more samples)."""
    if rounds is None:
        rounds = 5 if torch.cuda.is_available() else 15
    from hicache.cache import build_kv_cache
    from hicache.memory_pool import MHATokenToKVPool

    t0 = time.perf_counter()
    page = args.page_size

    def make_pool(slots: int) -> Any:
        return MHATokenToKVPool.from_server_args(args, size=(slots + page - 1) // page * page)

    fwd = calibrate_forward(model, make_pool, forward_grid(max_new, max_prefix, page), rounds)
    cache = build_kv_cache(args)
    try:
        slots = min(cache.device_pool.size, cache.host_pool.size)
        sizes = [s for s in (4 * page, 256, 1024, 4096) if s <= slots] or [page, slots]
        h2d, d2h = calibrate_copies(cache, sizes)
    finally:
        cache.close()
        cache.host_pool.destroy()
    cal = Calibration(fwd, h2d, d2h, args.num_layers, time.perf_counter() - t0)
    logger.info("calibration: %s", cal.as_dict())
    return cal


def describe(cal: Calibration) -> str:
    """One line for the console."""
    f = cal.forward
    return (
        f"forward of one request: {f.one(f.ns[0], 0) * 1e3:.2f} ms ({f.ns[0]} tokens) .. "
        f"{f.one(f.ns[-1], f.ps[-1]) * 1e3:.2f} ms ({f.ns[-1]} tokens after a {f.ps[-1]}-token "
        f"prefix), {len(f.points)} shapes; a second request in the batch saves "
        f"{f.pair_saving_s * 1e3:.2f} ms; H2D {cal.h2d.bytes_per_s / 1e9:.2f} GB/s + "
        f"{cal.h2d.per_call_s * 1e6:.0f} us/call, D2H {cal.d2h.bytes_per_s / 1e9:.2f} GB/s + "
        f"{cal.d2h.per_call_s * 1e6:.0f} us/call; calibrated in {cal.wall_s:.1f} s"
    )
