"""The ``sgl_kernel.kvcacheio`` surface beyond the classic op matrix (``test_kernels``):

- names and argument order of every upstream op;
- K and V of different head sizes (K 192 / V 128, scaled down) through every MHA op that has a
  V tensor to size V by, the direct ops, and upstream's per-buffer form (the MLA ops once for K,
  once for V, as sglang 0.5.23's ``AsymmetricMHATokenToKVPoolHost`` does);
- the page_head layout, on a hand-checked story;
- pointer tables: alignment recorded at build, voided by an in-place write, narrower words for
  entries of any alignment;
- ``get_device_accessible_ptr`` and ``transfer_embedding_ranges_direct`` contracts.

Every kernel result is compared bit for bit with both the torch reference and a plain indexing
expectation written here; sizes stay small (Triton runs interpreted on CPU).
"""

from __future__ import annotations

import inspect

import pytest
import torch

from hicache_prefill import kernels
from hicache_prefill.kernels.layout.ptr_tables import pointer_alignment, verified_alignment
from hicache_prefill.kernels.ops import reference

DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")
PIN = DEVICE.type == "cuda"
L = 3


def sync() -> None:
    if DEVICE.type == "cuda":
        torch.cuda.synchronize()


def host(t: torch.Tensor) -> torch.Tensor:
    return t.pin_memory() if PIN else t


def rand(*shape: int, seed: int, device: torch.device | str = "cpu") -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    return torch.randn(*shape, generator=gen).to(torch.bfloat16).to(device)


def same(a: torch.Tensor, b: torch.Tensor) -> bool:
    return torch.equal(a.cpu().view(torch.int16), b.cpu().view(torch.int16))


# ---------------------------------------------------------------------------------------------
# The surface
# ---------------------------------------------------------------------------------------------

# Upstream's parameter order (python/sglang/kernels/aot/python/sgl_kernel/kvcacheio.py and the
# get_device_accessible_ptr op schema), without the trailing block_quota / num_warps_per_block.
UPSTREAM_PARAMS = {
    "transfer_kv_per_layer": "src_k dst_k src_v dst_v src_indices dst_indices item_size",
    "transfer_kv_per_layer_pf_lf": "src_k dst_k src_v dst_v src_indices dst_indices layer_id "
    "item_size src_layout_dim",
    "transfer_kv_per_layer_ph_lf": "src_k dst_k src_v dst_v src_indices dst_indices layer_id "
    "item_size src_layout_dim page_size head_num",
    "transfer_kv_all_layer": "src_k_layers dst_k_layers src_v_layers dst_v_layers src_indices "
    "dst_indices item_size num_layers",
    "transfer_kv_all_layer_lf_pf": "src_k_layers dst_k src_v_layers dst_v src_indices "
    "dst_indices item_size dst_layout_dim num_layers",
    "transfer_kv_all_layer_lf_ph": "src_k_layers dst_k src_v_layers dst_v src_indices "
    "dst_indices item_size dst_layout_dim num_layers page_size head_num",
    "transfer_kv_per_layer_mla": "src dst src_indices dst_indices item_size",
    "transfer_kv_per_layer_mla_pf_lf": "src dst src_indices dst_indices layer_id item_size "
    "src_layout_dim",
    "transfer_kv_per_layer_mla_lf_pf": "src dst src_indices dst_indices layer_id item_size "
    "dst_layout_dim",
    "transfer_kv_all_layer_mla": "src_layers dst_layers src_indices dst_indices item_size "
    "num_layers",
    "transfer_kv_all_layer_mla_lf_pf": "src_layers dst src_indices dst_indices item_size "
    "dst_layout_dim num_layers",
    "transfer_kv_direct": "src_layers dst_layers src_indices dst_indices page_size",
    "transfer_kv_per_layer_direct_pf_lf": "src_ptrs dst_ptrs src_indices dst_indices layer_id "
    "page_size",
    "transfer_kv_all_layer_direct_lf_pf": "src_ptrs dst_ptrs src_indices dst_indices page_size",
    "transfer_embedding_ranges_direct": "src dst src_starts dst_starts lengths",
    "get_device_accessible_ptr": "tensor device_index",
}


def test_every_upstream_name_with_upstream_parameters() -> None:
    assert set(kernels.KVCACHEIO_OPS) == set(UPSTREAM_PARAMS)
    for name, params in UPSTREAM_PARAMS.items():
        got = list(inspect.signature(getattr(kernels, name)).parameters)
        want = params.split()
        if got[len(want) :] == ["block_quota", "num_warps_per_block"]:
            got = got[: len(want)]
        assert got == want, name
    # The names sglang 0.5.23's host pools and embedding cache import from sgl_kernel.kvcacheio.
    imported_by_sglang = {
        "transfer_kv_all_layer", "transfer_kv_all_layer_direct_lf_pf",
        "transfer_kv_all_layer_lf_pf", "transfer_kv_all_layer_lf_ph",
        "transfer_kv_all_layer_mla", "transfer_kv_all_layer_mla_lf_pf", "transfer_kv_direct",
        "transfer_kv_per_layer", "transfer_kv_per_layer_direct_pf_lf",
        "transfer_kv_per_layer_mla", "transfer_kv_per_layer_mla_pf_lf",
        "transfer_kv_per_layer_pf_lf", "transfer_kv_per_layer_ph_lf",
        "transfer_embedding_ranges_direct", "get_device_accessible_ptr",
    }  # fmt: skip
    assert imported_by_sglang <= set(kernels.KVCACHEIO_OPS)


# ---------------------------------------------------------------------------------------------
# K and V of different head sizes
# ---------------------------------------------------------------------------------------------

H, DK, DV = 2, 24, 16  # K 96 B, V 64 B per token and layer (192/128 heads, scaled down)
T_DEV, T_HOST = 40, 48
K_ITEM, V_ITEM = H * DK * 2, H * DV * 2


class Asym:
    """A device pool and host pools whose K and V differ in head size."""

    def __init__(self, seed: int, page: int = 4) -> None:
        self.page = page
        self.dev_k = rand(L, T_DEV, H, DK, seed=seed, device=DEVICE)
        self.dev_v = rand(L, T_DEV, H, DV, seed=seed + 1, device=DEVICE)
        self.lf_k = host(rand(L, T_HOST, H, DK, seed=seed + 2))
        self.lf_v = host(rand(L, T_HOST, H, DV, seed=seed + 3))
        self.pf_k = host(rand(T_HOST, L, H, DK, seed=seed + 4))
        self.pf_v = host(rand(T_HOST, L, H, DV, seed=seed + 5))
        self.ph_k = host(rand(T_HOST // page, H, page, L, DK, seed=seed + 6))
        self.ph_v = host(rand(T_HOST // page, H, page, L, DV, seed=seed + 7))
        self.pfd_k = host(rand(T_HOST // page, L, page, H, DK, seed=seed + 8))
        self.pfd_v = host(rand(T_HOST // page, L, page, H, DV, seed=seed + 9))

    NAMES = ("dev_k", "dev_v", "lf_k", "lf_v", "pf_k", "pf_v", "ph_k", "ph_v", "pfd_k", "pfd_v")

    def clone(self) -> Asym:
        other = object.__new__(Asym)
        other.page = self.page
        for n in self.NAMES:
            t = getattr(self, n)
            setattr(other, n, host(t.clone()) if t.device.type == "cpu" else t.clone())
        return other

    def tables(self, *names: str) -> list[torch.Tensor]:
        return [kernels.data_ptr_table(list(getattr(self, n)), DEVICE) for n in names]

    def expected_slots(self, name: str) -> torch.Tensor:
        """``[slots, L, H, D]`` view (a copy) of one buffer, by plain indexing."""
        t = getattr(self, name).cpu()
        if name.startswith("dev") or name.startswith("lf"):
            return t.transpose(0, 1)
        if name.startswith("pfd"):
            return t.permute(0, 2, 1, 3, 4).reshape(-1, L, H, t.shape[-1])
        if name.startswith("ph"):
            return t.permute(0, 2, 3, 1, 4).reshape(-1, L, H, t.shape[-1])
        return t


def _idx(values: list[int]) -> torch.Tensor:
    return torch.tensor(values, dtype=torch.int64, device=DEVICE)


DEV_SLOTS = [8, 9, 10, 11, 20, 21, 22, 23]  # two whole pages of 4
HOST_SLOTS = [36, 37, 38, 39, 4, 5, 6, 7]


def _call(op: str, w: Asym, layer: int) -> tuple[list[str], list[int]]:
    """Run ``op`` on ``w``; returns (written buffers, layers written)."""
    d_dev, d_host = _idx(DEV_SLOTS), _idx(HOST_SLOTS)
    all_layers = list(range(L))
    if op == "per_layer_h2d":
        kernels.transfer_kv_per_layer(w.lf_k[layer], w.dev_k[layer], w.lf_v[layer],
                                      w.dev_v[layer], d_host, d_dev, K_ITEM)  # fmt: skip
        return ["dev_k", "dev_v"], [layer]
    if op == "per_layer_d2h":
        kernels.transfer_kv_per_layer(w.dev_k[layer], w.lf_k[layer], w.dev_v[layer],
                                      w.lf_v[layer], d_dev, d_host, K_ITEM)  # fmt: skip
        return ["lf_k", "lf_v"], [layer]
    if op == "pf_lf":
        kernels.transfer_kv_per_layer_pf_lf(w.pf_k, w.dev_k[layer], w.pf_v, w.dev_v[layer],
                                            d_host, d_dev, layer, K_ITEM, K_ITEM * L)  # fmt: skip
        return ["dev_k", "dev_v"], [layer]
    if op == "ph_lf":
        kernels.transfer_kv_per_layer_ph_lf(w.ph_k, w.dev_k[layer], w.ph_v, w.dev_v[layer],
                                            d_host, d_dev, layer, K_ITEM, K_ITEM * L, w.page,
                                            H)  # fmt: skip
        return ["dev_k", "dev_v"], [layer]
    if op == "lf_pf":
        k_tbl, v_tbl = w.tables("dev_k", "dev_v")
        kernels.transfer_kv_all_layer_lf_pf(k_tbl, w.pf_k, v_tbl, w.pf_v, d_dev, d_host,
                                            K_ITEM, K_ITEM * L, L)  # fmt: skip
        return ["pf_k", "pf_v"], all_layers
    if op == "lf_ph":
        k_tbl, v_tbl = w.tables("dev_k", "dev_v")
        kernels.transfer_kv_all_layer_lf_ph(k_tbl, w.ph_k, v_tbl, w.ph_v, d_dev, d_host,
                                            K_ITEM, K_ITEM * L, L, w.page, H)  # fmt: skip
        return ["ph_k", "ph_v"], all_layers
    if op == "direct_d2h":
        kernels.transfer_kv_direct(list(w.dev_k) + list(w.dev_v), list(w.lf_k) + list(w.lf_v),
                                   d_dev.cpu(), d_host.cpu(), w.page)  # fmt: skip
        return ["lf_k", "lf_v"], all_layers
    if op == "direct_pf_lf":
        kernels.transfer_kv_per_layer_direct_pf_lf(
            [w.pfd_k, w.pfd_v], [w.dev_k[layer], w.dev_v[layer]], d_host.cpu(), d_dev.cpu(),
            layer, w.page,
        )  # fmt: skip
        return ["dev_k", "dev_v"], [layer]
    if op == "direct_lf_pf":
        kernels.transfer_kv_all_layer_direct_lf_pf(list(w.dev_k) + list(w.dev_v),
                                                   [w.pfd_k, w.pfd_v], d_dev.cpu(),
                                                   d_host.cpu(), w.page)  # fmt: skip
        return ["pfd_k", "pfd_v"], all_layers
    # Upstream's own way: each buffer alone, with its own item size (per-buffer MLA ops).
    if op == "per_buffer_pf_lf":
        for kv, item in (("k", K_ITEM), ("v", V_ITEM)):
            kernels.transfer_kv_per_layer_mla_pf_lf(getattr(w, f"pf_{kv}"),
                                                    getattr(w, f"dev_{kv}")[layer], d_host,
                                                    d_dev, layer, item, item * L)  # fmt: skip
        return ["dev_k", "dev_v"], [layer]
    assert op == "per_buffer_lf_pf"
    for kv, item in (("k", K_ITEM), ("v", V_ITEM)):
        (tbl,) = w.tables(f"dev_{kv}")
        kernels.transfer_kv_all_layer_mla_lf_pf(tbl, getattr(w, f"pf_{kv}"), d_dev, d_host,
                                                item, item * L, L)  # fmt: skip
    return ["pf_k", "pf_v"], all_layers


SOURCE = {"per_layer_h2d": "lf", "per_layer_d2h": "dev", "pf_lf": "pf", "ph_lf": "ph",
          "lf_pf": "dev", "lf_ph": "dev", "direct_d2h": "dev", "direct_pf_lf": "pfd",
          "direct_lf_pf": "dev", "per_buffer_pf_lf": "pf", "per_buffer_lf_pf": "dev"}  # fmt: skip


@pytest.mark.parametrize("op", list(SOURCE))
def test_k_and_v_of_different_head_sizes(op: str) -> None:
    """V is copied with V's own size: the named slots of every written layer hold the source,
    everything else (other slots, other layers, other buffers) is unchanged."""
    layer = 1
    w = Asym(seed=7)
    before = w.clone()
    written, layers = _call(op, w, layer)
    sync()
    to_dev = written[0].startswith("dev")
    src_slots, dst_slots = (HOST_SLOTS, DEV_SLOTS) if to_dev else (DEV_SLOTS, HOST_SLOTS)
    for name in Asym.NAMES:
        got, expected = w.expected_slots(name), before.expected_slots(name).clone()
        if name in written:
            src = before.expected_slots(f"{SOURCE[op]}_{name[-1]}")
            for layer_ in layers:
                expected[dst_slots, layer_] = src[src_slots, layer_]
        assert same(got, expected), f"{op}: {name}"


@pytest.mark.parametrize("op", ["per_layer_h2d", "pf_lf", "ph_lf", "lf_pf", "lf_ph"])
def test_k_and_v_of_different_head_sizes_match_the_reference(op: str) -> None:
    ours, ref = Asym(seed=3), Asym(seed=3)
    real = {n: getattr(kernels, n) for n in kernels.KVCACHEIO_OPS}
    _call(op, ours, 2)
    try:  # the same calls, on the reference's ops
        for n in real:
            if hasattr(reference, n):
                setattr(kernels, n, getattr(reference, n))
        _call(op, ref, 2)
    finally:
        for n, fn in real.items():
            setattr(kernels, n, fn)
    sync()
    for name in Asym.NAMES:
        assert same(getattr(ours, name), getattr(ref, name)), name


def test_mismatched_v_tensors_are_refused() -> None:
    w = Asym(seed=1)
    s, d = _idx(HOST_SLOTS), _idx(DEV_SLOTS)
    before = w.clone()
    narrow_v = torch.zeros(T_DEV, H, DV // 2, dtype=torch.bfloat16, device=DEVICE)
    with pytest.raises(ValueError, match="V tensors differ"):
        kernels.transfer_kv_per_layer(w.lf_k[0], w.dev_k[0], w.lf_v[0], narrow_v, s, d, K_ITEM)
    with pytest.raises(ValueError, match="src_k and src_v"):
        kernels.transfer_kv_per_layer(w.lf_k[0], w.dev_k[0], w.lf_v[0][:-1], w.dev_v[0], s, d,
                                      K_ITEM)  # fmt: skip
    with pytest.raises(ValueError, match="src_k and src_v"):
        kernels.transfer_kv_per_layer_pf_lf(w.pf_k, w.dev_k[0], w.pf_v[:, :2].contiguous(),
                                            w.dev_v[0], s, d, 0, K_ITEM, K_ITEM * L)  # fmt: skip
    sync()
    for name in Asym.NAMES:
        assert same(getattr(w, name), getattr(before, name)), name


# ---------------------------------------------------------------------------------------------
# page_head
# ---------------------------------------------------------------------------------------------


def test_page_head_story() -> None:
    """Hand-checked: 2 heads of 2 fp32 each, pages of 2 slots, 2 layers. Host slot 3 is page 1,
    row 1; its head h of layer l sits at [1, h, 1, l]."""
    ph = torch.zeros(2, 2, 2, 2, 2)  # [pages, heads, page_size, layers, head_dim]
    dev = torch.arange(2 * 5 * 2 * 2, dtype=torch.float32).view(2, 5, 2, 2)  # [L, T, H, D]
    tbl = kernels.data_ptr_table(list(dev), "cpu")
    s, d = torch.tensor([4, 0]), torch.tensor([3, 0])
    kernels.transfer_kv_all_layer_lf_ph(tbl, ph, tbl, ph.clone(), s, d, 16, 32, 2, 2, 2)
    # dev slot 4 of layer 0 is [[16, 17], [18, 19]] (heads 0, 1); of layer 1, [[36, 37], [38, 39]]
    assert ph[1, 0, 1].tolist() == [[16, 17], [36, 37]]  # head 0, layers 0 and 1
    assert ph[1, 1, 1].tolist() == [[18, 19], [38, 39]]
    assert ph[0, 0, 0].tolist() == [[0, 1], [20, 21]]  # slot 0 <- slot 0
    assert not ph[0, :, 1].any() and not ph[1, :, 0].any()  # untouched slots
    back = torch.zeros(5, 2, 2)
    kernels.transfer_kv_per_layer_ph_lf(ph, back, ph, back.clone(), d, s, 1, 16, 32, 2, 2)
    assert back[4].tolist() == dev[1, 4].tolist()
    assert back[0].tolist() == dev[1, 0].tolist()
    assert not back[1:4].any()


PH_BAD = [
    ("head_num", 3, "head_num"),
    ("page_size", 8, "page_size"),
    ("src_layout_dim", K_ITEM * L + 16, "src_layout_dim"),
    ("layer_id", L, "layer_id"),
    ("src_k", "4d", "src_k"),
]


@pytest.mark.parametrize("key, value, needle", PH_BAD, ids=[b[0] for b in PH_BAD])
def test_page_head_bad_arguments(key: str, value: object, needle: str) -> None:
    w = Asym(seed=2)
    args = dict(
        src_k=w.ph_k, dst_k=w.dev_k[0], src_v=w.ph_v, dst_v=w.dev_v[0],
        src_indices=_idx(HOST_SLOTS), dst_indices=_idx(DEV_SLOTS), layer_id=0, item_size=K_ITEM,
        src_layout_dim=K_ITEM * L, page_size=w.page, head_num=H,
    )  # fmt: skip
    args[key] = w.ph_k.flatten(0, 1) if value == "4d" else value
    before = w.clone()
    with pytest.raises(ValueError, match=needle):
        kernels.transfer_kv_per_layer_ph_lf(**args)
    sync()
    for name in Asym.NAMES:
        assert same(getattr(w, name), getattr(before, name)), name


# ---------------------------------------------------------------------------------------------
# Pointer tables
# ---------------------------------------------------------------------------------------------


def test_table_alignment_is_recorded_at_build_and_voided_by_writes() -> None:
    layers = torch.zeros(3, 8, 64, dtype=torch.uint8)
    table = kernels.data_ptr_table(list(layers), "cpu")
    assert verified_alignment(table) == 16
    assert verified_alignment(table.clone()) == 0  # another tensor: nothing recorded
    table.view(torch.int64)[1] += 8  # an in-place write (through a view): not what was verified
    assert verified_alignment(table) == 0
    assert kernels.verify_ptr_table(table) == 8
    assert verified_alignment(table) == 8
    assert pointer_alignment([64, 0]) == 0 and pointer_alignment([48, 24]) == 8


def test_table_entries_of_any_alignment_copy_exactly() -> None:
    """An entry 1 byte into a buffer is a valid (if odd) layer base: the copy uses byte words
    and still equals the reference; the 16-byte hint is only given for verified alignment."""
    from hicache_prefill.kernels.layout.addressing import TABLE_TO_TABLE, KVCopy
    from hicache_prefill.kernels.triton.launch import plan_geometry

    backing = torch.randint(0, 256, (2, 33 * 32), dtype=torch.uint8)
    src_tbl = torch.tensor([backing[0].data_ptr() + 1, backing[1].data_ptr()], dtype=torch.int64)
    dst = torch.zeros(2, 32, 32, dtype=torch.uint8)
    dst_tbl = kernels.data_ptr_table(list(dst), "cpu")
    ref = dst.clone()
    s, d = torch.tensor([0, 5, 31]), torch.tensor([2, 3, 31])
    kernels.transfer_kv_all_layer_mla(src_tbl, dst_tbl, s, d, 32, 2)
    reference.transfer_kv_all_layer_mla(src_tbl, kernels.data_ptr_table(list(ref), "cpu"), s, d,
                                        32, 2)  # fmt: skip
    assert torch.equal(dst, ref)
    assert torch.equal(dst[0, 2], backing[0, 1:33])
    part = KVCopy(TABLE_TO_TABLE, (src_tbl,), (dst_tbl,), s, d, 32, num_layers=2).parts()[0]
    assert plan_geometry(part, 32).src_align == 0  # never verified: no hint, 8-byte words
    assert plan_geometry(part, 32).dst_align == 16  # built by data_ptr_table


# ---------------------------------------------------------------------------------------------
# get_device_accessible_ptr, transfer_embedding_ranges_direct
# ---------------------------------------------------------------------------------------------


def test_get_device_accessible_ptr() -> None:
    t = host(torch.zeros(4, 8))
    assert kernels.get_device_accessible_ptr(t, 0) == t.data_ptr()
    for bad in (-1, True, "0"):
        with pytest.raises(ValueError, match="device_index"):
            kernels.get_device_accessible_ptr(t, bad)
    with pytest.raises(ValueError, match="tensor"):
        kernels.get_device_accessible_ptr([1, 2], 0)
    if not torch.cuda.is_available():
        with pytest.raises(ValueError, match="meta"):
            kernels.get_device_accessible_ptr(torch.zeros(2, device="meta"), 0)


EMB_BAD = [
    (dict(lengths=[2, -1]), "lengths"),
    (dict(src_starts=[0, 15]), "src_starts"),
    (dict(dst_starts=[0, 9]), "dst_starts"),
    (dict(lengths=[2]), "same length"),
]


@pytest.mark.parametrize("change, needle", EMB_BAD, ids=[b[1] for b in EMB_BAD])
def test_embedding_ranges_bad_plan_writes_nothing(change: dict, needle: str) -> None:
    src = host(torch.arange(16 * 3, dtype=torch.float32).view(16, 3))
    dst = torch.full((10, 3), -1.0, device=DEVICE)
    args = dict(src=src, dst=dst, src_starts=[0, 4], dst_starts=[0, 5], lengths=[2, 3])
    kernels.transfer_embedding_ranges_direct(**args)
    sync()
    assert dst[5:8].tolist() == src[4:7].tolist() and dst[2].tolist() == [-1.0] * 3
    dst.fill_(-1.0)
    with pytest.raises(ValueError, match=needle):
        kernels.transfer_embedding_ranges_direct(**dict(args, **change))
    sync()
    assert (dst == -1.0).all()
