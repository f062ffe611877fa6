"""The backend module under SGLang 0.5.23 when it is importable here (``make sglang-check`` mode
``tree-backend`` runs it fully, with SGLang's scheduler helpers and ``UnifiedRadixCache``)."""

from __future__ import annotations

import pytest

registry = pytest.importorskip(
    "sglang.srt.mem_cache.registry", reason="SGLang 0.5.23 is not importable in this venv"
)


def test_register_is_idempotent_and_names_the_backend() -> None:
    from hicache_prefill.hicache.tree import sglang_backend

    assert sglang_backend.register() == "hicache_prefill"
    assert sglang_backend.register() == "hicache_prefill"
    assert registry.get_radix_cache_factory("hicache_prefill") is sglang_backend.build_backend
