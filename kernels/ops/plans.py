"""Launch plans of the kernel-backend ops, cached per (pool buffers, op, layer, launch shape): a
call whose plan's guards hold (same tensors, ``data_ptr()`` and table records) checks only its
indices. Entries die with their tensors; at most ``MAX_PLANS`` are kept.
"""

from __future__ import annotations

import threading
import weakref
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass

import torch

from hicache_prefill.kernels.layout.addressing import KVCopy
from hicache_prefill.kernels.layout.ptr_tables import table_record, version_counter
from hicache_prefill.kernels.triton.launch import PartPlan

MAX_PLANS = 4096  # a 64-layer model with a few pools and ops needs a few hundred


@dataclass(frozen=True)
class Plan:
    """One op call's index-independent launch plans and slot bounds. Holds no reference to the
    call's tensor objects (only word views and tables), so it never keeps them alive."""

    bounds: tuple[int, int]  # (src, dst) slots; NO_BOUND: a table side without a recorded bound
    launches: tuple[PartPlan, ...]
    tables: frozenset[int]  # positions in (*src, *dst) of the pointer tables


@dataclass
class _Entry:
    plan: Plan
    guards: tuple  # per buffer: (weakref to the identity tensor, data_ptr, table state or None)
    refs: list  # weak references whose callbacks drop this entry


_cache: OrderedDict[tuple, _Entry] = OrderedDict()
_lock = threading.RLock()  # re-entrant: a weak-reference callback may run while it is held


def _identity(t: object) -> tuple[object, torch.Tensor] | None:
    """``(key, tensor to guard)`` of one buffer argument, ``None`` for a non-tensor."""
    if not isinstance(t, torch.Tensor):
        return None
    base = t._base
    if base is None:
        return id(t), t
    return (id(base), t.storage_offset(), tuple(t.shape), t.stride(), t.dtype), base


def _table_state(t: torch.Tensor) -> tuple:
    return version_counter(t), table_record(t)


def _key(call: KVCopy, block_quota: int, num_warps: int) -> tuple[tuple, list] | None:
    """The call's cache key and each buffer's guarded tensor (``None``: not cacheable)."""
    scalars = (
        call.item_size,
        call.layout_dim,
        call.layer_id,
        call.num_layers,
        call.page_size,
        call.head_num,
        block_quota,
        num_warps,
    )
    if any(type(v) is not int for v in scalars):
        return None
    idents, bases = [], []
    for t in (*call.src, *call.dst):
        ident = _identity(t)
        if ident is None:
            return None
        idents.append(ident[0])
        bases.append(ident[1])
    key = (
        call.how,
        call.op,
        len(call.src),
        len(call.dst),
        scalars,
        call.src_indices.device,
        *idents,
    )
    return key, bases


def _guards_hold(entry: _Entry, call: KVCopy, bases: list) -> bool:
    for (ref, ptr, state), t, base in zip(entry.guards, (*call.src, *call.dst), bases, strict=True):
        if ref() is not base or t.data_ptr() != ptr:
            return False
        if state is not None and _table_state(t) != state:
            return False
    return True


def cached_plan(call: KVCopy, block_quota: int, num_warps: int, make: Callable[[], Plan]) -> Plan:
    """The cached plan of ``call`` when its guards hold, else ``make()`` (which validates and may
    raise ``ValueError``), cached when the call can be keyed."""
    keyed = _key(call, block_quota, num_warps)
    if keyed is not None:
        entry = _cache.get(keyed[0])
        if entry is not None and _guards_hold(entry, call, keyed[1]):
            return entry.plan
    plan = make()
    if keyed is not None:
        _store(keyed[0], call, keyed[1], plan)
    return plan


def _store(key: tuple, call: KVCopy, bases: list, plan: Plan) -> None:
    guards, refs = [], []
    drop = _dropper(key)
    for i, (t, base) in enumerate(zip((*call.src, *call.dst), bases, strict=True)):
        ref = weakref.ref(base, drop)
        refs.append(ref)
        state = _table_state(t) if i in plan.tables else None
        guards.append((ref, t.data_ptr(), state))
    entry = _Entry(plan, tuple(guards), refs)
    with _lock:
        _cache[key] = entry
        _cache.move_to_end(key)
        while len(_cache) > MAX_PLANS:
            _cache.popitem(last=False)


def _dropper(key: tuple) -> Callable[[object], None]:
    cache, lock = _cache, _lock  # held here: module globals are gone at interpreter exit

    def drop(ref: object) -> None:  # one of the entry's tensors died
        with lock:
            entry = cache.get(key)
            if entry is not None and any(r is ref for r in entry.refs):
                del cache[key]  # (a newer entry under the same key keeps its place)

    return drop


def clear_plans() -> None:
    """Drop every cached plan (when buffers change in ways the guards cannot see)."""
    with _lock:
        _cache.clear()


def plan_count() -> int:
    return len(_cache)
