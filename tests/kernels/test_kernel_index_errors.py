"""Bad slot indices are reported, never skipped silently: one ``KVIndexError`` naming the op and the
argument, whichever path finds it.

- Where the host can read the indices for free (CPU tensors, debug checks, the torch reference,
  the direct ops) the call raises before anything is written.
- Where it cannot (CUDA without debug checks; here: CPU tensors inside
  ``checks.device_range_checks()``, the interpreted kernel running the same masks), the kernel
  skips the pair, copies the others, records the bad one on the device, and the copy's check
  (``CopyWatch.check``, the controller's ack) raises the same error.

Pointer-table sides are bounded by the slots recorded with the table, so an all-layer op's bad
index is caught too. Cases come from the oracle's world (``test_kernels_oracle``).
"""

from __future__ import annotations

import dataclasses

import pytest
import torch

from hicache_prefill import kernels
from hicache_prefill.kernels.ops import checks
from hicache_prefill.kernels.triton import index_record
from tests.kernels import test_kernels_oracle as oc
from tests.kernels.oracle import Oracle

KERNEL_CASES = [c for c in oc.CASES if c.negative]  # the kernel-backend ops
DIRECT_CASES = [c for c in oc.CASES if c.op in ("transfer_kv_direct",
                                                "transfer_kv_per_layer_direct_pf_lf",
                                                "transfer_kv_all_layer_direct_lf_pf")
                and c.kind == "mha"]  # fmt: skip
BAD = oc.T + 5  # past every side's end (every pool of the world holds T slots)


def _indices(side: str) -> tuple[torch.Tensor, torch.Tensor]:
    s, d = oc.idx(oc.SRC, True, oc.DEVICE), oc.idx(oc.DST, False, oc.DEVICE)
    (s if side == "src" else d)[0] = BAD
    return s, d


def _what(e: kernels.KVIndexError) -> tuple:
    return e.op, e.argument, e.slot, e.n_slots


@pytest.mark.parametrize("side", ["src", "dst"])
@pytest.mark.parametrize("case", KERNEL_CASES, ids=[c.id for c in KERNEL_CASES])
def test_the_kernel_records_a_bad_index_and_the_check_raises(case: oc.Case, side: str) -> None:
    world = oc.make_world(case.kind, 7)
    ours, theirs = world.clone(), world.clone()
    s, d = _indices(side)
    watch = kernels.watch_copies(oc.DEVICE)
    with checks.device_range_checks(), watch:
        args, kwargs = case.call(ours, s, d)
        getattr(kernels, case.op)(*args, **kwargs)  # no error at the call: nothing read the range
    with pytest.raises(kernels.KVIndexError) as info:
        watch.check()
    assert _what(info.value) == (case.op, f"{side}_indices", BAD, oc.T)
    assert "found by the kernel" in str(info.value)
    watch.check()  # reported once; the slot is clean again
    # Every other pair was copied, as the oracle does without the bad pair.
    s2, d2 = s.clone(), d.clone()
    (s2 if side == "src" else d2)[0] = -1
    args, kwargs = case.call(theirs, s2, d2)
    getattr(Oracle(theirs.layers()), case.op)(*args, **kwargs)
    for name, buf in ours.buffers().items():
        assert oc.same_bytes(buf, getattr(theirs, name)), name


@pytest.mark.parametrize("side", ["src", "dst"])
@pytest.mark.parametrize("case", KERNEL_CASES[::3], ids=[c.id for c in KERNEL_CASES[::3]])
def test_host_checks_raise_the_same_error_at_the_call(
    case: oc.Case, side: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The Triton path with host checks (CPU) and the torch reference raise what the kernel's
    record reports, before writing anything."""
    for reference_path in (False, True):
        if reference_path:  # CPU tensors on a machine that compiles Triton for a GPU
            monkeypatch.setattr(kernels, "TRITON_INTERPRETED", False)
        world = oc.make_world(case.kind, 8)
        before = world.clone()
        args, kwargs = case.call(world, *_indices(side))
        with pytest.raises(kernels.KVIndexError) as info:
            getattr(kernels, case.op)(*args, **kwargs)
        assert _what(info.value) == (case.op, f"{side}_indices", BAD, oc.T)
        for name, buf in world.buffers().items():
            assert oc.same_bytes(buf, getattr(before, name)), f"{name} written"


@pytest.mark.parametrize("case", DIRECT_CASES, ids=[c.id for c in DIRECT_CASES])
def test_direct_ops_raise_the_same_error(case: oc.Case) -> None:
    world = oc.make_world(case.kind, 9)
    s, d = oc.idx(oc.SRC, False, oc.DEVICE), oc.idx(oc.DST, False, oc.DEVICE)
    s[-oc.P :] = torch.arange(BAD - BAD % oc.P, BAD - BAD % oc.P + oc.P)  # a whole bad page
    args, kwargs = case.call(world, s, d)
    with pytest.raises(kernels.KVIndexError) as info:
        getattr(kernels, case.op)(*args, **kwargs)
    op, argument, slot, n_slots = _what(info.value)
    assert (op, argument, n_slots) == (case.op, "src_indices", oc.T) and slot >= oc.T


def test_launches_outside_a_watch_share_the_device_slot() -> None:
    kernels.check_unwatched_index_errors(oc.DEVICE)  # whatever earlier tests left
    world = oc.make_world("mla", 3)
    s, d = _indices("dst")
    with checks.device_range_checks():
        args, _ = oc.c_mla(world, s, d)
        kernels.transfer_kv_per_layer_mla(*args)
    with pytest.raises(kernels.KVIndexError) as info:
        kernels.check_unwatched_index_errors(oc.DEVICE)
    assert _what(info.value) == ("transfer_kv_per_layer_mla", "dst_indices", BAD, oc.T)
    kernels.check_unwatched_index_errors(oc.DEVICE)  # cleared


def test_a_watch_only_sees_its_own_launches() -> None:
    """A bad launch under one watch is not reported by another watch, nor by the shared slot."""
    kernels.check_unwatched_index_errors(oc.DEVICE)
    world = oc.make_world("mla", 4)
    bad, good = kernels.watch_copies(oc.DEVICE), kernels.watch_copies(oc.DEVICE)
    with checks.device_range_checks():
        with bad:
            kernels.transfer_kv_per_layer_mla(*oc.c_mla(world, *_indices("src"))[0])
        with good:
            s, d = oc.idx(oc.SRC, False, oc.DEVICE), oc.idx(oc.DST, False, oc.DEVICE)
            kernels.transfer_kv_per_layer_mla(*oc.c_mla(world, s, d)[0])
    good.check()
    kernels.check_unwatched_index_errors(oc.DEVICE)
    with pytest.raises(kernels.KVIndexError, match="src_indices"):
        bad.check()


def test_watches_never_checked_keep_their_slots_and_the_record_grows() -> None:
    held = [kernels.watch_copies("cpu") for _ in range(index_record.CHUNK_SLOTS + 3)]
    slots = {(w._chunk, w._slot) for w in held}
    assert len(slots) == len(held)  # distinct slots, a second chunk added
    for w in held:
        w.check()


def test_table_bounds_are_recorded_and_voided_by_an_in_place_write() -> None:
    layers = [torch.zeros(12, 4) for _ in range(3)]
    table = kernels.data_ptr_table(layers, "cpu")
    assert kernels.table_bound(table) == 12
    assert kernels.table_bound(table.clone()) is None  # another tensor: nothing recorded
    table[0] = table[0]
    assert kernels.table_bound(table) is None
    kernels.verify_ptr_table(table, n_slots=12)
    assert kernels.table_bound(table) == 12
    with pytest.raises(ValueError, match="n_slots"):
        kernels.verify_ptr_table(table, n_slots=0)


def test_sglang_tables_get_their_bound_at_warm_up() -> None:
    """Tables built by SGLang's pools (plain ``torch.tensor`` of ``data_ptr()``s) get the
    bound of the per-layer tensors the pools hold in lists; one with an unknown entry none."""
    from hicache_prefill.kernels.sglang.warm_up import verify_pool_tables

    @dataclasses.dataclass
    class Pool:
        k_buffer: list
        k_data_ptrs: torch.Tensor
        stray_ptrs: torch.Tensor

    layers = [torch.zeros(20, 4), torch.zeros(18, 4)]
    pool = Pool(layers, torch.tensor([t.data_ptr() for t in layers], dtype=torch.uint64),
                torch.tensor([layers[0].data_ptr(), torch.zeros(4).data_ptr()],
                             dtype=torch.uint64))  # fmt: skip
    verify_pool_tables(pool)
    assert kernels.table_bound(pool.k_data_ptrs) == 18
    assert kernels.table_bound(pool.stray_ptrs) is None
