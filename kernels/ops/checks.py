"""Argument validation shared by the kernel wrappers: every failure is a ``ValueError`` naming the
offending argument.

Checks that read tensor contents (index ranges, table entries) always run on CPU tensors. On CUDA
they would synchronize, so they run only with debug checks on (``HICACHE_KERNEL_CHECKS=1`` or
:func:`set_debug_checks`); otherwise the kernel records a bad index on the device and the copy's
completion check raises the same ``KVIndexError``. :func:`device_range_checks` gives CPU tensors
that CUDA behaviour (for tests).
"""

from __future__ import annotations

import contextlib
import logging
import os
from collections.abc import Iterator, Sequence

import torch

from hicache_prefill.kernels.errors import KVIndexError
from hicache_prefill.kernels.layout.byte_views import row_bytes
from hicache_prefill.kernels.layout.ptr_tables import pointer_alignment, verified_alignment

logger = logging.getLogger(__name__)

_debug_checks = os.environ.get("HICACHE_KERNEL_CHECKS", "0") not in ("", "0")


def set_debug_checks(enabled: bool) -> None:
    global _debug_checks
    _debug_checks = bool(enabled)
    logger.info("kernel debug checks %s", "on" if enabled else "off")


def debug_checks_enabled() -> bool:
    return _debug_checks


_device_ranges = 0  # > 0: CPU tensors' index ranges are left to the kernel, as on CUDA


@contextlib.contextmanager
def device_range_checks() -> Iterator[None]:
    """Within the block (process-wide), ops on CPU tensors leave index ranges and table entries
    unread, as on CUDA without debug checks: the (interpreted) kernel records a bad index."""
    global _device_ranges
    _device_ranges += 1
    try:
        yield
    finally:
        _device_ranges -= 1


def content_checks(t: torch.Tensor) -> bool:
    """Whether checks that read ``t``'s contents run for it."""
    if t.device.type == "cuda":
        return _debug_checks
    return _debug_checks or not _device_ranges


def positive_int(name: str, value: object) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
        raise ValueError(f"{name} must be a positive int, got {value!r}")
    return value


def slot_indices(
    name: str,
    t: object,
    *,
    n_slots: int | None = None,
    page_size: int | None = None,
    device: torch.device | None = None,
) -> torch.Tensor:
    """The project's one slot-index validator: ``t`` if it is 1-D ``torch.int64``, a whole number
    of pages, on ``device``'s type and within ``[0, n_slots)`` (read only where
    :func:`content_checks` allows); else ``ValueError`` naming ``name``."""
    if not isinstance(t, torch.Tensor) or t.dim() != 1 or t.dtype != torch.int64:
        raise ValueError(f"{name} must be a 1-D torch.int64 tensor")
    if page_size is not None and t.numel() % page_size:
        raise ValueError(f"{name} length {t.numel()} is not a multiple of page_size={page_size}")
    if device is not None and t.device.type != device.type:
        raise ValueError(f"{name} is on {t.device}, the pool is on {device}")
    if n_slots is not None and t.numel() and content_checks(t):
        lo, hi = int(t.min()), int(t.max())
        if lo < 0 or hi >= n_slots:
            raise ValueError(f"{name} out of range [0, {n_slots}): min {lo}, max {hi}")
    return t


def index_pair(src_indices: object, dst_indices: object) -> torch.device:
    """Both int64, 1-D, same length, same device. Returns that device."""
    for name, idx in (("src_indices", src_indices), ("dst_indices", dst_indices)):
        if not isinstance(idx, torch.Tensor):
            raise ValueError(f"{name} must be a torch.Tensor, got {type(idx).__name__}")
        if idx.dtype != torch.int64:
            raise ValueError(f"{name} must be torch.int64, got {idx.dtype}")
        if idx.dim() != 1:
            raise ValueError(f"{name} must be 1-D, got shape {tuple(idx.shape)}")
        if not idx.is_contiguous():
            raise ValueError(f"{name} must be contiguous")
    assert isinstance(src_indices, torch.Tensor) and isinstance(dst_indices, torch.Tensor)
    if src_indices.numel() != dst_indices.numel():
        raise ValueError(
            f"src_indices and dst_indices must have equal lengths, "
            f"got {src_indices.numel()} and {dst_indices.numel()}"
        )
    if src_indices.device != dst_indices.device:
        raise ValueError(
            f"src_indices and dst_indices must be on one device, "
            f"got {src_indices.device} and {dst_indices.device}"
        )
    return src_indices.device


def data_tensor(name: str, t: object, device: torch.device) -> torch.Tensor:
    """A contiguous tensor on ``device``, or (when ``device`` is CUDA) in pinned host memory."""
    if not isinstance(t, torch.Tensor):
        raise ValueError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
    if not t.is_contiguous():
        raise ValueError(f"{name} must be contiguous, got strides {t.stride()}")
    if t.dim() == 0 or t.numel() == 0:
        raise ValueError(f"{name} must be a non-empty tensor with a slot dimension")
    if t.device == device:
        return t
    if device.type == "cuda" and t.device.type == "cpu":
        if not t.is_pinned():
            raise ValueError(
                f"{name} is in pageable host memory: pin it (pin_memory() or cudaHostRegister) "
                f"so the kernel can read and write it directly"
            )
        return t
    raise ValueError(f"{name} is on {t.device}, but the indices are on {device}")


def same_slots(name_a: str, a: torch.Tensor, name_b: str, b: torch.Tensor, dims: int) -> None:
    """K and V of one side agree on their first ``dims`` dimensions (bytes per token may differ)."""
    if a.dim() < dims or b.dim() < dims or a.shape[:dims] != b.shape[:dims]:
        what = "number of slots" if dims == 1 else f"first {dims} dimensions (slots, layers)"
        raise ValueError(
            f"{name_a} and {name_b} must have the same {what}, got shapes "
            f"{tuple(a.shape)} and {tuple(b.shape)}"
        )


def layer_first(name: str, t: torch.Tensor, item_size: int) -> int:
    if row_bytes(t) != item_size:
        raise ValueError(
            f"item_size={item_size} does not match {name}: one slot of shape "
            f"{tuple(t.shape[1:])} x {t.element_size()}B is {row_bytes(t)} bytes"
        )
    return t.shape[0]


def page_first(
    name: str, t: torch.Tensor, item_size: int, layout_dim: int, layout_dim_name: str
) -> tuple[int, int]:
    """Returns ``(T, L)`` of a page_first buffer ``[T, L, ...]``."""
    if t.dim() < 2:
        raise ValueError(f"{name} must be page_first [T, L, ...], got shape {tuple(t.shape)}")
    if row_bytes(t) != layout_dim:
        raise ValueError(
            f"{layout_dim_name}={layout_dim} does not match {name}: one token across all layers "
            f"of shape {tuple(t.shape[1:])} x {t.element_size()}B is {row_bytes(t)} bytes"
        )
    _layers_split(name, item_size, layout_dim, layout_dim_name, t.shape[1])
    return t.shape[0], t.shape[1]


def page_head(
    name: str,
    t: torch.Tensor,
    item_size: int,
    layout_dim: int,
    layout_dim_name: str,
    page_size: int,
    head_num: int,
) -> tuple[int, int]:
    """Returns ``(T, L)`` of a page_head buffer ``[T / P, H, P, L, D]``."""
    if t.dim() != 5:
        raise ValueError(
            f"{name} must be page_head [pages, head_num, page_size, layers, head_dim], "
            f"got shape {tuple(t.shape)}"
        )
    pages, heads, p, n_layers, _ = t.shape
    if heads != head_num:
        raise ValueError(f"head_num={head_num} does not match {name}: it holds {heads} heads")
    if p != page_size:
        raise ValueError(f"page_size={page_size} does not match {name}: pages of {p} slots")
    if item_size % head_num:
        raise ValueError(f"item_size={item_size} is not a whole number of bytes per head")
    per_slot = row_bytes(t) // page_size
    if per_slot != layout_dim:
        raise ValueError(
            f"{layout_dim_name}={layout_dim} does not match {name}: one token across all layers "
            f"is {per_slot} bytes"
        )
    _layers_split(name, item_size, layout_dim, layout_dim_name, n_layers)
    return pages * page_size, n_layers


def _layers_split(
    name: str, item_size: int, layout_dim: int, layout_dim_name: str, n_layers: int
) -> None:
    if item_size * n_layers != layout_dim:
        raise ValueError(
            f"item_size={item_size} does not match {name}: {layout_dim_name}={layout_dim} over "
            f"{n_layers} layers is {layout_dim / n_layers:g} bytes per layer"
        )


def layer_id_in_range(layer_id: object, num_layers: int) -> int:
    if isinstance(layer_id, bool) or not isinstance(layer_id, int):
        raise ValueError(f"layer_id must be an int, got {layer_id!r}")
    if not 0 <= layer_id < num_layers:
        raise ValueError(f"layer_id={layer_id} is out of range [0, {num_layers})")
    return layer_id


def ptr_table(name: str, table: object, num_layers: int, device: torch.device) -> int:
    """A 1-D int64/uint64 table of ``num_layers`` ``data_ptr()``s on ``device``. Returns the
    entries' alignment (power of two up to 16): read where :func:`content_checks` allows, else
    the one verified when the table was built, else 0 (unknown). A null entry raises."""
    if not isinstance(table, torch.Tensor):
        raise ValueError(f"{name} must be a torch.Tensor of data_ptr()s, got {type(table)}")
    if table.dtype not in (torch.int64, torch.uint64):
        raise ValueError(f"{name} must be an int64 or uint64 data_ptr() table, got {table.dtype}")
    if table.dim() != 1 or table.numel() != num_layers:
        raise ValueError(
            f"{name} must be 1-D with num_layers={num_layers} entries, "
            f"got shape {tuple(table.shape)}"
        )
    if table.device != device:
        raise ValueError(f"{name} is on {table.device}, but the indices are on {device}")
    if not table.is_contiguous():
        raise ValueError(f"{name} must be contiguous")
    if not content_checks(table):
        return verified_alignment(table)
    align = pointer_alignment(table.view(torch.int64).tolist())
    if align == 0:
        raise ValueError(f"{name} holds a null pointer")
    return align


def indices_in_range(
    name: str, idx: torch.Tensor, n_slots: int, op: str = "", force: bool = False
) -> None:
    """Every index below ``n_slots`` (negative ones are skipped), else ``KVIndexError``. Reads
    ``idx`` only where :func:`content_checks` allows or when ``force``."""
    if idx.numel() == 0 or not (force or content_checks(idx)):
        return
    hi = int(idx.max().item())
    if hi >= n_slots:
        raise KVIndexError(op, name, hi, n_slots)


def layer_lists(src_name: str, src: Sequence[object], dst_name: str, dst: Sequence[object]) -> None:
    for name, seq in ((src_name, src), (dst_name, dst)):
        if not isinstance(seq, (list, tuple)) or not seq:
            raise ValueError(f"{name} must be a non-empty list of tensors")
