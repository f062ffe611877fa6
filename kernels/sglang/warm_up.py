"""Warm-up for SGLang host pools running this project's kernels: compile every Triton variant a
pool pair will launch, and record the alignment and bound of the pointer tables SGLang built."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch

HOST_POOL_JIT_FLAGS: tuple[str, ...] = ("can_use_jit", "can_use_write_back_jit")


@dataclass
class WarmUpReport:
    """``(host pool class, layout, call)`` rows run and skipped; tables verified as
    ``(owner class, attribute, alignment in bytes)``."""

    calls: list[tuple[str, str, str]] = field(default_factory=list)
    skipped: list[tuple[str, str, str]] = field(default_factory=list)
    verified_tables: list[tuple[str, str, int]] = field(default_factory=list)


def warm_up(host_pool: Any, device_pool: Any) -> WarmUpReport:
    """Launch every kernel variant ``host_pool`` will use with ``device_pool``, moving no bytes:
    SGLang's own dispatch with the ``kernel`` io backend and indices of ``-1`` (skipped by the
    kernel). Skips layouts the kernel backend does not serve and pools on SGLang's JIT kernels."""
    report = WarmUpReport()
    pool_name = type(host_pool).__name__
    layout = str(getattr(host_pool, "layout", "?"))
    if any(getattr(host_pool, flag, False) for flag in HOST_POOL_JIT_FLAGS):
        report.skipped.append((pool_name, layout, "SGLang JIT kernels in use (can_use_jit)"))
        return report
    if layout not in ("layer_first", "page_first", "page_head"):
        report.skipped.append((pool_name, layout, "no kernel-backend ops for this layout"))
        return report
    report.verified_tables += verify_pool_tables(host_pool, device_pool)
    device = _device_of(device_pool)
    page = int(getattr(host_pool, "page_size", 1))
    layers = int(getattr(device_pool, "layer_num", getattr(host_pool, "layer_num", 0)))
    src = torch.full((page,), -1, dtype=torch.int64, device=device)
    dst = torch.full((page,), -1, dtype=torch.int64, device=device)
    for layer_id in range(layers):
        host_pool.load_to_device_per_layer(device_pool, src, dst, layer_id, "kernel")
    host_pool.backup_from_device_all_layer(device_pool, dst, src, "kernel")
    report.calls.append((pool_name, layout, f"load_to_device_per_layer x {layers} layers"))
    report.calls.append((pool_name, layout, "backup_from_device_all_layer"))
    return report


def verify_pool_tables(*pools: Any) -> list[tuple[str, str, int]]:
    """Verify every unverified pointer table (``*ptrs`` attributes) the pools hold, with its bound
    when every entry is a per-layer tensor they hold. Synchronizes on CUDA: call at build time."""
    from hicache_prefill.kernels.layout.ptr_tables import verified_alignment, verify_ptr_table

    out: list[tuple[str, str, int]] = []
    seen: set[int] = set()
    slots = _layer_slots(pools)
    for pool in pools:
        for name, value in sorted(getattr(pool, "__dict__", {}).items()):
            if not (name.endswith("ptrs") and _is_ptr_table(value)) or id(value) in seen:
                continue
            seen.add(id(value))
            if verified_alignment(value) == 0:
                bound = _bound(value, slots)
                out.append((type(pool).__name__, name, verify_ptr_table(value, bound)))
    return out


def _layer_slots(pools: tuple[Any, ...]) -> dict[int, int]:
    """``data_ptr() -> slots`` of every tensor the pools hold in a list or tuple attribute."""
    slots: dict[int, int] = {}
    for pool in pools:
        for value in getattr(pool, "__dict__", {}).values():
            layers = value if isinstance(value, (list, tuple)) else ()
            for t in layers:
                if isinstance(t, torch.Tensor) and t.dim() >= 1:
                    p = t.data_ptr()
                    slots[p] = min(slots.get(p, t.shape[0]), t.shape[0])
    return slots


def _bound(table: torch.Tensor, slots: dict[int, int]) -> int | None:
    """The slots every entry of ``table`` holds (``None`` unless all are known)."""
    entries = [p & ((1 << 64) - 1) for p in table.view(torch.int64).cpu().tolist()]
    known = [slots.get(p) for p in entries]
    return None if not known or None in known else min(known)  # type: ignore[type-var]


def _is_ptr_table(value: Any) -> bool:
    return (
        isinstance(value, torch.Tensor)
        and value.dim() == 1
        and value.dtype in (torch.int64, torch.uint64)
    )


def _device_of(device_pool: Any) -> torch.device:
    device = getattr(device_pool, "device", None)
    if device is None:
        raise ValueError("device_pool has no .device")
    return torch.device(device)
