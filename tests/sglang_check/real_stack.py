"""SGLang's real KV stack on a CPU, with this project's ops underneath, byte for byte.

``python -m tests.sglang_check.run_pin --site DIR --mode real-stack --out FILE.json``

Unlike the ``cpu`` / ``cuda-shaped`` runs, nothing of SGLang is stubbed whole: SGLang imports
with its pure-Python dependencies installed (the Makefile's sglang-check venv) and the
``sglang`` package ``__init__``, ``sglang.srt.utils`` and SGLang's device pools
(``sglang.srt.mem_cache.memory_pool``) are its own files. Only what needs a CUDA-only wheel or a
GPU is replaced (:data:`STUBS`, :data:`PATCHES`, each with its reason, reported in the table's
stub list).

Per case (MHA / MLA x page size x layout x io backend), after
``install(route_around_jit=True)``:

- SGLang's own ``MHATokenToKVPool`` / ``MLATokenToKVPool`` on the CPU;
- SGLang's assembler (``hybrid_pool_assembler.build_kv_only_group``, which calls
  ``build_kv_host_pool``) builds the host pool and the ``HostPoolGroup`` from the server
  arguments (``hicache_mem_layout``, ``hicache_ratio``) as ``UnifiedRadixCache.init_hicache``
  does;
- ``compat.warm_up`` on the pair (kernel io backend), then SGLang's ``L2TransferEngine`` moves
  shuffled whole pages device -> host (``submit_device_to_host``) and host -> device
  (``submit_host_to_device``, layer by layer through the group's layer mapper);
- after each direction the whole destination equals a plain torch copy of the same slots and the
  source is unchanged; every copy kernel launch is counted (kernel io backend: at least one, all
  warmed; direct: none).

Then one row per (MHA / MLA x layout x io backend) of SGLang's ``UnifiedRadixCache`` with HiCache,
built through SGLang's shipped kit (``sglang/test/kits/unified_radix_cache``, page size 4): backup,
device eviction and load back, byte-exact at the host pool and back on the device, through
exactly the project ops SGLang's host pool picks (:func:`run_unified_tree`; what the kit is
given per row: :data:`TREE_PATCHES`).
"""

from __future__ import annotations

import argparse
import contextlib
import importlib
import json
import logging
import os
import sys
import time
import traceback
import types
import unittest
from typing import Any

logger = logging.getLogger(__name__)

TORCHVISION_REASON = (
    "PyPI's torchvision wheel links libtorch_cuda / libcudart (the CPU build is only on the "
    "PyTorch index); SGLang's VLM configs (configs.deepseek_ocr, multimodal.internvl_utils) "
    "import transform names at module level and never call them here. transformers' "
    "is_torchvision_available() is asked first (answer cached: not installed), so transformers "
    "never reaches the stub"
)
STUB_NAMES = ("torchvision", "torchvision.transforms", "torchvision.transforms.functional")

PATCHES: dict[str, str] = {
    "sglang.srt.mem_cache.pool_host.common._cuda_host_register": "cudaHostRegister (page-locks "
    "the host pool for CUDA copies) needs a CUDA device; replaced by a function that records the "
    "byte count and registers nothing. The host pool's bytes and layout are SGLang's",
    "sglang.test.kits.unified_radix_cache.fixtures.get_device": "SGLang's get_device raises on "
    "a host with no accelerator; the kit's fixture builds its pools on 'cpu' instead",
}

PAGE_SIZES = (1, 16)
LAYOUTS = {
    ("MHA", "kernel"): ("layer_first", "page_first", "page_head"),
    ("MHA", "direct"): ("layer_first", "page_first_direct"),
    ("MLA", "kernel"): ("layer_first", "page_first"),
    ("MLA", "direct"): ("layer_first", "page_first_direct"),
}
LAYERS, HEADS, HEAD_DIM = 3, 2, 8
KV_LORA_RANK, QK_ROPE_HEAD_DIM = 16, 8
DEVICE_TOKENS = 64
HOST_RATIO = 2.0

REGISTERED: list[int] = []
OP_CALLS: list[str] = []


def _count_op_calls(handle: Any) -> list[tuple[Any, str, Any]]:
    """Wrap each of this project's ops where ``install`` bound it in SGLang's host-pool modules,
    recording each call by name; returns what to restore."""
    from hicache_prefill.kernels.sglang import compat

    ops = compat.provided_ops()
    restore = []
    for module_name, names in handle.patched_modules.items():
        module = sys.modules[module_name]
        for name in names:
            op = module.__dict__.get(name)
            if op is None or op is not ops.get(name):
                raise AssertionError(f"{module_name}.{name} is not this project's op after install")

            def counted(*args: Any, _op: Any = op, _name: str = name, **kwargs: Any) -> Any:
                OP_CALLS.append(_name)
                return _op(*args, **kwargs)

            restore.append((module, name, op))
            module.__dict__[name] = counted
    return restore


def _setup(site: str) -> Any:
    """SGLang's site first on the path, the CUDA-only pieces replaced; returns the finder."""
    sys.path.insert(0, site)
    from hicache_prefill.kernels._env import ensure_triton_interpret

    ensure_triton_interpret()
    from transformers.utils import import_utils

    import_utils.is_torchvision_available()  # cached before the stub exists
    from tests.sglang_check.stubs import Stub, install_importer

    return install_importer({n: Stub(TORCHVISION_REASON) for n in STUB_NAMES}, {})


def _patch() -> None:
    common = importlib.import_module("sglang.srt.mem_cache.pool_host.common")

    def no_cuda_host_register(buffer: Any, registration_granularity_bytes: Any = None) -> None:
        REGISTERED.append(buffer.numel() * buffer.element_size())
        setattr(buffer, common._CUDA_HOST_REGISTERED_RANGES_ATTR, [])

    common._cuda_host_register = no_cuda_host_register


def cases() -> list[tuple[str, int, str, str]]:
    return [
        (kind, page, layout, io)
        for kind in ("MHA", "MLA")
        for page in PAGE_SIZES
        for io in ("kernel", "direct")
        for layout in LAYOUTS[(kind, io)]
    ]


def _device_pool(kind: str, page_size: int) -> Any:
    import torch
    from sglang.srt.mem_cache.memory_pool import MHATokenToKVPool, MLATokenToKVPool

    common = dict(size=DEVICE_TOKENS, page_size=page_size, dtype=torch.bfloat16,
                  layer_num=LAYERS, device="cpu", enable_memory_saver=False)  # fmt: skip
    if kind == "MLA":
        return MLATokenToKVPool(
            kv_lora_rank=KV_LORA_RANK, qk_rope_head_dim=QK_ROPE_HEAD_DIM, **common
        )
    return MHATokenToKVPool(head_num=HEADS, head_dim=HEAD_DIM, **common)


def run_case(case: tuple[str, int, str, str], handle: Any, seed: int) -> dict[str, Any]:
    import torch
    from sglang.srt.mem_cache.hicache_storage import PoolName
    from sglang.srt.mem_cache.hybrid_cache.hybrid_pool_assembler import build_kv_only_group
    from sglang.srt.mem_cache.l2_transfer import L2Transfer, L2TransferEngine
    from sglang.srt.server_args import ServerArgs, set_global_server_args_for_scheduler

    from tests.sglang_check import transfers as t

    kind, page, layout, io = case
    name = f"real/{kind}/p{page}/{layout}/{io}"
    out: dict[str, Any] = {"case": name, "ok": False, "error": None, "launches": 0,
                           "variants": 0, "unwarmed_launches": 0, "calls": [],
                           "project_op_calls": 0}  # fmt: skip
    gen = torch.Generator().manual_seed(seed)
    recorder = t.LaunchRecorder()
    try:
        set_global_server_args_for_scheduler(
            ServerArgs(model_path="dummy", page_size=page, hicache_io_backend=io,
                       hicache_mem_layout=layout, hicache_ratio=HOST_RATIO)
        )  # fmt: skip
        dev = _device_pool(kind, page)
        group = build_kv_only_group(
            page_size=page, kv_pool=dev, full_layer_mapping={i: i for i in range(LAYERS)},
            use_mla=kind == "MLA",
        )  # fmt: skip
        entry = group.get_entry(PoolName.KV)
        host = entry.host_pool
        out["classes"] = [type(dev).__name__, type(group).__name__, type(host).__name__]
        if host.layout != layout:
            raise AssertionError(f"SGLang's assembler built a {host.layout} host pool")
        if io == "kernel":
            handle.warm_up(host, dev)
        warmed = set(recorder.keys)
        recorder.keys.clear()
        OP_CALLS.clear()
        engine = L2TransferEngine(io)
        n_pages = 24 if page == 1 else 2
        host_idx = t._page_indices(host.alloc(n_pages * page), page, gen)
        dev_idx = t._device_indices(dev, n_pages, page, gen)
        transfer = L2Transfer(host, dev, host_idx, dev_idx, entry.layer_mapper)

        t._randomize(t._device_buffers(kind, dev), gen)
        t._randomize(t._host_buffers(host), gen)
        dev_before, host_before = t.device_rows(kind, dev), t.host_rows(kind, host)
        expected = [h.clone() for h in host_before]
        for e, d in zip(expected, dev_before, strict=True):
            e[:, host_idx] = d[:, dev_idx]
        engine.submit_device_to_host([transfer]).finish_event.synchronize()
        out["calls"].append("L2TransferEngine.submit_device_to_host")
        if not t._bytes_equal(t.host_rows(kind, host), expected):
            raise AssertionError("device->host: host bytes differ from a plain torch copy")
        if not t._bytes_equal(t.device_rows(kind, dev), dev_before):
            raise AssertionError("device->host: the device pool changed")

        t._randomize(t._device_buffers(kind, dev), gen)
        host_before = t.host_rows(kind, host)
        expected = t.device_rows(kind, dev)
        for e, h in zip(expected, host_before, strict=True):
            e[:, dev_idx] = h[:, host_idx]
        engine.submit_host_to_device(
            [transfer], transfer_layer_id_max=LAYERS
        ).finish_event.synchronize()
        out["calls"].append(f"L2TransferEngine.submit_host_to_device ({LAYERS} layers)")
        if not t._bytes_equal(t.device_rows(kind, dev), expected):
            raise AssertionError("host->device: device bytes differ from a plain torch copy")
        if not t._bytes_equal(t.host_rows(kind, host), host_before):
            raise AssertionError("host->device: the host pool changed")
        host.free(host_idx)

        out["project_op_calls"] = len(OP_CALLS)
        out["calls"] += sorted(set(OP_CALLS))
        if len(OP_CALLS) != 1 + LAYERS:  # one all-layer backup, one load per layer
            raise AssertionError(f"{len(OP_CALLS)} calls of this project's ops, not {1 + LAYERS}")
        out["launches"] = len(recorder.keys)
        out["variants"] = len(set(recorder.keys))
        out["unwarmed_launches"] = sum(1 for k in recorder.keys if k not in warmed)
        if io == "kernel" and not recorder.keys:
            raise AssertionError("no copy kernel launch on the kernel io backend")
        if io == "direct" and recorder.keys:
            raise AssertionError("the direct io backend launched the copy kernel")
        if out["unwarmed_launches"]:
            raise AssertionError(f"{out['unwarmed_launches']} launches the warm-up did not make")
        out["ok"] = True
    except Exception as e:  # reported per case; the check fails on any
        out["error"] = f"{type(e).__name__}: {e}"
        out["traceback"] = traceback.format_exc()
    finally:
        recorder.close()
    return out


TREE_PAGE = 4
TREE_OPS: dict[tuple[str, str, str], set[str]] = {
    ("MHA", "layer_first", "kernel"): {"transfer_kv_all_layer", "transfer_kv_per_layer"},
    ("MHA", "page_first", "kernel"): {"transfer_kv_all_layer_lf_pf", "transfer_kv_per_layer_pf_lf"},
    ("MHA", "page_head", "kernel"): {"transfer_kv_all_layer_lf_ph", "transfer_kv_per_layer_ph_lf"},
    ("MLA", "layer_first", "kernel"): {"transfer_kv_all_layer_mla", "transfer_kv_per_layer_mla"},
    ("MLA", "page_first", "kernel"): {"transfer_kv_all_layer_mla_lf_pf",
                                      "transfer_kv_per_layer_mla_pf_lf"},
    ("MHA", "layer_first", "direct"): {"transfer_kv_direct"},
    ("MLA", "layer_first", "direct"): {"transfer_kv_direct"},
    ("MHA", "page_first_direct", "direct"): {"transfer_kv_all_layer_direct_lf_pf",
                                             "transfer_kv_per_layer_direct_pf_lf"},
    ("MLA", "page_first_direct", "direct"): {"transfer_kv_all_layer_direct_lf_pf",
                                             "transfer_kv_per_layer_direct_pf_lf"},
}  # fmt: skip
"""This project's ops each tree row must call (and no others): one all-layer backup, then one
load per layer, as SGLang's host pool picks them for the (pool, layout, io backend)."""

TREE_PATCHES: dict[str, str] = {
    "sglang.test.kits.unified_radix_cache.mixins.ServerArgs (tree rows)": "the kit's "
    "_init_hicache builds ServerArgs with hicache_io_backend='kernel' and the default layout "
    "(page_first); each tree row wraps the name for the duration of that call so the same "
    "ServerArgs also carries the row's hicache_io_backend / hicache_mem_layout. Every other "
    "argument and step is the kit's",
    "sglang.test.kits.unified_radix_cache.fixtures.MHATokenToKVPool (MLA tree rows)": "the "
    "kit's build_fixture constructs only MHATokenToKVPool (FULL), SWAKVPool (SWA) or "
    "HybridLinearKVPool (Mamba), and CacheConfig has no MLA field; the MLA rows substitute "
    "SGLang's own MLATokenToKVPool (kv_lora_rank 16, qk_rope_head_dim 8) for that name while "
    "build_fixture runs. init_hicache then takes SGLang's _PlainKvStrategy MLA branch "
    "(use_mla from isinstance MLATokenToKVPool) as it does in a server",
    "sglang.srt.mem_cache.hybrid_cache.hybrid_pool_assembler.get_mha_host_pool_cls (L3 row)": "as "
    "the kit's own UnifiedRadixPrefetchCorruptionFixtures does, the host pool class gets "
    "pin_memory=False: SGLang's prefetch allocates its dummy page with "
    "torch.zeros(..., pin_memory=True), which raises without an accelerator",
    "sglang.test.kits.unified_radix_cache.mixins.ServerArgs (L3 dynamic row)": "the kit's "
    "_init_hicache builds the extra config, the single-rank topology and the storage directory "
    "only for hicache_storage_backend='file'; the dynamic row asks for 'file' with the extra "
    "keys backend_name / module_path / class_name naming this project's HiCacheFile, and the "
    "wrapped name hands SGLang 'dynamic' instead, so its StorageBackendFactory imports the class",
}


def _run_kit_case(case: type, out: dict[str, Any], recorder: Any) -> None:
    """Run one kit ``unittest`` case (its first error or failure raised) and record the project's
    op calls and kernel launches it made into ``out``."""
    result = unittest.TestResult()
    case().run(result)
    for _, tb in result.errors + result.failures:
        raise AssertionError(tb.strip().splitlines()[-1] + "\n" + tb)
    out["project_op_calls"] = len(OP_CALLS)
    out["calls"] += sorted(set(OP_CALLS))
    out["launches"] = len(recorder.keys)
    out["variants"] = len(set(recorder.keys))


def tree_cases() -> list[tuple[str, str, str]]:
    return [
        (kind, layout, io)
        for kind in ("MHA", "MLA")
        for io in ("kernel", "direct")
        for layout in LAYOUTS[(kind, io)]
    ]


def run_unified_tree(case: tuple[str, str, str], seed: int) -> dict[str, Any]:
    """SGLang's ``UnifiedRadixCache`` with HiCache, built by SGLang's shipped kit
    (``sglang/test/kits/unified_radix_cache``: ``build_fixture`` + the mixin's ``_init_hicache``)
    with the row's layout and io backend (:data:`TREE_PATCHES`): insert a 3-page sequence, fill
    its KV (every layer) with random bytes, back it up (``HybridCacheController`` ->
    ``L2TransferEngine`` -> host pool; the host pool's rows at the node's host slots must equal
    the device bytes), evict it from the device, scramble the device pool, load it back; every
    layer's K and V (MLA: latent) must come back byte for byte, through exactly the ops of
    :data:`TREE_OPS` (1 + layers calls), with copy kernel launches on ``kernel`` and none on
    ``direct``."""
    from unittest import mock

    import torch

    fixtures = importlib.import_module("sglang.test.kits.unified_radix_cache.fixtures")
    mixins = importlib.import_module("sglang.test.kits.unified_radix_cache.mixins")
    fixtures.get_device = lambda *a, **k: "cpu"
    from sglang.srt.mem_cache.base_prefix_cache import EvictParams
    from sglang.srt.mem_cache.hicache_storage import PoolName
    from sglang.srt.mem_cache.memory_pool import MLATokenToKVPool
    from sglang.srt.mem_cache.unified_cache.components.base import ComponentType
    from sglang.srt.server_args import ServerArgs
    from sglang.test.kits.unified_radix_cache.config import CacheConfig
    from sglang.test.kits.unified_radix_cache.mixins import UnifiedRadixCacheFixtures

    from tests.sglang_check import transfers as t

    kind, layout, io = case
    name = f"real/UnifiedRadixCache+HiCache/{kind}/p{TREE_PAGE}/{layout}/{io}"
    out: dict[str, Any] = {"case": name,
                           "ok": False, "error": None, "launches": 0, "variants": 0,
                           "unwarmed_launches": 0, "calls": [], "project_op_calls": 0}  # fmt: skip
    gen = torch.Generator().manual_seed(seed)
    recorder = t.LaunchRecorder()

    def row_server_args(**kwargs: Any) -> Any:
        return ServerArgs(**{**kwargs, "hicache_io_backend": io, "hicache_mem_layout": layout})

    def mla_pool(*, head_num: int, head_dim: int, **kwargs: Any) -> Any:
        return MLATokenToKVPool(
            kv_lora_rank=KV_LORA_RANK, qk_rope_head_dim=QK_ROPE_HEAD_DIM, **kwargs
        )

    def rows(dev: Any, slots: Any) -> list[Any]:
        return [r[:, slots] for r in t.device_rows(kind, dev)]

    class Case(UnifiedRadixCacheFixtures, unittest.TestCase):
        cfg = CacheConfig(page_size=TREE_PAGE, num_layers=LAYERS)

        def runTest(self) -> None:
            swap = mock.patch.object(fixtures, "MHATokenToKVPool", mla_pool)
            with swap if kind == "MLA" else contextlib.nullcontext():
                cache, alloc, req_to_token = fixtures.build_fixture(self.cfg)
            with mock.patch.object(mixins, "ServerArgs", row_server_args):
                self._init_hicache(cache)
            cc = cache.cache_controller
            host = cc.mem_pool_host.get_entry(PoolName.KV).host_pool
            dev = self._get_full_kv_pool(alloc)
            out["classes"] = [type(cache).__name__, type(cc).__name__, type(dev).__name__,
                              type(host).__name__]  # fmt: skip
            if (host.layout, cc.io_backend) != (layout, io):
                raise AssertionError(f"the kit built {host.layout}/{cc.io_backend}")
            if isinstance(dev, MLATokenToKVPool) != (kind == "MLA"):
                raise AssertionError(f"the kit built a {type(dev).__name__}")
            seq = self._make_seq(100, 3)
            self._insert(cache, alloc, req_to_token, seq)
            node = fixtures.match_prefix(cache, seq).last_device_node
            slots = fixtures.node_device_value(cache, node, ComponentType.FULL)
            t._randomize(t._device_buffers(kind, dev), gen)
            before = rows(dev, slots)
            OP_CALLS.clear()
            self._backup_node(cache, node)
            host_slots = fixtures.node_host_value(cache, node, ComponentType.FULL)
            backed = [r[:, host_slots] for r in t.host_rows(kind, host)]
            if not t._bytes_equal(backed, before):
                raise AssertionError("backup: host rows differ from the device bytes")
            out["calls"].append("backup (HybridCacheController -> L2TransferEngine), host rows")
            cache.evict(EvictParams(num_tokens=len(seq)))
            self.assertIsNone(fixtures.node_device_value(cache, node, ComponentType.FULL))
            out["calls"].append("evict (device copy dropped)")
            t._randomize(t._device_buffers(kind, dev), gen)
            slots = self._load_back_node(cache, node)
            out["calls"].append("load_back")
            if not t._bytes_equal(rows(dev, slots), before):
                raise AssertionError("loaded-back K/V differ from the bytes backed up")

    try:
        _run_kit_case(Case, out, recorder)
        if set(OP_CALLS) != TREE_OPS[case]:
            raise AssertionError(f"ops {sorted(set(OP_CALLS))}, not {sorted(TREE_OPS[case])}")
        if len(OP_CALLS) != 1 + LAYERS:  # one all-layer backup, one load per layer
            raise AssertionError(f"{len(OP_CALLS)} calls of this project's ops, not {1 + LAYERS}")
        if io == "kernel" and not recorder.keys:
            raise AssertionError("no copy kernel launch on the kernel io backend")
        if io == "direct" and recorder.keys:
            raise AssertionError("the direct io backend launched the copy kernel")
        out["ok"] = True
    except Exception as e:  # reported; the check fails on it
        out["error"] = f"{type(e).__name__}: {e}"[:4000]
    finally:
        recorder.close()
    return out


PROJECT_FILE = ("hicache_prefill.hicache.storage.file_backend", "HiCacheFile")
PROJECT_MOONCAKE = ("hicache_prefill.hicache.storage.mooncake.store", "MooncakeStore")
STORAGE_ROWS = ("file", "dynamic file", "dynamic mooncake")
MOONCAKE_ZERO_COPY = ("batch_set_v1", "batch_get_v1")
"""What the ``dynamic mooncake`` row's ``MooncakeStore`` may be called with for data: SGLang's
controller picks its zero-copy calls for ``mooncake`` and for ``dynamic`` with ``interface_v1``
(the row's extra config), never the generic ``batch_set`` / ``batch_get``."""
PROJECT_STORAGE_CALLS = ("batch_set_v2", "batch_get_v2", "batch_exists_v2", "batch_set_v1",
                         "batch_get_v1", "batch_set", "batch_get", "batch_exists", "set", "get",
                         "exists")  # fmt: skip
"""The project backend's calls each dynamic-backend row counts (for a KV-only pool group SGLang's
controller writes with ``batch_set`` and reads with ``batch_get``, one ``set`` / ``get`` a
page)."""


def _count_backend_calls(cls: type, calls: dict[str, int]) -> list[Any]:
    """Patchers wrapping :data:`PROJECT_STORAGE_CALLS` on ``cls`` to count each call by name."""
    from unittest import mock

    patchers = []
    for name in PROJECT_STORAGE_CALLS:
        method = getattr(cls, name, None)
        if method is None:
            continue

        def counted(self: Any, *args: Any, _m: Any = method, _n: str = name, **kw: Any) -> Any:
            calls[_n] = calls.get(_n, 0) + 1
            return _m(self, *args, **kw)

        patchers.append(mock.patch.object(cls, name, counted))
    return patchers


def _restore_module(name: str, module: Any) -> None:
    if module is None:
        sys.modules.pop(name, None)
    else:
        sys.modules[name] = module


def run_unified_storage(seed: int, backend: str = "file") -> dict[str, Any]:
    """SGLang's L3 path through its kit (``UnifiedRadixCacheStorageFixtures``): a producer
    ``UnifiedRadixCache`` with HiCache and ``hicache_storage_backend="file"`` (SGLang's
    ``HiCacheFile`` under a temporary directory, the kit's single-rank topology) inserts 3 pages of
    random KV, backs them up to the host pool and writes them to storage through SGLang's
    controller (its backup thread); a second cache on the same directory prefetches them from
    storage (its prefetch threads) into its host pool and loads them back onto its device: every
    layer's K and V byte for byte, the L2 hops through this project's ops.

    ``backend="dynamic file"``: the same, with ``hicache_storage_backend="dynamic"`` and the extra
    config naming this project's ``HiCacheFile`` (``module_path`` / ``class_name``; SGLang's
    ``StorageBackendFactory`` imports it): both caches' backends must be instances of that class,
    and the producer must store the 3 pages (``set``) and the consumer read them (``get``) through
    it (calls counted, :func:`_count_backend_calls`).

    ``backend="dynamic mooncake"``: the same through this project's ``MooncakeStore`` over the
    project's fake Mooncake (``tests/hicache/storage/mooncake/fake_mooncake.py`` as
    ``mooncake.store``, one cluster both caches' clients share) with ``interface_v1`` as SGLang
    runs Mooncake: the producer stores the 3 pages with ``batch_set_v1`` and the consumer reads
    them with ``batch_get_v1`` (no generic call), every object through the fake."""
    import os
    from unittest import mock

    import torch

    fixtures = importlib.import_module("sglang.test.kits.unified_radix_cache.fixtures")
    fixtures.get_device = lambda *a, **k: "cpu"
    from sglang.srt.mem_cache.base_prefix_cache import CacheRequestHandle
    from sglang.test.kits.unified_radix_cache.config import CacheConfig
    from sglang.test.kits.unified_radix_cache.storage import UnifiedRadixCacheStorageFixtures

    from tests.sglang_check import transfers as t

    out: dict[str, Any] = {"case": f"real/UnifiedRadixCache+HiCache+L3 {backend}/MHA/p{TREE_PAGE}",
                           "ok": False, "error": None, "launches": 0, "variants": 0,
                           "unwarmed_launches": 0, "calls": [], "project_op_calls": 0}  # fmt: skip
    gen = torch.Generator().manual_seed(seed)
    recorder = t.LaunchRecorder()

    def rows(dev: Any, slots: Any) -> list[Any]:
        return [r[:, slots] for r in t.device_rows("MHA", dev)]

    assembler = importlib.import_module("sglang.srt.mem_cache.hybrid_cache.hybrid_pool_assembler")
    mha_host_pool_cls = assembler.get_mha_host_pool_cls

    def unpinned_host_pool_cls(device_pool: Any) -> Any:
        # As the kit's UnifiedRadixPrefetchCorruptionFixtures does: pin_memory=False, else the
        # prefetch's dummy page (torch.zeros(..., pin_memory=True)) raises without CUDA.
        cls = mha_host_pool_cls(device_pool)
        return lambda *a, **k: cls(*a, **{**k, "pin_memory": False})

    mixins = importlib.import_module("sglang.test.kits.unified_radix_cache.mixins")
    project_cls: type | None = None
    storage_extra: dict[str, Any] | None = None
    calls: dict[str, int] = {}
    project = PROJECT_FILE
    cluster: Any = None
    if backend == "dynamic file":
        project_cls = getattr(importlib.import_module(PROJECT_FILE[0]), PROJECT_FILE[1])
        storage_extra = {"backend_name": "hicache_prefill_file", "module_path": PROJECT_FILE[0],
                         "class_name": PROJECT_FILE[1]}  # fmt: skip
    elif backend == "dynamic mooncake":
        from tests.hicache.storage.mooncake.fake_mooncake import FakeCluster
        from tests.sglang_check.storage import MASTER

        project = PROJECT_MOONCAKE
        project_cls = getattr(importlib.import_module(project[0]), project[1])
        cluster = FakeCluster()
        storage_extra = {"backend_name": "hicache_prefill_mooncake", "module_path": project[0],
                         "class_name": project[1], "interface_v1": 1, **MASTER}  # fmt: skip
    elif backend != "file":
        raise ValueError(f"unknown storage row {backend!r}")
    kit_server_args = mixins.ServerArgs

    def dynamic_server_args(**kwargs: Any) -> Any:
        # The kit's _init_hicache builds the extra config (and the single-rank topology, the
        # storage directory) only for "file": the row asks for "file" and SGLang gets "dynamic".
        if kwargs.get("hicache_storage_backend") == "file":
            kwargs["hicache_storage_backend"] = "dynamic"
        return kit_server_args(**kwargs)

    def project_backend(cache: Any) -> None:
        got = cache.cache_controller.storage_backend
        if project_cls is not None and not isinstance(got, project_cls):
            raise AssertionError(f"the storage backend is a {type(got).__module__}."
                                 f"{type(got).__name__}, not this project's "
                                 f"{project[1]}")  # fmt: skip

    class Case(UnifiedRadixCacheStorageFixtures, unittest.TestCase):
        cfg = CacheConfig(page_size=TREE_PAGE, num_layers=LAYERS)

        def setUp(self) -> None:
            patchers = [mock.patch.object(
                assembler, "get_mha_host_pool_cls", side_effect=unpinned_host_pool_cls
            )]  # fmt: skip
            if project_cls is not None:
                patchers.append(mock.patch.object(mixins, "ServerArgs", dynamic_server_args))
                patchers += _count_backend_calls(project_cls, calls)
            if cluster is not None:
                fake = types.ModuleType("mooncake.store")
                fake.MooncakeDistributedStore = cluster.factory
                pkg = types.ModuleType("mooncake")
                pkg.__path__, pkg.store = [], fake
                # Only these two names are put back (patch.dict would drop every module the
                # row imports).
                for name, module in (("mooncake", pkg), ("mooncake.store", fake)):
                    self.addCleanup(_restore_module, name, sys.modules.get(name))
                    sys.modules[name] = module
                patchers.append(mock.patch.object(project_cls, "store_factory", cluster.factory))
            for patcher in patchers:
                patcher.start()
                self.addCleanup(patcher.stop)

        def _l3_consumer(self, storage_dir: str) -> Any:
            fixture = fixtures.build_fixture(self.cfg)
            self._init_hicache(fixture[0], storage_backend="file", storage_dir=storage_dir,
                               prefetch_threshold=1, storage_extra=storage_extra)  # fmt: skip
            return fixture

        def runTest(self) -> None:
            storage_dir = self._make_storage_dir()
            seq = self._make_seq(100, 3)
            prod, prod_alloc, prod_rtp = fixtures.build_fixture(self.cfg)
            self._init_hicache(prod, storage_backend="file", storage_dir=storage_dir,
                               prefetch_threshold=1, storage_extra=storage_extra)  # fmt: skip
            project_backend(prod)
            sb = type(prod.cache_controller.storage_backend)
            out["classes"] = [type(prod).__name__, type(prod.cache_controller).__name__,
                              f"{sb.__module__}.{sb.__name__}"]  # fmt: skip
            self._insert(prod, prod_alloc, prod_rtp, seq)
            leaf = fixtures.match_prefix(prod, seq).last_device_node
            dev = self._get_full_kv_pool(prod_alloc)
            t._randomize(t._device_buffers("MHA", dev), gen)
            before = rows(dev, prod.path_device_indices(leaf))
            self._backup_node(prod, leaf)
            self._write_path_to_l3(prod, leaf)
            self._flush_l3_backups(prod)
            files = os.listdir(storage_dir) if cluster is None else sorted(cluster.objects)
            where = "files" if cluster is None else "Mooncake objects"
            out["calls"].append(f"L2 backup, write_backup_storage -> {len(files)} {where}")
            if not files:
                raise AssertionError("nothing written to storage")
            backend_used = prod.cache_controller.storage_backend
            stats = None if project_cls is None else backend_used.get_stats()
            if cluster is not None:
                out["calls"].append(f"{project[1]} calls {dict(sorted(calls.items()))}, "
                                    f"{stats.objects_written} objects written, "
                                    f"{stats.objects_already_stored} already stored")  # fmt: skip
                # MHA: a K and a V object a page; a page backed up again finds its objects.
                if (stats.objects_written != 6 or len(files) != 6 or stats.pages_store_failed
                        or set(calls) - {"batch_exists", *MOONCAKE_ZERO_COPY}
                        or not calls.get("batch_set_v1")):  # fmt: skip
                    raise AssertionError(f"{stats.objects_written} objects written, "
                                         f"{len(files)} stored, calls {calls} through this "
                                         "project's MooncakeStore: not 3 pages by "
                                         "batch_set_v1")  # fmt: skip
                calls.clear()
            elif stats is not None:
                out["calls"].append(f"{project[1]} calls {dict(sorted(calls.items()))}, "
                                    f"{stats.writes} pages written")  # fmt: skip
                if stats.writes != 3 or len(files) != 3 or calls.get("set", 0) < 3:
                    raise AssertionError(f"{stats.writes} pages written, {len(files)} files "
                                         "through this project's backend, not 3")  # fmt: skip
                calls.clear()

            cons, cons_alloc, _ = self._l3_consumer(storage_dir)
            project_backend(cons)
            cdev = self._get_full_kv_pool(cons_alloc)
            t._randomize(t._device_buffers("MHA", cdev), gen)
            self._consume_prefetch(cons, seq, CacheRequestHandle("l3", 0))
            m = fixtures.match_prefix(cons, seq)
            out["calls"].append(f"prefetch_from_storage: host hit {m.host_hit_length}")
            if m.host_hit_length != len(seq):
                raise AssertionError(f"prefetch brought {m.host_hit_length} of {len(seq)} tokens")
            self._load_back_node(cons, m.last_host_node)
            out["calls"].append("load_back")
            after = fixtures.match_prefix(cons, seq)
            slots = cons.path_device_indices(after.last_device_node)
            if len(slots) != len(seq):
                raise AssertionError(f"{len(slots)} tokens on the device after load back")
            if not t._bytes_equal(rows(cdev, slots), before):
                raise AssertionError("K/V through storage differ from the bytes written")
            if cluster is not None:
                stats = cons.cache_controller.storage_backend.get_stats()
                out["calls"].append(f"{project[1]} calls {dict(sorted(calls.items()))}, "
                                    f"{stats.pages_read} pages read, "
                                    f"{stats.read_corrupt} corrupt")  # fmt: skip
                if (stats.pages_read != 3 or stats.pages_read_failed or stats.read_corrupt
                        or set(calls) - {"batch_exists", *MOONCAKE_ZERO_COPY}
                        or not calls.get("batch_get_v1")):  # fmt: skip
                    raise AssertionError(f"{stats.pages_read} pages read, calls {calls} through "
                                         "this project's MooncakeStore: not 3 pages by "
                                         "batch_get_v1")  # fmt: skip
                fake_calls = sorted({c[0] for c in cluster.data_calls()})
                out["calls"].append(f"fake Mooncake {fake_calls}")
                if not {"batch_put_from", "batch_get_into"} <= set(fake_calls) and not {
                    "batch_put_from_multi_buffers",
                    "batch_get_into_multi_buffers",
                } <= set(fake_calls):
                    raise AssertionError(f"the fake Mooncake saw {fake_calls}: no put and get")
            elif project_cls is not None:
                stats = cons.cache_controller.storage_backend.get_stats()
                out["calls"].append(f"{project[1]} calls {dict(sorted(calls.items()))}, "
                                    f"{stats.read_hits} pages read")  # fmt: skip
                if stats.read_hits != 3 or calls.get("get", 0) != 3:
                    raise AssertionError(f"{stats.read_hits} pages read through this project's "
                                         "backend, not 3")  # fmt: skip

    try:
        OP_CALLS.clear()
        _run_kit_case(Case, out, recorder)
        expected = TREE_OPS[("MHA", "page_first", "kernel")]  # the kit's default layout / io
        if set(OP_CALLS) != expected or len(OP_CALLS) != 1 + LAYERS:
            raise AssertionError(f"ops {OP_CALLS}: not one backup and {LAYERS} loads of "
                                 f"{sorted(expected)}")  # fmt: skip
        if not recorder.keys:
            raise AssertionError("no copy kernel launch on the kernel io backend")
        out["ok"] = True
    except Exception as e:  # reported; the check fails on it
        out["error"] = f"{type(e).__name__}: {e}"[:4000]
    finally:
        recorder.close()
    return out


def _stub_rows(finder: Any) -> list[dict[str, Any]]:
    from tests.sglang_check import stubs

    rows = stubs.report(finder)
    for name, reason in {**PATCHES, **TREE_PATCHES}.items():
        rows.append({"module": name, "kind": "patched function", "reason": reason})
    return rows


def main(site: str, out_path: str) -> int:
    t0 = time.monotonic()
    out: dict[str, Any] = {"mode": "real-stack"}
    finder = _setup(site)
    try:
        from hicache_prefill.kernels.sglang import compat

        out["sglang_version"] = compat.sglang_version()
        handle = compat.install(route_around_jit=True)
        out["install"] = {
            "layout": handle.layout,
            "registered_sgl_kernel": handle.registered_sgl_kernel,
            "patched_modules": handle.patched_modules,
            "route_around_jit": handle.route_around_jit,
        }
        _patch()
        base = importlib.import_module("sglang.srt.mem_cache.pool_host.base")
        from tests.sglang_check.run_pin import _relax_host_reserve

        out["host_memory_reserve_bytes_set_to_0"] = _relax_host_reserve(base)
        real = [m for m in ("sglang", "sglang.srt.utils", "sglang.srt.mem_cache.memory_pool")
                if getattr(sys.modules.get(m), "__file__", None)]  # fmt: skip
        out["real_modules"] = real
        restore = _count_op_calls(handle)
        try:
            out["transfers"] = [run_case(c, handle, seed=i) for i, c in enumerate(cases())]
            out["transfers"] += [run_unified_tree(c, seed=len(out["transfers"]) + i)
                                 for i, c in enumerate(tree_cases())]  # fmt: skip
            for backend in STORAGE_ROWS:
                out["transfers"].append(
                    run_unified_storage(seed=len(out["transfers"]), backend=backend)
                )
        finally:
            for module, name, op in restore:
                module.__dict__[name] = op
        out["host_bytes_registered"] = sum(REGISTERED)
        handle.uninstall()
    except Exception as e:
        out["fatal"] = f"{type(e).__name__}: {e}"
        out["traceback"] = traceback.format_exc()
    out["stubs"] = _stub_rows(finder)
    out["sglang_modules_loaded"] = sum(1 for m in sys.modules if m.startswith("sglang"))
    out["seconds"] = round(time.monotonic() - t0, 1)
    with open(out_path, "w", encoding="utf-8") as f:
        json.dump(out, f, indent=1, default=str)
    return 0


if __name__ == "__main__":
    parser = argparse.ArgumentParser()
    parser.add_argument("--site", required=True)
    parser.add_argument("--out", required=True)
    args = parser.parse_args()
    logging.basicConfig(level=os.environ.get("SGLANG_CHECK_LOG", "WARNING"))
    sys.exit(main(args.site, args.out))
