"""Launch plans cached per (pool buffers, op, layer, launch shape): a repeated call validates only
its indices, and a plan is never used for other memory (``kernels.ops.plans``)."""

from __future__ import annotations

import gc

import pytest
import torch

from hicache_prefill import kernels
from hicache_prefill.kernels.ops import dispatch, plans

L, T, C = 2, 16, 8  # layers, slots, bytes per slot (MLA, uint8)


@pytest.fixture
def validations(monkeypatch: pytest.MonkeyPatch) -> list[str]:
    """The op names :func:`kernels.ops.dispatch.validate_buffers` ran for (plan misses)."""
    seen: list[str] = []
    real = dispatch.validate_buffers

    def counting(call, *a):  # noqa: ANN001, ANN002, ANN202
        seen.append(call.op)
        return real(call, *a)

    monkeypatch.setattr(dispatch, "validate_buffers", counting)
    plans.clear_plans()
    return seen


def _pools() -> tuple[torch.Tensor, torch.Tensor]:
    host = torch.arange(T * L * C, dtype=torch.int32).to(torch.uint8).view(T, L, 1, C)
    dev = torch.zeros(L, T, 1, C, dtype=torch.uint8)
    return host, dev


IDX = torch.tensor([3, 1, 4]), torch.tensor([0, 5, 2])


def _load(host: torch.Tensor, dev: torch.Tensor, layer: int, idx=IDX) -> None:  # noqa: ANN001
    kernels.transfer_kv_per_layer_mla_pf_lf(host, dev[layer], *idx, layer, C, C * L)


def test_a_repeated_call_is_validated_once(validations: list[str]) -> None:
    host, dev = _pools()
    for _ in range(3):
        for layer in range(L):
            _load(host, dev, layer)  # dev[layer]: a new view object on every call
    assert validations == ["transfer_kv_per_layer_mla_pf_lf"] * L  # one plan per layer
    assert torch.equal(dev[1, 0], host[3, 1]) and torch.equal(dev[0, 2], host[4, 0])


def test_indices_are_still_checked_on_a_cached_plan(validations: list[str]) -> None:
    host, dev = _pools()
    _load(host, dev, 0)
    with pytest.raises(kernels.KVIndexError, match="src_indices holds slot 16"):
        _load(host, dev, 0, (torch.tensor([16]), torch.tensor([0])))
    with pytest.raises(ValueError, match="transfer_kv_per_layer_mla_pf_lf: src_indices"):
        _load(host, dev, 0, (torch.tensor([1], dtype=torch.int32), torch.tensor([0])))
    assert len(validations) == 1


def test_a_replaced_or_dropped_tensor_is_planned_again(validations: list[str]) -> None:
    host, dev = _pools()
    _load(host, dev, 0)
    count = plans.plan_count()
    host = host.clone()  # the pool's tensor replaced: the old plan's tensor dies
    gc.collect()
    assert plans.plan_count() == count - 1  # its plan went with it (no memory kept alive)
    _load(host, dev, 0)
    assert len(validations) == 2


def test_a_storage_swapped_in_place_is_planned_again(validations: list[str]) -> None:
    host, dev = _pools()
    _load(host, dev, 0)
    host.set_(torch.zeros(T, L, 1, C, dtype=torch.uint8))  # same object, other memory
    _load(host, dev, 0)
    assert len(validations) == 2
    assert not dev[0, [0, 5, 2]].any()  # copied from the new storage


def test_a_table_written_in_place_is_validated_again(validations: list[str]) -> None:
    host, dev = _pools()
    table = kernels.data_ptr_table(list(dev), "cpu")
    args = (table, host, *IDX, C, C * L, L)
    kernels.transfer_kv_all_layer_mla_lf_pf(*args)
    kernels.transfer_kv_all_layer_mla_lf_pf(*args)
    assert len(validations) == 1
    table[1] = 0  # a null entry, written in place: the cached plan must not be used
    with pytest.raises(ValueError, match="src_layers holds a null pointer"):
        kernels.transfer_kv_all_layer_mla_lf_pf(*args)
    assert len(validations) == 2


def test_a_table_verified_again_gets_a_new_plan(validations: list[str]) -> None:
    host, dev = _pools()
    table = kernels.data_ptr_table(list(dev), "cpu")
    args = (table, host, torch.tensor([12]), torch.tensor([0]), C, C * L, L)
    kernels.transfer_kv_all_layer_mla_lf_pf(*args)  # slot 12 < 16: fine
    kernels.verify_ptr_table(table, n_slots=8)  # its layers hold only 8 slots, say
    with pytest.raises(kernels.KVIndexError, match="src_indices holds slot 12.*8 slots"):
        kernels.transfer_kv_all_layer_mla_lf_pf(*args)
    assert len(validations) == 2


def test_arguments_that_are_not_plain_ints_are_never_served_from_the_cache(
    validations: list[str],
) -> None:
    host, dev = _pools()
    _load(host, dev, 1)
    with pytest.raises(ValueError, match="layer_id must be an int"):
        kernels.transfer_kv_per_layer_mla_pf_lf(host, dev[1], *IDX, True, C, C * L)
    assert len(validations) == 2
