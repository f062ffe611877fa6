"""SGLang's own radix trees as drivers of the benchmarks' traces (``ProjectDriver``'s interface).

``load_sglang`` imports SGLang as installed, or with ``site`` from a release installed without
its dependency tree (``make bench-vs-sglang``; unrelated imports stubbed by ``sglang_loader``,
any stub called raises). ``SGLangPythonDriver`` wraps ``radix_cache.RadixCache``,
``SGLangRustDriver`` ``UnifiedRadixCache`` with its Rust TreeCore (``tree_core_backend="rust"``),
each over SGLang's own allocator (``TokenToKVPoolAllocator`` at page 1, else
``PagedTokenToKVPoolAllocator``) and a one-layer, one-head ``MHATokenToKVPool`` on the CPU, all
unpatched. Keys are ``RadixKey(array("q", ...))`` built untimed (SGLang's times are a lower
bound); "match" includes ``path_device_indices`` of the matched node, which SGLang's scheduler
reads after a match. No ``ServerArgs`` is published: with HiCache and metrics off the trees read
none (publishing one resolves a model config).
"""

from __future__ import annotations

import importlib
import sys
from array import array
from typing import Any

import torch

SGLANG_NAMES = {
    "sglang.srt.mem_cache.allocator": ("TokenToKVPoolAllocator", "PagedTokenToKVPoolAllocator"),
    "sglang.srt.mem_cache.memory_pool": ("MHATokenToKVPool",),
    "sglang.srt.mem_cache.cache_init_params": ("CacheInitParams",),
    "sglang.srt.mem_cache.radix_cache": ("RadixCache", "RadixKey"),
    "sglang.srt.mem_cache.base_prefix_cache": ("MatchPrefixParams", "InsertParams", "EvictParams"),
    "sglang.srt.mem_cache.unified_radix_cache": ("UnifiedRadixCache",),
    "sglang.srt.mem_cache.unified_cache.component_type": ("ComponentType",),
}
RUST_CORE_MODULE = "sglang.srt.mem_cache.rust_tree_core.mem_cache"


def load_sglang(site: str | None = None) -> tuple[Any, str]:
    """``(namespace of the SGLang names used here, version)``, or ``(None, reason)``; the
    namespace's ``stub_report()`` lists every replacement used (empty without ``site``)."""
    finder = None
    try:
        if site is not None:
            from bench.cache_ops import sglang_loader

            finder = sglang_loader.install(site)
        sglang = importlib.import_module("sglang")
        ns: dict[str, Any] = {
            name: getattr(importlib.import_module(module), name)
            for module, names in SGLANG_NAMES.items()
            for name in names
        }
        ns["stub_report"] = staticmethod(
            (lambda: []) if finder is None else (lambda: sglang_loader.stub_report(finder))
        )
    except Exception as exc:  # noqa: BLE001 - any import failure means "not available"
        return None, f"SGLang is not importable here ({type(exc).__name__}: {exc})"
    version = getattr(sglang, "__version__", None)  # a bare package has none
    if version is None:
        version = getattr(importlib.import_module("sglang.version"), "__version__", "unknown")
    return type("SGLang", (), ns), version


def rust_core_file() -> str | None:
    """The file of SGLang's compiled Rust TreeCore extension this process loaded (or None)."""
    return getattr(sys.modules.get(RUST_CORE_MODULE), "__file__", None)


class _SGLangDriver:
    frees_duplicates = False

    def __init__(self, sgl: Any, pool_tokens: int, page_size: int) -> None:
        self.sgl, self.page_size = sgl, page_size
        common = dict(size=pool_tokens, dtype=torch.float16, device="cpu")
        kv = sgl.MHATokenToKVPool(
            page_size=page_size,
            head_num=1,
            head_dim=1,
            layer_num=1,
            enable_memory_saver=False,
            **common,
        )
        common.update(kvcache=kv, need_sort=False)
        if page_size == 1:
            self.allocator = sgl.TokenToKVPoolAllocator(**common)
        else:
            self.allocator = sgl.PagedTokenToKVPoolAllocator(page_size=page_size, **common)

    def _cache_params(self, **extra: Any) -> Any:
        extra.update(token_to_kv_pool_allocator=self.allocator, page_size=self.page_size)
        return self.sgl.CacheInitParams(disable=False, req_to_token_pool=None, **extra)

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


class SGLangPythonDriver(_SGLangDriver):
    name = "sglang_python"

    def __init__(self, sgl: Any, pool_tokens: int, page_size: int) -> None:
        super().__init__(sgl, pool_tokens, page_size)
        self.tree = sgl.RadixCache(self._cache_params())

    def lock(self, node: Any) -> Any:
        self.tree.inc_lock_ref(node)
        return node

    def unlock(self, node: Any, token: Any) -> None:
        self.tree.dec_lock_ref(node)


class SGLangRustDriver(_SGLangDriver):
    """``UnifiedRadixCache`` frees an insert's duplicates itself (inside the timed insert)."""

    name = "sglang_rust"
    frees_duplicates = True

    def __init__(self, sgl: Any, pool_tokens: int, page_size: int) -> None:
        super().__init__(sgl, pool_tokens, page_size)
        params = self._cache_params(
            tree_components=(sgl.ComponentType.FULL,), tree_core_backend="rust"
        )
        self.tree = sgl.UnifiedRadixCache(params=params)
        if self.tree._tree_core_backend != "rust":
            raise RuntimeError(f"SGLang fell back to the {self.tree._tree_core_backend} core")

    def insert(self, params: Any, slots: torch.Tensor, matched: int) -> int:
        p = self.sgl.InsertParams(key=params.key, value=slots, prev_prefix_len=matched)
        return self.tree.insert(p).prefix_len

    def lock(self, node: Any) -> Any:
        return self.tree.inc_lock_ref(node).to_dec_params()

    def unlock(self, node: Any, token: Any) -> None:
        self.tree.dec_lock_ref(node, token)
