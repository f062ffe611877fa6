"""The copy half of the deterministic mode's calibration: ``t = calls * per_call + bytes / bw``
per kind of copy, measured in the run with the project's own copy ops.

- ``calibrate_copies``: the cache's H2D load back (one ``load_to_device_per_layer`` call per
  layer) and D2H backup (one ``backup_from_device_all_layer`` call), with the configured io
  backend and host layout.
- ``calibrate_transfer_copy``: the decode side's read of a send (``DecodeSide.copy_kv``:
  ``transfer_kv_direct`` on a CPU, ``transfer_kv_all_layer`` on CUDA), the in-process stand-in
  for the KV transport; the default transfer rate of the virtual clock
  (``bench.clock.transport``).

Times: ``time_calls`` (median of repeated calls, ``bench.common.call_timer``).
"""

from __future__ import annotations

import logging
import statistics
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from bench.common import call_timer, sync_device

__all__ = ["CopyFit", "calibrate_copies", "calibrate_transfer_copy", "fit_copy", "time_calls"]

logger = logging.getLogger(__name__)


def time_calls(
    fn: Callable[[], Any], device: torch.device, reps: int, timer: str | None = None
) -> float:
    """Median seconds of ``reps`` calls of ``fn`` after one warm-up call (``call_timer``)."""
    clock = call_timer(device, timer)
    fn()
    samples = []
    for _ in range(reps):
        sync_device(device)
        t0 = clock()
        fn()
        sync_device(device)
        samples.append(clock() - t0)
    return statistics.median(samples)


@dataclass
class CopyFit:
    """One kind of copy: ``seconds(nbytes, calls) = calls * per_call_s + nbytes /
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

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> CopyFit:
        """The inverse of ``as_dict`` (``ValueError`` naming a missing or bad field)."""
        try:
            fit = cls(str(d["direction"]), float(d["per_call_s"]), float(d["gb_per_s"]) * 1e9,
                      list(d.get("points", [])))  # fmt: skip
        except (KeyError, TypeError, ValueError) as exc:
            raise ValueError(f"copy fit: missing or bad field ({exc!r}) in {sorted(d)}") from None
        if fit.per_call_s < 0 or fit.bytes_per_s <= 0:
            raise ValueError(f"copy fit {fit.direction}: per_call_s >= 0 and gb_per_s > 0")
        return fit


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


def _scattered(pages: int, total_pages: int, page: int, gen: torch.Generator) -> torch.Tensor:
    """Slots of ``pages`` random pages of ``total_pages`` (page 0 excluded: padding)."""
    chosen = torch.randperm(total_pages - 1, generator=gen)[:pages] + 1
    return (chosen[:, None] * page + torch.arange(page)).flatten()


def calibrate_copies(
    cache: Any, sizes: Sequence[int], reps: int = 7, timer: str | None = None
) -> tuple[CopyFit, CopyFit]:
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
        if pages < 1 or pages > min(dev.size, host.size) // page - 1:
            continue
        d_idx = _scattered(pages, dev.size // page, page, gen)
        h_idx = _scattered(pages, host.size // page + 1, page, gen) - page
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
        h2d.append((nbytes, layers, time_calls(load, dev.device, reps, timer)))
        d2h.append((nbytes, 1, time_calls(backup, dev.device, reps, timer)))
    return fit_copy("h2d", h2d), fit_copy("d2h", d2h)


def calibrate_transfer_copy(
    side: Any, sizes: Sequence[int], reps: int = 7, timer: str | None = None
) -> CopyFit:
    """The fit of ``side.copy_kv`` (a ``prefill.disagg.sim_side.DecodeSide``: prefill pool to
    decode pool, every layer, K and V, waited for) at ``sizes`` tokens, one call each; slots
    are scattered pages on both sides, as the allocators hand them out. Overwrites pool
    contents."""
    src, dst = side.src_pool, side.pool
    page = src.page_size
    gen = torch.Generator().manual_seed(1)
    points = []
    for tokens in sizes:
        pages = tokens // page
        if pages < 1 or pages > min(src.size, dst.size) // page - 1:
            continue
        s_idx = _scattered(pages, src.size // page, page, gen)
        d_idx = _scattered(pages, dst.size // page, page, gen)

        def copy(s: torch.Tensor = s_idx, d: torch.Tensor = d_idx) -> None:
            side.copy_kv(s, d, True)

        nbytes = tokens * src.get_size_per_token()
        points.append((nbytes, 1, time_calls(copy, src.device, reps, timer)))
    return fit_copy("transfer", points)
