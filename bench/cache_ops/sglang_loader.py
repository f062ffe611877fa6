"""SGLang's radix trees as drivers of the benchmarks' traces (``ProjectDriver``'s interface).

``load_sglang`` imports SGLang as installed or from a ``pip install --no-deps --target`` ``site``
through ``tests/sglang_check/stubs.py``'s finder (``BARE_PACKAGES``, ``STUB_REASONS``: what is
replaced and why); trees, allocators and ``memory_pool`` run unpatched on the CPU. "match"
includes ``path_device_indices`` (SGLang's scheduler reads them after a match).
"""

from __future__ import annotations

import importlib
import os
import sys
from array import array
from functools import partial
from typing import Any

import torch

from tests.sglang_check.stubs import Stub, StubFinder, install_importer, report

DEFAULT_DEPS = ".venv-sglang-check/bench-deps"
BARE_PACKAGES: dict[str, str] = {
    "sglang": "package __init__ imports the frontend language and HF patches",
    "sglang.srt.configs": "package __init__ imports every model config (transformers); "
    "memory_pool needs only configs.mamba_utils",
    "sglang.srt.layers.quantization": "package __init__ imports every quantization method and "
    "the model-layer stack; memory_pool needs only fp4_kv_cache_quant_method",
}
_UTILS, _NET = "in sglang.srt.utils.common", "IPC sockets in sglang.srt.utils.network"
STUB_REASONS: dict[str, str] = {
    "sglang.srt.observability.metrics_collector": "Prometheus metrics, used only with "
    "enable_metrics (off); its imports reach the model configs",
    "sglang.srt.managers.schedule_batch": "scheduler request batch; ReqKvInfo is used only by "
    "streaming sessions (none)",
    "orjson": f"JSON responses {_UTILS}",
    "pybase64": f"image decoding {_UTILS}",
    "requests": f"file downloads {_UTILS}",
    "PIL": f"image loading {_UTILS}",
    **dict.fromkeys(("starlette", "starlette.routing"), f"HTTP routing {_UTILS}"),
    "pydantic_core": "request schema helpers in sglang.srt.utils.msgspec_utils",
    "pydantic": "KV event messages in sglang.srt.disaggregation.kv_events (events off)",
    **dict.fromkeys(("zmq", "zmq.auth", "zmq.auth.thread"), _NET),
    "tvm_ffi": "JIT CUDA all-reduce kernels, reached from memory_pool via layers.dp_attention",
}
SGLANG_NAMES = (  # module.Name under sglang.srt.mem_cache
    "allocator.TokenToKVPoolAllocator allocator.PagedTokenToKVPoolAllocator "
    "memory_pool.MHATokenToKVPool cache_init_params.CacheInitParams radix_cache.RadixCache "
    "radix_cache.RadixKey base_prefix_cache.MatchPrefixParams base_prefix_cache.InsertParams "
    "base_prefix_cache.EvictParams unified_radix_cache.UnifiedRadixCache "
    "unified_cache.component_type.ComponentType"
).split()


def install(site: str, deps: str | None = DEFAULT_DEPS) -> StubFinder:
    """Put ``site`` (and ``deps`` when it exists) first on ``sys.path`` and install the stub
    finder; ``ValueError`` naming ``site``, with nothing changed, when it holds no ``sglang``."""
    if not os.path.isdir(os.path.join(site, "sglang")):
        raise ValueError(f"site={site!r} holds no sglang package: run make bench-vs-sglang")
    for p in reversed([site] + ([deps] if deps and os.path.isdir(deps) else [])):
        if p not in sys.path:
            sys.path.insert(0, p)
    return install_importer({n: Stub(r) for n, r in STUB_REASONS.items()}, BARE_PACKAGES)


def load_sglang(site: str | None = None) -> tuple[Any, str]:
    """``(namespace of SGLANG_NAMES, version)`` or ``(None, reason)``; the namespace's
    ``stub_report()`` lists every replacement used (empty without ``site``)."""
    try:
        finder = None if site is None else install(site)
        mods = [n.rsplit(".", 1) for n in SGLANG_NAMES]
        ns = {n: getattr(importlib.import_module(f"sglang.srt.mem_cache.{m}"), n) for m, n in mods}
        version = importlib.import_module("sglang.version").__version__
    except Exception as exc:  # noqa: BLE001 - any import failure means "not available"
        return None, f"SGLang is not importable here ({type(exc).__name__}: {exc})"
    ns["stub_report"] = staticmethod(lambda: [] if finder is None else report(finder))
    return type("SGLang", (), ns), version


def sglang_drivers(site: str | None) -> tuple[Any, str, dict[str, Any]]:
    """``load_sglang``'s namespace, a note (``"sglang VERSION"`` or why not) and a factory
    ``(pool_tokens, page_size) -> driver`` per SGLang tree; a ``site`` that fails raises."""
    sgl, note = load_sglang(site)
    if sgl is None and site is not None:  # asked for that install: no silent fallback
        raise RuntimeError(f"--sglang-site {site}: {note}")
    drivers = (SGLangPythonDriver, SGLangRustDriver) if sgl else ()
    return sgl, f"sglang {note}" if sgl else note, {d.name: partial(d, sgl) for d in drivers}


class SGLangPythonDriver:
    """SGLang's ``RadixCache`` over its allocator and a one-layer ``MHATokenToKVPool``."""

    name, frees_duplicates = "sglang_python", False

    def __init__(self, sgl: Any, pool_tokens: int, page_size: int) -> None:
        self.sgl = sgl
        common = dict(size=pool_tokens, dtype=torch.float16, device="cpu")
        one = dict(head_num=1, head_dim=1, layer_num=1, enable_memory_saver=False)
        kv = sgl.MHATokenToKVPool(page_size=page_size, **one, **common)
        paged = {} if page_size == 1 else {"page_size": page_size}
        cls = sgl.PagedTokenToKVPoolAllocator if paged else sgl.TokenToKVPoolAllocator
        self.allocator = cls(kvcache=kv, need_sort=False, **paged, **common)
        p = dict(disable=False, req_to_token_pool=None, token_to_kv_pool_allocator=self.allocator)
        self.tree = self._tree(sgl, page_size=page_size, **p)

    def _tree(self, sgl: Any, **params: Any) -> Any:
        return sgl.RadixCache(sgl.CacheInitParams(**params))

    def prepare(self, key: Any) -> Any:
        return self.sgl.MatchPrefixParams(key=self.sgl.RadixKey(array("q", key)))

    def match(self, params: Any) -> tuple[int, torch.Tensor, Any]:
        r = self.tree.match_prefix(params)
        node = r.last_device_node
        return r.device_prefix_len, self.tree.path_device_indices(node), node

    def insert(self, params: Any, slots: torch.Tensor, matched: int) -> int:
        return self.tree.insert(self.sgl.InsertParams(key=params.key, value=slots)).prefix_len

    def evict(self, n: int) -> int:
        return self.tree.evict(self.sgl.EvictParams(num_tokens=n)).num_tokens_evicted

    def lock(self, node: Any) -> Any:
        self.tree.inc_lock_ref(node)
        return node

    def unlock(self, node: Any, token: Any) -> None:
        self.tree.dec_lock_ref(node)


class SGLangRustDriver(SGLangPythonDriver):
    """``UnifiedRadixCache`` on the Rust TreeCore; it frees an insert's duplicates itself."""

    name, frees_duplicates = "sglang_rust", True

    def _tree(self, sgl: Any, **params: Any) -> Any:
        rust = dict(tree_components=(sgl.ComponentType.FULL,), tree_core_backend="rust")
        tree = sgl.UnifiedRadixCache(params=sgl.CacheInitParams(**params, **rust))
        if tree._tree_core_backend != "rust":
            raise RuntimeError(f"SGLang fell back to the {tree._tree_core_backend} core")
        return tree

    def insert(self, params: Any, slots: torch.Tensor, matched: int) -> int:
        p = self.sgl.InsertParams(key=params.key, value=slots, prev_prefix_len=matched)
        return self.tree.insert(p).prefix_len

    def lock(self, node: Any) -> Any:
        return self.tree.inc_lock_ref(node).to_dec_params()

    def unlock(self, node: Any, token: Any) -> None:
        self.tree.dec_lock_ref(node, token)
