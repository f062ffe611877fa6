"""Upstream sgl-kernel's own kvcacheio test, run against this project's ``kernels`` package.

Source: sgl-project/sglang, ``python/sglang/kernels/aot/tests/test_kvcacheio.py`` at commit
1a389e312d38b3d5ee629da73564adfeee0a3d4f (the newest revision in the code index; the file moved
there from ``sgl-kernel/tests/test_kvcacheio.py``, whose last revision there, 0c52a1fd, has the
same tests minus ``test_transfer_embedding_ranges_direct`` and
``test_transfer_kv_per_layer_mla_page_first_roundtrip``). Apache-2.0, (c) the SGLang team.

Changes, all of them device, import or size changes; every test body is upstream's:

1. Imports: ``from sgl_kernel.kvcacheio import ...`` -> ``from kernels import ...``;
   ``sglang.srt.utils.get_cuda_version`` / ``is_hip`` -> the local stand-ins below.
2. Device: ``device = "cuda"`` / ``device="cuda"`` -> ``DEVICE`` (CUDA when present, else CPU
   with the Triton kernels interpreted); ``torch.cuda.X`` -> ``cuda.X`` (the real module on a
   CUDA machine; on CPU the no-op stand-in below: synchronize, manual_seed, streams, events);
   ``t.pin_memory()`` -> ``pin(t)`` (pins only on CUDA); the ``CUDA is required`` skip of the
   embedding-range test -> required only that the kernel device exists (CPU runs it).
3. Sizes, so the interpreted CPU run stays within tens of seconds (upstream's values in
   comments at each parametrize): fewer items and smaller pools; every family, dtype, page size,
   head count, MLA/MHA and direction upstream tests is kept.
4. Upstream's module-wide skip on CUDA 13 (an sgl-kernel crash) is dropped: no case here calls
   sgl-kernel.

Upstream has no asymmetric K/V case in this file (the sgl-kernel change that would have added
K head 192 / V head 128 cases, sgl-project/sglang#27629, was closed unmerged; upstream copies
such K and V one buffer at a time, sglang 0.5.23's ``AsymmetricMHATokenToKVPoolHost``). Those
cases, in both upstream's per-buffer form and the MHA ops, are in
``tests/kernels/test_kernels_surface.py``.
"""

# ruff: noqa: B905  (upstream's zip calls, kept as they are)
# fmt: off  (upstream's formatting, line length 88, kept so the file diffs cleanly against it)

import contextlib
import itertools
import sys

import pytest
import torch

from hicache_prefill.kernels import (
    transfer_embedding_ranges_direct,
    transfer_kv_all_layer,
    transfer_kv_all_layer_direct_lf_pf,
    transfer_kv_all_layer_lf_ph,
    transfer_kv_all_layer_mla,
    transfer_kv_direct,
    transfer_kv_per_layer,
    transfer_kv_per_layer_direct_pf_lf,
    transfer_kv_per_layer_mla,
    transfer_kv_per_layer_mla_lf_pf,
    transfer_kv_per_layer_mla_pf_lf,
)

# --- device and import stand-ins (change 1 and 2) ---------------------------------------------

HAS_CUDA = torch.cuda.is_available()
DEVICE = "cuda" if HAS_CUDA else "cpu"


def get_cuda_version():
    return tuple(int(x) for x in (torch.version.cuda or "0.0").split(".")[:2])


def is_hip():
    return torch.version.hip is not None


def pin(t):
    return t.pin_memory() if HAS_CUDA else t


class _CpuStream:
    _ids = itertools.count(1)

    def __init__(self):
        self.cuda_stream = next(self._ids)

    def synchronize(self):
        pass


class _CpuEvent:
    def record(self, stream=None):
        pass

    def synchronize(self):
        pass


class _CpuCuda:
    """What the tests call on ``torch.cuda``, for CPU tensors (all work is synchronous)."""

    _default = _CpuStream()

    @staticmethod
    def is_available():
        return True  # the kernel device (interpreted CPU) is there

    @staticmethod
    def synchronize():
        pass

    @staticmethod
    def manual_seed(seed):
        torch.manual_seed(seed)

    Stream = _CpuStream
    Event = _CpuEvent

    @staticmethod
    def stream(s):
        return contextlib.nullcontext()

    @classmethod
    def default_stream(cls):
        return cls._default


cuda = torch.cuda if HAS_CUDA else _CpuCuda()

# --- upstream's test, as is apart from the changes above ----------------------------------------

# Upstream skips this whole module on CUDA 13.x: sgl-kernel's transfer_kv kernel segfaults there
# (https://github.com/sgl-project/sglang/actions/runs/24600433057/job/71938317621?pr=23119). No
# case here calls sgl-kernel (change 1: the ops are this project's), so the module runs on every
# CUDA version (change 4); the cases that do call sgl-kernel, the parity tests in
# tests/kernels/test_kernels_gpu.py, keep that skip.


def ref_copy_with_indices(src_pool, dst_pool, src_indices, dst_indices):
    dst_pool[dst_indices] = src_pool[src_indices].to(dst_pool.device)


def ref_copy_with_indices_pf_direct(
    src_pool, dst_pool, src_indices, dst_indices, page_size, layer_id, lf_to_pf=False
):
    if lf_to_pf:
        for i in range(0, len(src_indices), page_size):
            dst_pool[dst_indices[i] // page_size][layer_id] = src_pool[layer_id][
                src_indices[i : i + page_size]
            ].to(dst_pool.device)
    else:
        for i in range(0, len(src_indices), page_size):
            dst_pool[layer_id][dst_indices[i : i + page_size]] = src_pool[
                src_indices[i] // page_size
            ][layer_id].to(dst_pool.device)


def ref_copy_with_indices_page_head(
    src_pool,
    dst_pool,
    src_indices,
    dst_indices,
    page_size,
    layer_id,
    head_num,
    lf_to_ph=False,
):
    if lf_to_ph:
        for head_id in range(head_num):
            for i in range(0, len(src_indices)):
                dst_pool[dst_indices[i] // page_size][head_id][dst_indices[i] % page_size][
                    layer_id
                ] = src_pool[layer_id][src_indices[i]][head_id].to(dst_pool.device)
    else:
        for head_id in range(head_num):
            for i in range(0, len(src_indices)):
                dst_pool[layer_id][dst_indices[i]][head_id] = src_pool[src_indices[i] // page_size][
                    head_id
                ][src_indices[i] % page_size][layer_id].to(dst_pool.device)


def ref_copy_embedding_ranges(src, dst, src_starts, dst_starts, lengths):
    for src_start, dst_start, length in zip(src_starts, dst_starts, lengths):
        dst[dst_start : dst_start + length].copy_(
            src[src_start : src_start + length], non_blocking=True
        )


@pytest.mark.skipif(not cuda.is_available(), reason="CUDA is required")
@pytest.mark.skipif(is_hip(), reason="This test covers the CUDA batch-copy op")
@pytest.mark.parametrize("direction", ["h2d", "d2h"])
def test_transfer_embedding_ranges_direct(direction: str):
    dtype = torch.bfloat16
    embedding_dim = 37
    page_size = 4
    fragmented_starts = [1, 11, 23]
    contiguous_starts = [2, 6, 10]
    lengths = [page_size, page_size, 2]
    host_rows = 28
    device_rows = 16

    host_values = torch.arange(host_rows * embedding_dim, dtype=torch.float32).reshape(
        host_rows, embedding_dim
    )
    device_values = torch.arange(device_rows * embedding_dim, dtype=torch.float32).reshape(
        device_rows, embedding_dim
    )

    if direction == "h2d":
        src = pin(host_values.to(dtype))
        direct_dst = torch.full((device_rows, embedding_dim), -1, dtype=dtype, device=DEVICE)
        reference_dst = torch.full_like(direct_dst, -1)
        src_starts, dst_starts = fragmented_starts, contiguous_starts
    else:
        src = device_values.to(dtype).to(DEVICE)
        direct_dst = pin(torch.full((host_rows, embedding_dim), -1, dtype=dtype))
        reference_dst = pin(torch.full((host_rows, embedding_dim), -1, dtype=dtype))
        src_starts, dst_starts = contiguous_starts, fragmented_starts

    cuda.synchronize()
    copy_stream = cuda.Stream()
    assert copy_stream.cuda_stream != cuda.default_stream().cuda_stream
    with cuda.stream(copy_stream):
        ref_copy_embedding_ranges(src, reference_dst, src_starts, dst_starts, lengths)
        transfer_embedding_ranges_direct(src, direct_dst, src_starts, dst_starts, lengths)
        completion_event = cuda.Event()
        completion_event.record(copy_stream)

    completion_event.synchronize()
    torch.testing.assert_close(direct_dst, reference_dst)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("num_items_to_transfer", [1, 128])  # upstream: [1, 128, 1024]
@pytest.mark.parametrize("page_size", [1, 16, 64])
@pytest.mark.parametrize("item_size", [256])
@pytest.mark.parametrize("total_items_in_pool", [1024])  # upstream: [10240]
@pytest.mark.parametrize("is_mla", [False, True])
@pytest.mark.parametrize("all_layers", [False, True])
def test_transfer_kv(
    dtype: torch.dtype,
    num_items_to_transfer: int,
    item_size: int,
    page_size: int,
    total_items_in_pool: int,
    is_mla: bool,
    all_layers: bool,
):
    """
    Tests the per-layer transfer functions, treating tensors as memory pools.
    """

    original_dtype = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    device = DEVICE
    cuda.manual_seed(42)

    num_layers = 4  # A small number of layers for pool creation

    total_pages_in_pool = total_items_in_pool // page_size
    num_pages_to_transfer = num_items_to_transfer // page_size
    if num_pages_to_transfer == 0:
        torch.set_default_dtype(original_dtype)
        return
    page_indices = torch.randperm(total_pages_in_pool, dtype=torch.int64)
    src_indices_host = torch.cat(
        [
            torch.arange(p * page_size, (p + 1) * page_size)
            for p in page_indices[:num_pages_to_transfer]
        ]
    )
    src_indices_device = src_indices_host.to(device)
    dst_indices_host = torch.cat(
        [
            torch.arange(p * page_size, (p + 1) * page_size)
            for p in page_indices[num_pages_to_transfer : 2 * num_pages_to_transfer]
        ]
    )
    dst_indices_device = dst_indices_host.to(device)

    # Prepare memory pools based on whether it's an MLA case.
    if is_mla:
        src_pool_host = pin(torch.randn(num_layers, total_items_in_pool, item_size))
        dst_pool_ref = torch.zeros_like(src_pool_host).to(device)
        dst_pool_kernel = torch.zeros_like(dst_pool_ref)
        dst_pool_direct = torch.zeros_like(dst_pool_ref)
    else:
        src_k_pool = pin(torch.randn(num_layers, total_items_in_pool, item_size))
        src_v_pool = pin(torch.randn(num_layers, total_items_in_pool, item_size))
        dst_k_pool_ref = torch.zeros_like(src_k_pool).to(device)
        dst_v_pool_ref = torch.zeros_like(src_v_pool).to(device)
        dst_k_pool_kernel = torch.zeros_like(dst_k_pool_ref)
        dst_v_pool_kernel = torch.zeros_like(dst_v_pool_ref)
        dst_k_pool_direct = torch.zeros_like(dst_k_pool_ref)
        dst_v_pool_direct = torch.zeros_like(dst_v_pool_ref)

    cuda.synchronize()

    # We will test the per-layer function on the first layer (index 0) of the pool.
    layer_idx_to_test = 0

    if is_mla:
        if not all_layers:
            ref_copy_with_indices(
                src_pool_host[layer_idx_to_test],
                dst_pool_ref[layer_idx_to_test],
                src_indices_host,
                dst_indices_device,
            )
            transfer_kv_per_layer_mla(
                src_pool_host[layer_idx_to_test],
                dst_pool_kernel[layer_idx_to_test],
                src_indices_device,
                dst_indices_device,
                item_size=item_size * dtype.itemsize,
            )
            transfer_kv_direct(
                [src_pool_host[layer_idx_to_test]],
                [dst_pool_direct[layer_idx_to_test]],
                src_indices_host,
                dst_indices_device,
                page_size=page_size,
            )
        else:
            for layer_id in range(num_layers):
                ref_copy_with_indices(
                    src_pool_host[layer_id],
                    dst_pool_ref[layer_id],
                    src_indices_host,
                    dst_indices_device,
                )
            src_layers_device = torch.tensor(
                [src_pool_host[layer_id].data_ptr() for layer_id in range(num_layers)],
                dtype=torch.uint64,
                device=device,
            )
            dst_layers_device = torch.tensor(
                [dst_pool_kernel[layer_id].data_ptr() for layer_id in range(num_layers)],
                dtype=torch.uint64,
                device=device,
            )
            transfer_kv_all_layer_mla(
                src_layers_device,
                dst_layers_device,
                src_indices_device,
                dst_indices_device,
                item_size=item_size * dtype.itemsize,
                num_layers=num_layers,
            )
            transfer_kv_direct(
                [src_pool_host[layer_id] for layer_id in range(num_layers)],
                [dst_pool_direct[layer_id] for layer_id in range(num_layers)],
                src_indices_host,
                dst_indices_device,
                page_size=page_size,
            )
        cuda.synchronize()
        torch.testing.assert_close(dst_pool_kernel, dst_pool_ref)
        torch.testing.assert_close(dst_pool_direct, dst_pool_ref)
    else:
        if not all_layers:
            ref_copy_with_indices(
                src_k_pool[layer_idx_to_test],
                dst_k_pool_ref[layer_idx_to_test],
                src_indices_host,
                dst_indices_device,
            )
            ref_copy_with_indices(
                src_v_pool[layer_idx_to_test],
                dst_v_pool_ref[layer_idx_to_test],
                src_indices_host,
                dst_indices_device,
            )
            transfer_kv_per_layer(
                src_k_pool[layer_idx_to_test],
                dst_k_pool_kernel[layer_idx_to_test],
                src_v_pool[layer_idx_to_test],
                dst_v_pool_kernel[layer_idx_to_test],
                src_indices_device,
                dst_indices_device,
                item_size=item_size * dtype.itemsize,
            )
            transfer_kv_direct(
                [src_k_pool[layer_idx_to_test], src_v_pool[layer_idx_to_test]],
                [
                    dst_k_pool_direct[layer_idx_to_test],
                    dst_v_pool_direct[layer_idx_to_test],
                ],
                src_indices_host,
                dst_indices_device,
                page_size=page_size,
            )
        else:
            for layer_id in range(num_layers):
                ref_copy_with_indices(
                    src_k_pool[layer_id],
                    dst_k_pool_ref[layer_id],
                    src_indices_host,
                    dst_indices_device,
                )
                ref_copy_with_indices(
                    src_v_pool[layer_id],
                    dst_v_pool_ref[layer_id],
                    src_indices_host,
                    dst_indices_device,
                )

            src_k_layers_device = torch.tensor(
                [src_k_pool[layer_id].data_ptr() for layer_id in range(num_layers)],
                dtype=torch.uint64,
                device=device,
            )
            src_v_layers_device = torch.tensor(
                [src_v_pool[layer_id].data_ptr() for layer_id in range(num_layers)],
                dtype=torch.uint64,
                device=device,
            )
            dst_k_layers_device = torch.tensor(
                [dst_k_pool_kernel[layer_id].data_ptr() for layer_id in range(num_layers)],
                dtype=torch.uint64,
                device=device,
            )
            dst_v_layers_device = torch.tensor(
                [dst_v_pool_kernel[layer_id].data_ptr() for layer_id in range(num_layers)],
                dtype=torch.uint64,
                device=device,
            )
            transfer_kv_all_layer(
                src_k_layers_device,
                dst_k_layers_device,
                src_v_layers_device,
                dst_v_layers_device,
                src_indices_device,
                dst_indices_device,
                item_size=item_size * dtype.itemsize,
                num_layers=num_layers,
            )
            transfer_kv_direct(
                [src_k_pool[layer_id] for layer_id in range(num_layers)]
                + [src_v_pool[layer_id] for layer_id in range(num_layers)],
                [dst_k_pool_direct[layer_id] for layer_id in range(num_layers)]
                + [dst_v_pool_direct[layer_id] for layer_id in range(num_layers)],
                src_indices_host,
                dst_indices_device,
                page_size=page_size,
            )
        cuda.synchronize()
        torch.testing.assert_close(dst_k_pool_kernel, dst_k_pool_ref)
        torch.testing.assert_close(dst_v_pool_kernel, dst_v_pool_ref)
        torch.testing.assert_close(dst_k_pool_direct, dst_k_pool_ref)
        torch.testing.assert_close(dst_v_pool_direct, dst_v_pool_ref)

    torch.set_default_dtype(original_dtype)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_transfer_kv_per_layer_mla_page_first_roundtrip(dtype):
    """Cover layer-sharded GLM MLA write-back when JIT rejects 656 bytes."""
    device = DEVICE
    page_size = 64
    num_layers = 3
    total_items = page_size * 6
    element_dim = 328
    layer_id = 1

    src = torch.arange(total_items * element_dim, device=device, dtype=dtype).reshape(
        total_items, 1, element_dim
    )
    dst = pin(torch.zeros(total_items, num_layers, 1, element_dim, dtype=dtype))

    src_pages = torch.tensor([4, 1], dtype=torch.int64)
    dst_pages = torch.tensor([0, 3], dtype=torch.int64)
    src_indices_host = torch.cat(
        [torch.arange(page * page_size, (page + 1) * page_size) for page in src_pages]
    )
    dst_indices_host = torch.cat(
        [torch.arange(page * page_size, (page + 1) * page_size) for page in dst_pages]
    )
    src_indices = src_indices_host.to(device)
    dst_indices = dst_indices_host.to(device)

    item_size = element_dim * dtype.itemsize
    assert item_size == 656
    transfer_kv_per_layer_mla_lf_pf(
        src=src,
        dst=dst,
        src_indices=src_indices,
        dst_indices=dst_indices,
        layer_id=layer_id,
        item_size=item_size,
        dst_layout_dim=num_layers * item_size,
    )
    cuda.synchronize()

    torch.testing.assert_close(dst[dst_indices_host, layer_id], src[src_indices].cpu())
    assert torch.count_nonzero(dst[:, 0]) == 0
    assert torch.count_nonzero(dst[:, 2]) == 0

    roundtrip = torch.zeros_like(src)
    load_indices = torch.arange(src_indices.numel(), device=device)
    transfer_kv_per_layer_mla_pf_lf(
        src=dst,
        dst=roundtrip,
        src_indices=dst_indices,
        dst_indices=load_indices,
        layer_id=layer_id,
        item_size=item_size,
        src_layout_dim=num_layers * item_size,
    )
    cuda.synchronize()
    torch.testing.assert_close(roundtrip[load_indices], src[src_indices])


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("num_items_to_transfer", [128, 256])  # upstream: [128, 1024, 8192]
@pytest.mark.parametrize("page_size", [16, 64, 128])
@pytest.mark.parametrize("item_size", [256])
@pytest.mark.parametrize("total_items_in_pool", [1024])  # upstream: [20480]
@pytest.mark.parametrize("is_mla", [False, True])
@pytest.mark.parametrize("lf_to_pf", [False, True])
def test_transfer_kv_pf_direct(
    dtype: torch.dtype,
    num_items_to_transfer: int,
    item_size: int,
    page_size: int,
    total_items_in_pool: int,
    is_mla: bool,
    lf_to_pf: bool,
):
    original_dtype = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    device = DEVICE
    cuda.manual_seed(42)
    test_stream = cuda.Stream()

    num_layers = 4

    total_pages_in_pool = total_items_in_pool // page_size
    num_pages_to_transfer = num_items_to_transfer // page_size
    if num_pages_to_transfer == 0:
        torch.set_default_dtype(original_dtype)
        return
    page_indices = torch.randperm(total_pages_in_pool, dtype=torch.int64)
    src_indices_host = torch.cat(
        [
            torch.arange(p * page_size, (p + 1) * page_size)
            for p in page_indices[:num_pages_to_transfer]
        ]
    )
    src_indices_device = src_indices_host.to(device)
    dst_indices_host = torch.cat(
        [
            torch.arange(p * page_size, (p + 1) * page_size)
            for p in page_indices[num_pages_to_transfer : 2 * num_pages_to_transfer]
        ]
    )
    dst_indices_device = dst_indices_host.to(device)

    # We will test the per-layer function on the first layer (index 0) of the pool.
    layer_idx_to_test = 0

    if lf_to_pf:
        if is_mla:
            src_pool = torch.randn(num_layers, total_items_in_pool, item_size).to(device)
            src_pool_ptrs = [src_pool[i] for i in range(num_layers)]
            dst_pool_ref = pin(torch.zeros(total_pages_in_pool, num_layers, page_size, item_size))
            dst_pool_direct = torch.zeros_like(dst_pool_ref)
            cuda.synchronize()

            with cuda.stream(test_stream):
                transfer_kv_all_layer_direct_lf_pf(
                    src_pool_ptrs,
                    [dst_pool_direct],
                    src_indices_host,
                    dst_indices_host,
                    page_size,
                )
            test_stream.synchronize()

            for i in range(num_layers):
                ref_copy_with_indices_pf_direct(
                    src_pool,
                    dst_pool_ref,
                    src_indices_device,
                    dst_indices_host,
                    page_size,
                    i,
                    lf_to_pf=True,
                )
            cuda.synchronize()
            torch.testing.assert_close(dst_pool_direct, dst_pool_ref)

        else:
            src_k_pool = torch.randn(num_layers, total_items_in_pool, item_size).to(device)
            src_k_pool_ptrs = [src_k_pool[i] for i in range(num_layers)]
            src_v_pool = torch.randn(num_layers, total_items_in_pool, item_size).to(device)
            src_v_pool_ptrs = [src_v_pool[i] for i in range(num_layers)]
            dst_k_pool_ref = pin(torch.zeros(total_pages_in_pool, num_layers, page_size, item_size))
            dst_v_pool_ref = torch.zeros_like(dst_k_pool_ref)
            dst_k_pool_direct = torch.zeros_like(dst_k_pool_ref)
            dst_v_pool_direct = torch.zeros_like(dst_v_pool_ref)
            cuda.synchronize()

            with cuda.stream(test_stream):
                transfer_kv_all_layer_direct_lf_pf(
                    src_k_pool_ptrs + src_v_pool_ptrs,
                    [dst_k_pool_direct, dst_v_pool_direct],
                    src_indices_host,
                    dst_indices_host,
                    page_size,
                )
            test_stream.synchronize()

            for i in range(num_layers):
                ref_copy_with_indices_pf_direct(
                    src_k_pool,
                    dst_k_pool_ref,
                    src_indices_device,
                    dst_indices_host,
                    page_size,
                    i,
                    lf_to_pf=True,
                )
                ref_copy_with_indices_pf_direct(
                    src_v_pool,
                    dst_v_pool_ref,
                    src_indices_device,
                    dst_indices_host,
                    page_size,
                    i,
                    lf_to_pf=True,
                )
            cuda.synchronize()
            torch.testing.assert_close(dst_k_pool_direct, dst_k_pool_ref)
            torch.testing.assert_close(dst_v_pool_direct, dst_v_pool_ref)
    else:
        if is_mla:
            src_pool = pin(torch.randn(total_pages_in_pool, num_layers, page_size, item_size))

            dst_pool_ref = torch.zeros(num_layers, total_items_in_pool, item_size).to(device)
            dst_pool_direct = torch.zeros_like(dst_pool_ref)
            dst_pool_direct_ptrs = [dst_pool_direct[i] for i in range(num_layers)]
            cuda.synchronize()

            with cuda.stream(test_stream):
                transfer_kv_per_layer_direct_pf_lf(
                    [src_pool],
                    [dst_pool_direct_ptrs[layer_idx_to_test]],
                    src_indices_host,
                    dst_indices_host,
                    layer_idx_to_test,
                    page_size,
                )
            test_stream.synchronize()

            ref_copy_with_indices_pf_direct(
                src_pool,
                dst_pool_ref,
                src_indices_host,
                dst_indices_device,
                page_size,
                layer_idx_to_test,
                lf_to_pf=False,
            )
            cuda.synchronize()
            torch.testing.assert_close(dst_pool_direct, dst_pool_ref)
        else:
            src_k_pool = pin(torch.randn(total_pages_in_pool, num_layers, page_size, item_size))
            src_v_pool = pin(torch.randn(total_pages_in_pool, num_layers, page_size, item_size))

            dst_k_pool_ref = torch.zeros(num_layers, total_items_in_pool, item_size).to(device)
            dst_k_pool_direct = torch.zeros_like(dst_k_pool_ref)
            dst_k_pool_direct_ptrs = [dst_k_pool_direct[i] for i in range(num_layers)]

            dst_v_pool_ref = torch.zeros_like(dst_k_pool_ref)
            dst_v_pool_direct = torch.zeros_like(dst_v_pool_ref)
            dst_v_pool_direct_ptrs = [dst_v_pool_direct[i] for i in range(num_layers)]
            cuda.synchronize()

            with cuda.stream(test_stream):
                transfer_kv_per_layer_direct_pf_lf(
                    [src_k_pool, src_v_pool],
                    [
                        dst_k_pool_direct_ptrs[layer_idx_to_test],
                        dst_v_pool_direct_ptrs[layer_idx_to_test],
                    ],
                    src_indices_host,
                    dst_indices_host,
                    layer_idx_to_test,
                    page_size,
                )
            test_stream.synchronize()

            ref_copy_with_indices_pf_direct(
                src_k_pool,
                dst_k_pool_ref,
                src_indices_host,
                dst_indices_device,
                page_size,
                layer_idx_to_test,
                lf_to_pf=False,
            )
            ref_copy_with_indices_pf_direct(
                src_v_pool,
                dst_v_pool_ref,
                src_indices_host,
                dst_indices_device,
                page_size,
                layer_idx_to_test,
                lf_to_pf=False,
            )

            cuda.synchronize()
            torch.testing.assert_close(dst_k_pool_direct, dst_k_pool_ref)
            torch.testing.assert_close(dst_v_pool_direct, dst_v_pool_ref)
    torch.set_default_dtype(original_dtype)


@pytest.mark.skipif(is_hip(), reason="HIP is not supported for this test")
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("num_items_to_transfer", [128])  # upstream: [256, 1024]
@pytest.mark.parametrize("page_size", [16, 64, 128])
@pytest.mark.parametrize("item_size", [1024])
@pytest.mark.parametrize("head_num", [8, 16])
@pytest.mark.parametrize("total_items_in_pool", [512])  # upstream: [4096]
@pytest.mark.parametrize("lf_to_ph", [False, True])
def test_transfer_kv_page_head(
    dtype: torch.dtype,
    num_items_to_transfer: int,
    page_size: int,
    item_size: int,
    head_num: int,
    total_items_in_pool: int,
    lf_to_ph: bool,
):
    original_dtype = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    device = DEVICE
    cuda.manual_seed(42)

    num_layers = 4

    total_pages_in_pool = total_items_in_pool // page_size
    num_pages_to_transfer = num_items_to_transfer // page_size
    if num_pages_to_transfer == 0:
        torch.set_default_dtype(original_dtype)
        return

    assert item_size % head_num == 0
    head_dim = item_size // head_num

    page_indices = torch.randperm(total_pages_in_pool, dtype=torch.int64)
    src_indices_host = torch.cat(
        [
            torch.arange(p * page_size, (p + 1) * page_size)
            for p in page_indices[:num_pages_to_transfer]
        ]
    )
    src_indices_device = src_indices_host.to(device)
    dst_indices_host = torch.cat(
        [
            torch.arange(p * page_size, (p + 1) * page_size)
            for p in page_indices[num_pages_to_transfer : 2 * num_pages_to_transfer]
        ]
    )
    dst_indices_device = dst_indices_host.to(device)

    # We will test the per-layer function on the first layer (index 0) of the pool.
    layer_idx_to_test = 0

    if lf_to_ph:
        src_k_pool = torch.randn(num_layers, total_items_in_pool, head_num, head_dim).to(device)
        src_v_pool = torch.randn(num_layers, total_items_in_pool, head_num, head_dim).to(device)
        src_k_pool_ptrs = [src_k_pool[i] for i in range(num_layers)]
        src_k_pool_ptrs = torch.tensor(
            [x.data_ptr() for x in src_k_pool_ptrs],
            dtype=torch.uint64,
            device=device,
        )
        src_v_pool_ptrs = [src_v_pool[i] for i in range(num_layers)]
        src_v_pool_ptrs = torch.tensor(
            [x.data_ptr() for x in src_v_pool_ptrs],
            dtype=torch.uint64,
            device=device,
        )

        dst_k_pool_ref = pin(
            torch.zeros(total_pages_in_pool, head_num, page_size, num_layers, head_dim)
        )
        dst_v_pool_ref = pin(torch.zeros_like(dst_k_pool_ref))

        dst_k_pool_kernel = pin(torch.zeros_like(dst_k_pool_ref))
        dst_v_pool_kernel = pin(torch.zeros_like(dst_v_pool_ref))
        cuda.synchronize()

        transfer_kv_all_layer_lf_ph(
            src_k_pool_ptrs,
            dst_k_pool_kernel,
            src_v_pool_ptrs,
            dst_v_pool_kernel,
            src_indices_device,
            dst_indices_device,
            item_size * dtype.itemsize,
            item_size * num_layers * dtype.itemsize,
            num_layers,
            page_size,
            head_num,
        )
        cuda.synchronize()

        for i in range(num_layers):
            ref_copy_with_indices_page_head(
                src_k_pool,
                dst_k_pool_ref,
                src_indices_device,
                dst_indices_host,
                page_size,
                i,
                head_num,
                lf_to_ph=True,
            )
            ref_copy_with_indices_page_head(
                src_v_pool,
                dst_v_pool_ref,
                src_indices_device,
                dst_indices_host,
                page_size,
                i,
                head_num,
                lf_to_ph=True,
            )
        cuda.synchronize()
        torch.testing.assert_close(dst_k_pool_kernel, dst_k_pool_ref)
        torch.testing.assert_close(dst_v_pool_kernel, dst_v_pool_ref)
    else:
        from hicache_prefill.kernels import transfer_kv_per_layer_ph_lf

        src_k_pool = pin(
            torch.randn(total_pages_in_pool, head_num, page_size, num_layers, head_dim)
        )
        src_v_pool = pin(
            torch.randn(total_pages_in_pool, head_num, page_size, num_layers, head_dim)
        )

        dst_k_pool_ref = torch.zeros(num_layers, total_items_in_pool, head_num, head_dim).to(device)
        dst_v_pool_ref = torch.zeros_like(dst_k_pool_ref)
        dst_k_pool_kernel = torch.zeros_like(dst_k_pool_ref)
        dst_v_pool_kernel = torch.zeros_like(dst_v_pool_ref)
        dst_k_pool_kernel_ptrs = [dst_k_pool_kernel[i] for i in range(num_layers)]
        dst_v_pool_kernel_ptrs = [dst_v_pool_kernel[i] for i in range(num_layers)]
        cuda.synchronize()

        transfer_kv_per_layer_ph_lf(
            src_k_pool,
            dst_k_pool_kernel_ptrs[layer_idx_to_test],
            src_v_pool,
            dst_v_pool_kernel_ptrs[layer_idx_to_test],
            src_indices_device,
            dst_indices_device,
            layer_idx_to_test,
            item_size * dtype.itemsize,
            item_size * num_layers * dtype.itemsize,
            page_size,
            head_num,
        )

        ref_copy_with_indices_page_head(
            src_k_pool,
            dst_k_pool_ref,
            src_indices_host,
            dst_indices_device,
            page_size,
            layer_idx_to_test,
            head_num,
            lf_to_ph=False,
        )
        ref_copy_with_indices_page_head(
            src_v_pool,
            dst_v_pool_ref,
            src_indices_host,
            dst_indices_device,
            page_size,
            layer_idx_to_test,
            head_num,
            lf_to_ph=False,
        )
        cuda.synchronize()
        torch.testing.assert_close(dst_k_pool_kernel, dst_k_pool_ref)
        torch.testing.assert_close(dst_v_pool_kernel, dst_v_pool_ref)
    torch.set_default_dtype(original_dtype)


if __name__ == "__main__":
    sys.exit(pytest.main([__file__]))
