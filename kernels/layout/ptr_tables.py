"""Per-layer ``data_ptr()`` tables (SGLang's ``k_data_ptrs``) with the alignment and slot bound
recorded when a table is built or verified once, and ``get_device_accessible_ptr``. The kernel
cannot read entries per copy without a synchronization, so it relies on the record; the record
carries the table's version counter, so an in-place write voids it.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Sequence

import torch

logger = logging.getLogger(__name__)

MAX_ALIGN = 16
_ATTR = "_kvcacheio_verified_align"


def alignment(*values: int) -> int:
    """Largest power of two up to ``MAX_ALIGN`` dividing every value (16 for none)."""
    g = 0
    for v in values:
        g = math.gcd(g, v)
    return MAX_ALIGN if g == 0 else min(MAX_ALIGN, g & -g)


def pointer_alignment(ptrs: Sequence[int]) -> int:
    """Largest power of two up to 16 dividing every (nonzero) address; 0 if any is null."""
    masked = [p & ((1 << 64) - 1) for p in ptrs]
    return 0 if 0 in masked else alignment(*masked)


def version_counter(table: torch.Tensor) -> int | None:
    """``table``'s in-place write counter (``None`` for inference tensors, which keep none)."""
    try:
        return table._version
    except RuntimeError:
        return None


def _record(table: torch.Tensor, align: int, n_slots: int | None) -> None:
    setattr(table, _ATTR, (align, n_slots, version_counter(table)))


def _current(table: torch.Tensor) -> tuple[int, int | None] | None:
    rec = getattr(table, _ATTR, None)
    if rec is None or rec[2] != version_counter(table):
        return None
    return rec[0], rec[1]


def table_record(table: torch.Tensor) -> object:
    """The record attached to ``table``: a new object per build or verification (plan guards)."""
    return getattr(table, _ATTR, None)


def verified_alignment(table: torch.Tensor) -> int:
    """Recorded alignment of ``table`` unless written in place since; else 0 (unknown)."""
    rec = _current(table)
    return 0 if rec is None else rec[0]


def table_bound(table: torch.Tensor) -> int | None:
    """Recorded slot bound of ``table`` unless written in place since; else ``None``."""
    rec = _current(table)
    return None if rec is None else rec[1]


def data_ptr_table(tensors: Sequence[torch.Tensor], device: torch.device | str) -> torch.Tensor:
    """A uint64 table of ``t.data_ptr()`` on ``device`` (as SGLang builds them), its alignment
    and bound (smallest ``t.shape[0]``) recorded. Blocking on CUDA: build it with the pool."""
    ptrs = [t.data_ptr() for t in tensors]
    table = torch.tensor(ptrs, dtype=torch.uint64, device=device)
    bound = min((t.shape[0] for t in tensors if t.dim() > 0), default=None)
    _record(table, pointer_alignment(ptrs), bound)
    return table


def verify_ptr_table(table: torch.Tensor, n_slots: int | None = None) -> int:
    """Read an existing int64/uint64 ``data_ptr()`` table once; record and return its alignment,
    and ``n_slots`` as its bound. Synchronizes on CUDA: call it when the pool is built."""
    if not isinstance(table, torch.Tensor) or table.dtype not in (torch.int64, torch.uint64):
        raise ValueError(f"table must be an int64 or uint64 tensor, got {table!r}")
    if n_slots is not None and (
        isinstance(n_slots, bool) or not isinstance(n_slots, int) or n_slots <= 0
    ):
        raise ValueError(f"n_slots must be a positive int or None, got {n_slots!r}")
    ptrs = [int(p) for p in table.view(torch.int64).cpu().tolist()]
    align = pointer_alignment(ptrs)
    _record(table, align, n_slots)
    logger.debug(
        "pointer table of %d entries verified: %d-byte aligned, bound %s", len(ptrs), align, n_slots
    )
    return align


def get_device_accessible_ptr(tensor: torch.Tensor, device_index: int) -> int:
    """The address a kernel on ``device_index`` uses for ``tensor`` (upstream's op): its
    ``data_ptr()``, a CPU tensor pinned when CUDA exists (unified addressing). ROCm maps host
    memory elsewhere: ``ValueError``."""
    if isinstance(device_index, bool) or not isinstance(device_index, int) or device_index < 0:
        raise ValueError(f"device_index must be a non-negative int, got {device_index!r}")
    if not isinstance(tensor, torch.Tensor):
        raise ValueError(f"tensor must be a torch.Tensor, got {type(tensor).__name__}")
    if tensor.device.type == "cuda":
        if tensor.device.index != device_index:
            raise ValueError(f"tensor is on {tensor.device}, not on cuda:{device_index}")
        return tensor.data_ptr()
    if tensor.device.type != "cpu":
        raise ValueError(f"only CPU and CUDA tensors have a device address, got {tensor.device}")
    if torch.version.hip is not None:
        raise ValueError("host tensors have separate device addresses on ROCm: not supported")
    if torch.cuda.is_available() and not tensor.is_pinned():
        raise ValueError("tensor is in pageable host memory: pin it or cudaHostRegister it")
    return tensor.data_ptr()
