"""Host pools as SGLang 0.5.23's storage backends drive them: zero-copy page pointers, flat pages
out and back, for every layout, MHA (K and V of equal and of different widths) and MLA."""

from __future__ import annotations

import ctypes

import pytest
import torch

from hicache_prefill.hicache.memory.host_pool import LAYOUTS
from tests.hicache.storage.helpers import (
    DV,
    KINDS,
    C,
    D,
    H,
    L,
    fill_random,
    host_pool,
    same_slots,
    slot_bytes,
)


def sglang_meta(host, indices: torch.Tensor) -> tuple[list[int], list[int]]:
    """SGLang 0.5.23's ``get_page_buffer_meta`` arithmetic (pool_host/mha.py, mla.py), written
    from its formulas: MHA V pointer = K pointer + layer * size * H * D * itemsize."""
    item, page, n_l, size = host.dtype.itemsize, host.page_size, host.layer_num, host.size
    base, starts = host.kv_buffer.data_ptr(), indices.tolist()[::page]
    mla = hasattr(host, "kv_cache_dim")
    row = host.kv_cache_dim if mla else host.head_num * host.head_dim
    v_off = n_l * size * row * item
    ptrs = []
    for s in starts:
        if host.layout == "layer_first":
            for layer in range(n_l):
                k = base + s * row * item + layer * size * row * item
                ptrs += [k] if mla else [k, k + v_off]
        else:
            k = base + s * n_l * row * item
            ptrs += [k] if mla else [k, k + v_off]
    piece = page * row * item * (1 if host.layout == "layer_first" else n_l)
    return ptrs, [piece] * len(ptrs)


@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("kind", ["mha", "mla"])
def test_page_buffer_meta_is_sglangs(kind: str, layout: str) -> None:
    host = host_pool(kind, layout)
    indices = torch.cat([torch.arange(8, 12), torch.arange(20, 24)])
    assert host.get_page_buffer_meta(indices) == sglang_meta(host, indices)


def _raw(t: torch.Tensor) -> torch.Tensor:
    return t.contiguous().view(torch.uint8).reshape(-1)


@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("kind", KINDS)
def test_page_buffer_meta_points_at_each_page(kind: str, layout: str) -> None:
    """Read through the pointers: each piece holds exactly the bytes of its part, layer, page."""
    host = host_pool(kind, layout)
    fill_random(host, 1)
    page = host.page_size
    indices = torch.cat([torch.arange(4, 8), torch.arange(24, 28)])
    ptrs, sizes = host.get_page_buffer_meta(indices)
    want = []
    for s in (4, 24):
        if layout == "layer_first":
            want += [_raw(part[layer, s : s + page]) for layer in range(L) for part in host.parts]
        elif layout == "page_first":
            want += [_raw(part[s : s + page]) for part in host.parts]
        else:
            want += [_raw(part[s // page]) for part in host.parts]
    assert sizes == [w.numel() for w in want]
    for ptr, size, w in zip(ptrs, sizes, want, strict=True):
        assert ctypes.string_at(ptr, size) == bytes(w.tolist())


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("kind", KINDS)
def test_flat_page_round_trip(kind: str, layout: str, dtype: torch.dtype) -> None:
    """Every page out of one pool and into another (another instance, other slots) bit for bit;
    neighbouring pages untouched."""
    src, dst = host_pool(kind, layout, dtype=dtype), host_pool(kind, layout, dtype=dtype)
    fill_random(src, 2)
    fill_random(dst, 3)
    others = [s for s in range(dst.size) if not 20 <= s < 24]
    before = slot_bytes(dst, others)
    dummy = dst.get_dummy_flat_data_page()
    flat = src.get_data_page(8, flat=True)
    assert flat.dim() == 1 and flat.dtype == dtype and flat.numel() == dummy.numel()
    assert flat.numel() * flat.element_size() == src.page_nbytes
    assert not dummy.any()
    dummy.copy_(flat)  # as a backend reads a file into the dummy page
    dst.set_from_flat_data_page(20, dummy)
    assert same_slots(src, range(8, 12), dst, range(20, 24))
    assert all(torch.equal(a, b) for a, b in zip(before, slot_bytes(dst, others), strict=True))


@pytest.mark.parametrize("kind", ["mha", "mla"])
def test_structured_page_is_sglangs_view(kind: str) -> None:
    page = 4
    lead = () if kind == "mla" else (2,)
    tok = (1, C) if kind == "mla" else (H, D)
    want = {
        "layer_first": (*lead, L, page, *tok),
        "page_first": (*lead, page, L, *tok),
        "page_first_direct": (*lead, 1, L, page, *tok),
    }
    for layout, shape in want.items():
        host = host_pool(kind, layout)
        view = host.get_data_page(4, flat=False)
        assert tuple(view.shape) == shape
        view.fill_(1)  # a view: writes land in the pool
        assert bool((host.get_data_page(4, flat=True) == 1).all())
    mla_pf = host_pool("mla", "page_first")
    assert mla_pf.get_data_page(4).data_ptr() == mla_pf.kv_buffer[4].data_ptr()  # no copy


def test_asymmetric_heads_have_no_structured_page() -> None:
    host = host_pool("mha_v", "page_first")
    with pytest.raises(NotImplementedError):
        host.get_data_page(0, flat=False)
    assert host.get_data_page(0).numel() == 4 * L * H * (D + DV)


@pytest.mark.parametrize("kind", KINDS)
def test_pages_cross_layouts_of_the_same_byte_order(kind: str) -> None:
    """``layer_first`` and ``page_first_direct`` flat pages are the same bytes, so a page moves
    between them; ``page_first`` orders tokens first, so its page read by a ``layer_first`` pool
    is wrong KV of the right size: what the format tag keeps out of the keys."""
    lf, pf, pfd = (host_pool(kind, layout) for layout in LAYOUTS)
    assert lf.storage_format_tag == pfd.storage_format_tag == "float32-layer-major"
    assert pf.storage_format_tag == "float32-token-major"
    fill_random(lf, 4)
    fill_random(pf, 5)
    pfd.set_from_flat_data_page(12, lf.get_data_page(0))
    assert same_slots(lf, range(0, 4), pfd, range(12, 16))
    lf.set_from_flat_data_page(8, pf.get_data_page(0))
    assert not same_slots(pf, range(0, 4), lf, range(8, 12))
    assert host_pool(kind, "page_first", dtype=torch.bfloat16).storage_format_tag == (
        "bfloat16-token-major"
    )


def test_bad_pages_raise() -> None:
    host = host_pool("mha", "page_first")
    for index in (2, -4, host.size):
        with pytest.raises(ValueError, match="page start"):
            host.get_data_page(index)
    with pytest.raises(ValueError, match="elements"):
        host.set_from_flat_data_page(0, torch.zeros(3))
    with pytest.raises(ValueError, match="float32"):
        host.set_from_flat_data_page(0, host.get_dummy_flat_data_page().to(torch.float16))
    with pytest.raises(ValueError, match="whole pages"):
        host.get_page_buffer_meta(torch.arange(3))
    with pytest.raises(ValueError, match="consecutive"):
        host.get_page_buffer_meta(torch.tensor([0, 1, 3, 2]))
    with pytest.raises(ValueError, match="page start"):
        host.get_page_buffer_meta(torch.arange(2, 6))
    assert host.get_page_buffer_meta(torch.zeros(0, dtype=torch.int64)) == ([], [])
