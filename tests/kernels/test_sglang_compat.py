"""kernels.sglang.compat against a small fake SGLang tree (no SGLang, no network).

The fake tree mirrors what the compat module reads of a real release: distribution metadata
(the version), ``sglang.srt.mem_cache.pool_host.mha`` / ``.mla`` importing kvcacheio ops under a
platform branch, and a JIT predicate import. ``make sglang-check`` runs the real releases.
"""

from __future__ import annotations

import importlib
import sys
import textwrap
import types
from pathlib import Path

import pytest
import torch

from hicache_prefill import kernels
from hicache_prefill.kernels.sglang import compat
from hicache_prefill.kernels.sglang.rebind import KVCACHEIO_SOURCES, imported_names

MHA_SRC = """
IS_CUDA = {cuda}
if IS_CUDA:
    from sgl_kernel.kvcacheio import (
        transfer_kv_all_layer,
        transfer_kv_per_layer,
    )
from sglang.kernels.ops.kvcache.hicache import can_use_hicache_jit_kernel

def current():
    return transfer_kv_per_layer
"""
MLA_SRC = """
from sgl_kernel_absent_guard import nothing  # noqa
"""


def _write(root: Path, rel: str, text: str) -> None:
    path = root / rel
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(textwrap.dedent(text))


def _fake_sglang(root: Path, *, cuda: bool = False, mla: str | None = None, version="9.9.9"):
    _write(root, f"sglang-{version}.dist-info/METADATA",
           f"Metadata-Version: 2.1\nName: sglang\nVersion: {version}\n")  # fmt: skip
    for pkg in ("sglang", "sglang/srt", "sglang/srt/mem_cache", "sglang/srt/mem_cache/pool_host",
                "sglang/kernels", "sglang/kernels/ops", "sglang/kernels/ops/kvcache"):  # fmt: skip
        _write(root, f"{pkg}/__init__.py", "")
    _write(root, "sglang/kernels/ops/kvcache/hicache.py",
           "def can_use_hicache_jit_kernel(**kw):\n    return True\n")  # fmt: skip
    _write(root, "sglang/srt/mem_cache/pool_host/mha.py", MHA_SRC.format(cuda=cuda))
    _write(
        root,
        "sglang/srt/mem_cache/pool_host/mla.py",
        mla or "if False:\n    from sgl_kernel.kvcacheio import transfer_kv_per_layer_mla\n",
    )


@pytest.fixture
def sandbox(tmp_path, monkeypatch):
    """sys.path / sys.modules restored after each test; any install undone."""
    before = set(sys.modules)
    monkeypatch.syspath_prepend(str(tmp_path))
    importlib.invalidate_caches()
    yield tmp_path
    if compat.active() is not None:
        compat.active().uninstall()
    for name in set(sys.modules) - before:
        if name.split(".")[0] in ("sglang", "sgl_kernel"):
            del sys.modules[name]
    importlib.invalidate_caches()


def test_registers_kvcacheio_and_binds_names_the_modules_never_imported(sandbox):
    _fake_sglang(sandbox)
    handle = compat.install()
    mha = sys.modules["sglang.srt.mem_cache.pool_host.mha"]
    assert handle.sglang_version == "9.9.9"
    assert handle.layout == "pool_host"
    assert handle.registered_sgl_kernel
    assert mha.current() is kernels.transfer_kv_per_layer
    assert mha.transfer_kv_all_layer is kernels.transfer_kv_all_layer
    from sgl_kernel.kvcacheio import transfer_kv_per_layer_pf_lf

    assert transfer_kv_per_layer_pf_lf is kernels.transfer_kv_per_layer_pf_lf
    assert handle.patched_modules["sglang.srt.mem_cache.pool_host.mha"] == (
        "transfer_kv_all_layer",
        "transfer_kv_per_layer",
    )
    # JIT predicates untouched without route_around_jit
    assert mha.can_use_hicache_jit_kernel() is True


def test_cuda_branch_imports_from_the_registered_module(sandbox):
    _fake_sglang(sandbox, cuda=True)
    handle = compat.install()
    mha = sys.modules["sglang.srt.mem_cache.pool_host.mha"]
    assert mha.IS_CUDA and mha.current() is kernels.transfer_kv_per_layer
    handle.uninstall()
    assert "sgl_kernel" not in sys.modules and "sgl_kernel.kvcacheio" not in sys.modules
    # what the module imported itself stays: the uninstall restores, it does not delete that
    assert mha.transfer_kv_per_layer is kernels.transfer_kv_per_layer


def test_idempotent_and_exact_uninstall(sandbox):
    _fake_sglang(sandbox)
    mha = importlib.import_module("sglang.srt.mem_cache.pool_host.mha")
    sentinel = object()
    mha.transfer_kv_all_layer = sentinel  # a binding that existed before install
    original_pred = mha.can_use_hicache_jit_kernel
    handle = compat.install(route_around_jit=True)
    assert compat.install(route_around_jit=True) is handle
    with pytest.raises(ValueError, match="already installed"):
        compat.install(route_around_jit=False)
    assert mha.can_use_hicache_jit_kernel(page_size=1, element_size=128) is False
    handle.uninstall()
    assert mha.transfer_kv_all_layer is sentinel
    assert not hasattr(mha, "transfer_kv_per_layer")
    assert mha.can_use_hicache_jit_kernel is original_pred
    assert "sgl_kernel" not in sys.modules
    assert compat.active() is None
    handle.uninstall()  # second call: nothing
    again = compat.install()
    assert again is not handle and mha.current() is kernels.transfer_kv_per_layer


def test_rebinds_an_installed_sgl_kernel_and_restores_it(sandbox):
    _fake_sglang(sandbox, cuda=True)
    _write(sandbox, "sgl_kernel/__init__.py", "")
    _write(sandbox, "sgl_kernel/kvcacheio.py",
           "def transfer_kv_per_layer(*a, **k):\n    return 'upstream'\n"
           "def transfer_kv_all_layer(*a, **k):\n    return 'upstream'\n")  # fmt: skip
    mha = importlib.import_module("sglang.srt.mem_cache.pool_host.mha")
    upstream = mha.transfer_kv_per_layer
    assert upstream() == "upstream"
    handle = compat.install()
    io = sys.modules["sgl_kernel.kvcacheio"]
    assert not handle.registered_sgl_kernel
    assert mha.current() is kernels.transfer_kv_per_layer
    assert io.transfer_kv_per_layer is kernels.transfer_kv_per_layer
    assert io.transfer_kv_direct is kernels.transfer_kv_direct  # added where it was missing
    handle.uninstall()
    assert mha.current() is upstream and io.transfer_kv_per_layer is upstream
    assert not hasattr(io, "transfer_kv_direct")
    assert "sgl_kernel.kvcacheio" in sys.modules  # sgl-kernel's own module is kept


def test_host_pool_jit_flags_cleared_and_restored(sandbox):
    _fake_sglang(sandbox)
    pool = types.SimpleNamespace(can_use_jit=True, can_use_write_back_jit=True)
    handle = compat.install(route_around_jit=True, host_pools=[pool])
    assert pool.can_use_jit is False and pool.can_use_write_back_jit is False
    handle.uninstall()
    assert pool.can_use_jit is True and pool.can_use_write_back_jit is True


def test_unknown_layout_names_the_version_and_patches_nothing(sandbox):
    _write(sandbox, "sglang-0.0.1.dist-info/METADATA",
           "Metadata-Version: 2.1\nName: sglang\nVersion: 0.0.1\n")  # fmt: skip
    _write(sandbox, "sglang/__init__.py", "")
    with pytest.raises(ValueError, match=r"SGLang 0\.0\.1: no known host-pool module layout"):
        compat.install()
    assert "sgl_kernel" not in sys.modules and compat.active() is None


def test_module_importing_an_op_we_lack_is_refused_before_any_patch(sandbox):
    _fake_sglang(
        sandbox, mla="if False:\n    from sgl_kernel.kvcacheio import transfer_kv_teleport\n"
    )
    with pytest.raises(ValueError, match=r"SGLang 9\.9\.9 .*transfer_kv_teleport"):
        compat.install()
    assert "sgl_kernel" not in sys.modules
    assert "sglang.srt.mem_cache.pool_host.mha" not in sys.modules  # not even imported
    assert compat.active() is None


def test_module_without_kvcacheio_imports_is_not_recognised(sandbox):
    _fake_sglang(sandbox, mla="X = 1\n")
    with pytest.raises(ValueError, match=r"SGLang 9\.9\.9 .*imports no kvcacheio op"):
        compat.install()
    assert "sgl_kernel" not in sys.modules


def test_other_modules_with_unknown_ops_are_skipped(sandbox):
    _fake_sglang(sandbox)
    _write(sandbox, "sglang/srt/mem_cache/embedding.py",
           "try:\n    from sgl_kernel.kvcacheio import transfer_embedding_ranges\n"
           "except ImportError:\n    transfer_embedding_ranges = None\n")  # fmt: skip
    _write(sandbox, "sglang/srt/mem_cache/dsa.py",
           "if False:\n    from sgl_kernel.kvcacheio import transfer_kv_direct\n")  # fmt: skip
    importlib.import_module("sglang.srt.mem_cache.embedding")
    dsa = importlib.import_module("sglang.srt.mem_cache.dsa")
    handle = compat.install()
    assert handle.skipped == {"sglang.srt.mem_cache.embedding": ("transfer_embedding_ranges",)}
    assert dsa.transfer_kv_direct is kernels.transfer_kv_direct
    assert sys.modules["sglang.srt.mem_cache.embedding"].transfer_embedding_ranges is None


def test_imported_names_reads_nested_imports_and_filters_helpers():
    src = textwrap.dedent(
        """
        if A:
            from sgl_kernel.kvcacheio import transfer_kv_per_layer, other
        elif B:
            from sglang.srt.mem_cache.pool_host._kvcacheio import (
                require_kvcacheio_ops, transfer_kv_direct)
        def f():
            from sgl_kernel.kvcacheio import get_device_accessible_ptr
        """
    )
    assert imported_names(src, KVCACHEIO_SOURCES) == {
        "transfer_kv_per_layer", "other", "transfer_kv_direct", "get_device_accessible_ptr",
    }  # fmt: skip
    assert imported_names(src, KVCACHEIO_SOURCES, module_level=True) == {
        "transfer_kv_per_layer", "other", "transfer_kv_direct",
    }  # fmt: skip


def test_function_level_imports_resolve_at_call_and_are_not_bound(sandbox):
    """A name imported inside a function binds a local when the function runs: it is served by
    the registered ``sgl_kernel.kvcacheio``, and a module global for it would be dead (and
    would not exist before install, so the round trip could not restore it exactly)."""
    _fake_sglang(sandbox)
    _write(sandbox, "sglang/srt/mem_cache/pool_host/common.py",
           "def resolve():\n"
           "    from sgl_kernel.kvcacheio import get_device_accessible_ptr\n"
           "    return get_device_accessible_ptr\n")  # fmt: skip
    common = importlib.import_module("sglang.srt.mem_cache.pool_host.common")
    handle = compat.install()
    assert "sglang.srt.mem_cache.pool_host.common" not in handle.patched_modules
    assert handle.resolved_at_call == {
        "sglang.srt.mem_cache.pool_host.common": ("get_device_accessible_ptr",)
    }
    assert "get_device_accessible_ptr" not in vars(common)
    assert common.resolve() is kernels.get_device_accessible_ptr
    handle.uninstall()
    assert "get_device_accessible_ptr" not in vars(common)
    with pytest.raises(ImportError):
        common.resolve()


class _RecordingHostPool:
    """Stands for an SGLang host pool: records the calls the warm-up makes."""

    def __init__(self, layout: str, page_size: int, jit: bool = False) -> None:
        self.layout, self.page_size = layout, page_size
        self.can_use_jit, self.can_use_write_back_jit = jit, False
        self.calls: list[tuple] = []

    def load_to_device_per_layer(self, dev, host_idx, dev_idx, layer, io):
        self.calls.append(("load", layer, io, host_idx.clone(), dev_idx.clone()))

    def backup_from_device_all_layer(self, dev, host_idx, dev_idx, io):
        self.calls.append(("backup", None, io, host_idx.clone(), dev_idx.clone()))


def test_warm_up_drives_every_layer_once_with_negative_indices():
    dev = types.SimpleNamespace(layer_num=3, device=torch.device("cpu"))
    host = _RecordingHostPool("page_first", page_size=4)
    report = compat.warm_up(host, dev)
    assert [c[:3] for c in host.calls] == [
        ("load", 0, "kernel"), ("load", 1, "kernel"), ("load", 2, "kernel"),
        ("backup", None, "kernel"),
    ]  # fmt: skip
    assert all((c[i] == -1).all() and c[i].numel() == 4 for c in host.calls for i in (3, 4))
    assert len(report.calls) == 2 and not report.skipped


def test_warm_up_verifies_the_pointer_tables_sglang_built_before_any_launch():
    """SGLang builds its tables with ``torch.tensor([... data_ptr() ...])``: unverified, the
    kernels would copy them with 8-byte words on CUDA. The warm-up verifies each once, before
    the launches (so they compile the 16-byte variant the real copies use); tables verified
    already (this project's) and other attributes are left alone."""
    layers = [torch.zeros(4, 8) for _ in range(2)]
    sglang_table = torch.tensor([t.data_ptr() for t in layers], dtype=torch.uint64)
    ours = kernels.data_ptr_table(layers, "cpu")
    dev = types.SimpleNamespace(layer_num=2, device=torch.device("cpu"), k_data_ptrs=ours,
                                data_ptrs=sglang_table)  # fmt: skip
    host = _RecordingHostPool("layer_first", page_size=1)
    host.v_data_ptrs = torch.tensor([t.data_ptr() for t in layers], dtype=torch.int64)
    host.indices = torch.zeros(3, dtype=torch.int64)  # not a table: name does not say so
    host.data_ptrs = sglang_table  # the same table twice: verified once
    seen_at_launch = []
    load = host.load_to_device_per_layer
    host.load_to_device_per_layer = lambda *a: (
        seen_at_launch.append(kernels.verified_alignment(sglang_table)), load(*a))  # fmt: skip
    assert kernels.verified_alignment(sglang_table) == 0
    report = compat.warm_up(host, dev)
    assert sorted(report.verified_tables) == [
        ("_RecordingHostPool", "data_ptrs", 16), ("_RecordingHostPool", "v_data_ptrs", 16),
    ]  # fmt: skip
    assert seen_at_launch == [16, 16]
    assert kernels.verified_alignment(host.v_data_ptrs) == 16
    assert not hasattr(host.indices, "_kvcacheio_verified_align")


@pytest.mark.parametrize(("layout", "jit"), [("page_first_direct", False), ("layer_first", True)])
def test_warm_up_skips_what_launches_no_kernel_of_ours(layout, jit):
    host = _RecordingHostPool(layout, page_size=1, jit=jit)
    report = compat.warm_up(host, types.SimpleNamespace(layer_num=2, device="cpu"))
    assert host.calls == [] and len(report.skipped) == 1


def test_warm_up_through_the_real_ops_writes_nothing():
    """The kernels skip negative indices: a warm-up launch changes no byte."""
    src = torch.arange(2 * 8 * 4, dtype=torch.float32).reshape(2, 8, 4)
    dst = torch.zeros(2, 8, 4)

    class Pool:
        layout, page_size, can_use_jit = "layer_first", 1, False

        def load_to_device_per_layer(self, dev, h, d, layer, io):
            kernels.transfer_kv_per_layer(src[layer], dst[layer], src[layer], dst[layer], h, d,
                                          item_size=16)  # fmt: skip

        def backup_from_device_all_layer(self, dev, h, d, io):
            kernels.transfer_kv_per_layer(dst[0], src[0], dst[0], src[0], d, h, item_size=16)

    before = src.clone()
    compat.warm_up(Pool(), types.SimpleNamespace(layer_num=2, device="cpu"))
    assert torch.equal(dst, torch.zeros_like(dst)) and torch.equal(src, before)
