"""``SGLangAllocatorView``: the project's allocator calls over SGLang's free list. Here over a
stand-in with the attributes and calls of SGLang 0.5.23's ``PagedTokenToKVPoolAllocator`` (page 0
padding, ``free_pages`` of page ids, ``get_all_free_pages``); ``make sglang-check`` (mode
``tree-backend``) runs it over SGLang's own allocators."""

from __future__ import annotations

import pytest
import torch

from hicache_prefill.hicache.tree.sglang_allocator import SGLangAllocatorView


class PagedStandIn:
    """SGLang's paged allocator's free-list behaviour, for the view's tests only."""

    def __init__(self, size: int, page_size: int) -> None:
        self.size, self.page_size, self.device = size, page_size, "cpu"
        self.free_pages = torch.arange(1, size // page_size + 1, dtype=torch.int64)
        self.free_group = None

    def available_size(self) -> int:
        return len(self.free_pages) * self.page_size

    def get_all_free_pages(self) -> torch.Tensor:
        return self.free_pages

    def alloc(self, need_size: int) -> torch.Tensor | None:
        n = need_size // self.page_size
        if n > len(self.free_pages):
            return None
        pages, self.free_pages = self.free_pages[:n], self.free_pages[n:]
        return (pages[:, None] * self.page_size + torch.arange(self.page_size)).reshape(-1)

    def free(self, free_index: torch.Tensor) -> None:
        self.free_pages = torch.cat([torch.unique(free_index // self.page_size), self.free_pages])


@pytest.fixture
def view() -> SGLangAllocatorView:
    return SGLangAllocatorView(PagedStandIn(32, 4))


def test_alloc_and_free_go_through_sglang_free_list(view) -> None:
    assert view.page_table_size == 9 and view.available_size() == 32
    slots = view.alloc(8)
    assert slots is not None and slots.dtype == torch.int64 and int(slots.min()) >= 4
    assert view.is_allocated(slots) and view.available_size() == 24
    assert not view.is_allocated(torch.tensor([0, 1, 2, 3]))  # the padding page
    view.free(slots)
    assert view.available_size() == 32 and not view.is_allocated(slots)
    assert view.alloc(36) is None
    view.check_integrity()


@pytest.mark.parametrize(
    ("bad", "match"),
    [
        (lambda s: s[:3], "whole pages"),
        (lambda s: torch.cat([s[:4], s[:4]]), "twice"),
        (lambda s: torch.tensor([0, 1, 2, 3]), "outside"),
        (lambda s: torch.arange(36, 40), "outside"),
        (lambda s: torch.arange(28, 32), "double free"),
        (lambda s: s[4:8].flip(0), "whole pages"),
    ],
)  # fmt: skip
def test_bad_frees_raise_and_change_nothing(view, bad, match) -> None:
    slots = view.alloc(8)
    before = view.available_size()
    with pytest.raises(ValueError, match=match):
        view.free(bad(slots))
    assert view.available_size() == before and view.is_allocated(slots)


def test_double_free_is_refused(view) -> None:
    slots = view.alloc(8)
    view.free(slots[:4])
    with pytest.raises(ValueError, match="double free"):
        view.free(slots[:4])
    view.check_integrity()


@pytest.mark.parametrize("need", [-4, 3, 2.5, True])
def test_bad_alloc_sizes(view, need) -> None:
    with pytest.raises(ValueError, match="need_size"):
        view.alloc(need)
    assert view.available_size() == 32


def test_geometry_is_checked() -> None:
    with pytest.raises(ValueError, match="whole number of pages"):
        SGLangAllocatorView(PagedStandIn(30, 4))
