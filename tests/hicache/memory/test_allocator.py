"""Page-granular allocator: alloc/free, groups, bad frees, and a hypothesis property test."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from hicache_prefill.hicache.memory.allocator import TokenToKVPoolAllocator


def test_alloc_starts_at_page_one_and_returns_none_when_short() -> None:
    a = TokenToKVPoolAllocator(16, 4, "cpu")
    x = a.alloc(8)
    assert x.tolist() == [4, 5, 6, 7, 8, 9, 10, 11]
    assert a.available_size() == 8
    assert a.alloc(12) is None and a.available_size() == 8
    y = a.alloc(8)
    assert y.tolist() == list(range(12, 20))
    assert a.alloc(4) is None
    a.free(x)
    assert a.available_size() == 8
    a.check_integrity()


def test_page_size_one_never_hands_out_slot_zero() -> None:
    a = TokenToKVPoolAllocator(4, 1, "cpu")
    assert sorted(a.alloc(4).tolist()) == [1, 2, 3, 4]
    assert a.alloc(1) is None
    assert a.alloc(0).numel() == 0


def test_alloc_rejects_unaligned_size() -> None:
    a = TokenToKVPoolAllocator(16, 4, "cpu")
    with pytest.raises(ValueError, match="need_size"):
        a.alloc(3)
    assert a.available_size() == 16


@pytest.mark.parametrize(
    "bad",
    [
        lambda x: x,  # double free (after the first free below)
        lambda x: torch.tensor([0, 1, 2, 3]),  # padding page
        lambda x: torch.tensor([20, 21, 22, 23]),  # out of range
        lambda x: x[1:5],  # unaligned
        lambda x: x[:2],  # partial page
        lambda x: torch.cat([x[:4], x[:4]]),  # same page twice
        lambda x: x.to(torch.int32),
    ],
)
def test_bad_free_raises_and_changes_nothing(bad) -> None:
    a = TokenToKVPoolAllocator(16, 4, "cpu")
    x = a.alloc(8)
    y = a.alloc(4)
    a.free(y)  # makes the first case a double free
    arg = y if bad(x) is x else bad(x)
    before = (a.available_size(), a._state.clone())
    with pytest.raises(ValueError):
        a.free(arg)
    assert a.available_size() == before[0] and torch.equal(a._state, before[1])
    a.check_integrity()


@pytest.mark.parametrize(
    ("make", "error"),
    [
        (lambda x: x[2:6], "not allocated"),  # ascending, pages 3 and 4 already free
        (lambda x: x[[5, 2]], "not allocated"),  # descending, page 3 already free
        (lambda x: x[[5, 4, 5]], "twice"),  # out of order with a repeat
        (lambda x: torch.tensor([17]), "out of range"),  # one page past the end
        (lambda x: torch.tensor([6, 0]), "out of range"),  # descending onto the padding page
        (lambda x: x[[6, 6]], "twice"),  # a page twice in a row
    ],
)
def test_free_at_page_one_checks_every_order(make, error) -> None:
    a = TokenToKVPoolAllocator(16, 1, "cpu")
    x = a.alloc(8)  # slots 1..8, ascending
    a.free(x[2:4])
    before = (a.available_size(), a._state.clone())
    with pytest.raises(ValueError, match=error):
        a.free(make(x))
    assert a.available_size() == before[0] and torch.equal(a._state, before[1])
    a.free(x[[7, 6, 5]])  # a valid free out of order is accepted
    a.free(x[[4]])
    a.free_group_begin()
    a.free(x[[0]])
    with pytest.raises(ValueError, match="not allocated"):  # pending in the open group
        a.free(x[[0]])
    a.free_group_end()
    a.free(x[[1]])
    assert a.available_size() == 16
    a.check_integrity()


def test_free_group_returns_pages_at_end() -> None:
    a = TokenToKVPoolAllocator(8, 1, "cpu", reserve_padding=False)
    x = a.alloc(8)
    a.free_group_begin()
    a.free(x[:3])
    a.free(x[3:5])
    with pytest.raises(ValueError):
        a.free(x[:1])  # already freed inside the group
    assert a.available_size() == 0
    a.check_integrity()
    a.free_group_end()
    assert a.available_size() == 5
    assert sorted(a.alloc(5).tolist()) == [0, 1, 2, 3, 4]
    with pytest.raises(ValueError):
        a.free_group_end()


@settings(max_examples=60, deadline=None)
@given(
    page=st.sampled_from([1, 4]),
    ops=st.lists(st.tuples(st.booleans(), st.integers(0, 6)), max_size=40),
)
def test_random_alloc_free_keeps_accounting(page: int, ops: list[tuple[bool, int]]) -> None:
    a = TokenToKVPoolAllocator(24 * page, page, "cpu")
    held: list[torch.Tensor] = []
    for is_alloc, n in ops:
        if is_alloc or not held:
            out = a.alloc(n * page)
            if out is None:
                assert a.available_size() < n * page
            else:
                assert out.numel() == n * page
                held.append(out)
        else:
            a.free(held.pop(n % len(held)))
        a.check_integrity()
        allocated = torch.cat(held) if held else torch.empty(0, dtype=torch.int64)
        assert allocated.unique().numel() == allocated.numel()
        assert (allocated >= page).all()
        assert a.available_size() + allocated.numel() == a.size


def test_from_server_args() -> None:
    from hicache_prefill.server_args import ServerArgs

    args = ServerArgs(max_total_tokens=64, page_size=16, device="cpu")
    a = TokenToKVPoolAllocator.from_server_args(args)
    assert (a.size, a.page_size, a.device.type) == (64, 16, "cpu")
