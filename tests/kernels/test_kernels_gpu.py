"""GPU-only kernel tests (marked ``gpu``; skipped without CUDA).

- the op matrix again, with the host pools in pinned memory (compiled kernels reading and
  writing host memory through unified addressing);
- host memory registered with ``cudaHostRegister`` instead of allocated pinned;
- no op (kernel backend) synchronizes the host: run under ``torch.cuda.set_sync_debug_mode``;
- byte offsets past 2**31 into a host buffer (64-bit address math);
- debug checks on CUDA: out-of-range indices raise at the call when on; when off the kernel
  skips the pair and records it on the device, and the copy's check raises the same error;
- every op against the independent oracle (``tests/kernels/oracle.py``) with pinned host pools;
- parity with ``sgl_kernel`` for every op, where it imports (skipped otherwise, and on CUDA 13
  and later, where sgl-kernel's own kvcacheio kernels crash).

Sized to compile few kernel variants: each new (item size, addressing) pair is a compile.

The case tables come from ``tests.kernels.test_kernels``, which imports hypothesis for one property
test. A GPU machine may have pytest without hypothesis (``bench/gpu_check.sh`` allows it): then a
stand-in module lets ``tests.kernels.test_kernels`` import, and its hypothesis test is skipped, not
this module.
"""

from __future__ import annotations

import importlib
import sys
import types

import pytest
import torch


def _hypothesis_stand_in() -> None:
    """``hypothesis`` / ``hypothesis.strategies`` stand-ins: ``@given`` skips the test."""
    hyp = types.ModuleType("hypothesis")
    strategies = types.ModuleType("hypothesis.strategies")
    strategies.__getattr__ = lambda name: lambda *a, **k: None  # type: ignore[attr-defined]
    hyp.strategies = strategies  # type: ignore[attr-defined]
    hyp.given = lambda *a, **k: pytest.mark.skip(reason="hypothesis is not installed")
    hyp.settings = lambda *a, **k: lambda fn: fn  # type: ignore[attr-defined]
    hyp.HealthCheck = types.SimpleNamespace(too_slow=None)  # type: ignore[attr-defined]
    hyp.__stand_in__ = True  # type: ignore[attr-defined]
    sys.modules["hypothesis"] = hyp
    sys.modules["hypothesis.strategies"] = strategies


try:
    import hypothesis  # noqa: F401
except ImportError:
    _hypothesis_stand_in()

from hicache_prefill import kernels  # noqa: E402
from tests.kernels import test_kernels_oracle as oracle_cases  # noqa: E402
from tests.kernels.test_kernels import (  # noqa: E402
    CASES,
    OPS,
    World,
    indices,
    make_world,
    run_and_check,
    same_bytes,
)

pytestmark = pytest.mark.gpu

# Word sizes 1, 4 and 8, several column chunks, page sizes 1 and 16.
GPU_CASES = [CASES[2], CASES[4], CASES[6], CASES[7]]


@pytest.mark.parametrize("mla", [False, True], ids=["mha", "mla"])
@pytest.mark.parametrize("case", GPU_CASES, ids=[c.id for c in GPU_CASES])
@pytest.mark.parametrize("op", list(OPS))
def test_op_matches_reference_with_pinned_host(op: str, case, mla: bool) -> None:
    run_and_check(op, case, mla, seed=3 + list(OPS).index(op), pin_host=True)


def test_registered_host_memory() -> None:
    """A plain host tensor registered with cudaHostRegister (as the host pool does)."""
    n_slots, item = 512, 1024
    host = torch.zeros(n_slots, item, dtype=torch.uint8)
    cudart = torch.cuda.cudart()
    assert cudart.cudaHostRegister(host.data_ptr(), host.numel(), 0) == 0
    try:
        assert host.is_pinned()
        dev = torch.randint(0, 256, (n_slots, item), dtype=torch.uint8, device="cuda")
        s = torch.randperm(n_slots, device="cuda")[:100]
        d = torch.randperm(n_slots, device="cuda")[:100]
        kernels.transfer_kv_per_layer_mla(dev, host, s, d, item)
        torch.cuda.synchronize()
        assert torch.equal(host[d.cpu()], dev[s].cpu())
    finally:
        cudart.cudaHostUnregister(host.data_ptr())


@pytest.mark.parametrize("op", [o for o in OPS if not o.startswith("direct")])
def test_kernel_ops_never_synchronize(op: str) -> None:
    spec = OPS[op]
    case = CASES[7]
    world = make_world(case, False, 1, pin_host=True)
    s, d = indices(case, world, spec.src, spec.dst, 1)
    fn = getattr(kernels, spec.mha)
    # Compile first (compilation may synchronize); this also builds the pointer tables (a
    # blocking host-to-device copy), which the second call reuses (``test_kernels.table``).
    spec.call(fn, world, s, d, 1, False)
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        spec.call(fn, world, s, d, 1, False)
    finally:
        torch.cuda.set_sync_debug_mode("default")
    torch.cuda.synchronize()


def test_offsets_past_2_gib() -> None:
    """Page_first host buffer of ~2.1 GB: slots near its end sit past byte 2**31."""
    item, n_layers = 4096, 2
    n_slots = (1 << 31) // (item * n_layers) + 64
    host = torch.empty(n_slots, n_layers, 1, item, dtype=torch.uint8)
    cudart = torch.cuda.cudart()
    assert cudart.cudaHostRegister(host.data_ptr(), host.numel(), 0) == 0
    try:
        dev = [torch.randint(0, 256, (256, 1, item), dtype=torch.uint8, device="cuda")
               for _ in range(n_layers)]  # fmt: skip
        table = kernels.data_ptr_table(dev, "cuda")
        s = torch.arange(200, 232, device="cuda")
        d = torch.arange(n_slots - 32, n_slots, device="cuda")
        assert int(d[0]) * item * n_layers > 1 << 31
        kernels.transfer_kv_all_layer_mla_lf_pf(table, host, s, d, item, item * n_layers, n_layers)
        back = torch.zeros(256, 1, item, dtype=torch.uint8, device="cuda")
        kernels.transfer_kv_per_layer_mla_pf_lf(host, back, d, s, 1, item, item * n_layers)
        torch.cuda.synchronize()
        assert torch.equal(host[n_slots - 32 :, 0].cuda(), dev[0][200:232])
        assert torch.equal(back[200:232], dev[1][200:232])
    finally:
        cudart.cudaHostUnregister(host.data_ptr())


def test_debug_checks_on_cuda() -> None:
    dev = torch.zeros(64, 8, dtype=torch.uint8, device="cuda")
    src = torch.ones(16, 8, dtype=torch.uint8, device="cuda")
    s = torch.tensor([0, 1], device="cuda")
    d = torch.tensor([3, 64], device="cuda")  # 64 is one past the end
    kernels.set_debug_checks(True)
    try:
        with pytest.raises(kernels.KVIndexError, match="transfer_kv_per_layer_mla: dst_indices"):
            kernels.transfer_kv_per_layer_mla(src, dev, s, d, 8)
    finally:
        kernels.set_debug_checks(False)
    watch = kernels.watch_copies("cuda")
    with watch:  # unchecked on the host: the kernel skips the bad pair and records it
        kernels.transfer_kv_per_layer_mla(src, dev, s, d, 8)
    torch.cuda.synchronize()
    with pytest.raises(kernels.KVIndexError, match="dst_indices holds slot 64.*64 slots"):
        watch.check()
    expected = torch.zeros(64, 8, dtype=torch.uint8)
    expected[3] = 1
    assert torch.equal(dev.cpu(), expected)


def test_bad_index_on_an_all_layer_op_is_recorded_on_cuda() -> None:
    """A table side carries its bound: an index past it is skipped and reported, not written
    through the table into whatever memory follows the layer."""
    layers = [torch.zeros(16, 8, dtype=torch.uint8, device="cuda") for _ in range(2)]
    host = torch.zeros(32, 2, 8, dtype=torch.uint8).pin_memory()
    table = kernels.data_ptr_table(layers, "cuda")
    s = torch.tensor([2, 16], device="cuda")  # 16: one past the layers' end
    d = torch.tensor([0, 1], device="cuda")
    watch = kernels.watch_copies("cuda")
    with watch:
        kernels.transfer_kv_all_layer_mla_lf_pf(table, host, s, d, 8, 16, 2)
    torch.cuda.synchronize()
    with pytest.raises(kernels.KVIndexError, match="src_indices holds slot 16.*16 slots"):
        watch.check()
    watch.check()  # reported once


@pytest.mark.parametrize("case", oracle_cases.CASES, ids=[c.id for c in oracle_cases.CASES])
def test_op_matches_the_oracle_with_pinned_host(case) -> None:
    oracle_cases.run_case(case, seed=11, device=torch.device("cuda"), pin=True)


@pytest.fixture(scope="module")
def sgl():
    cuda_major = int((torch.version.cuda or "0").split(".")[0])
    if cuda_major >= 13:  # upstream skips its own kvcacheio tests there: they crash the process
        pytest.skip(f"sgl_kernel's kvcacheio kernels crash on CUDA {torch.version.cuda}")
    try:
        return importlib.import_module("sgl_kernel.kvcacheio")
    except Exception as exc:  # not installed, or built for another torch / CUDA
        pytest.skip(f"sgl_kernel not usable: {exc}")


# sgl_kernel needs item sizes that are multiples of 8 bytes.
SGL_CASES = [c for c in CASES if c.item_size % 8 == 0 and c.n > 0]


@pytest.mark.parametrize("mla", [False, True], ids=["mha", "mla"])
@pytest.mark.parametrize("case", SGL_CASES, ids=[c.id for c in SGL_CASES])
@pytest.mark.parametrize("op", list(OPS))
def test_matches_sgl_kernel(sgl, op: str, case, mla: bool) -> None:
    spec = OPS[op]
    name = spec.mla if mla else spec.mha
    seed = 5 + list(OPS).index(op)
    ours = make_world(case, mla, seed, pin_host=True)
    s, d = indices(case, ours, spec.src, spec.dst, seed)
    theirs = ours.clone()
    # sgl_kernel reads tables as uint64 (data_ptr<uintptr_t>): unsigned tables on both sides.
    spec.call(getattr(kernels, name), ours, s, d, seed % 3, False)
    spec.call(getattr(sgl, name), theirs, s, d, seed % 3, False)
    torch.cuda.synchronize()
    for buf in World.BUFFERS:
        assert same_bytes(getattr(ours, buf), getattr(theirs, buf)), f"{buf} differs"
