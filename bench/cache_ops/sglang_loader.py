"""Load SGLang's radix trees from a release installed without its dependency tree.

``make bench-vs-sglang`` installs ``sglang==0.5.23`` with ``pip install --no-deps --target
.venv-sglang-check/sglang-0.5.23`` (the pin directory of ``make sglang-check``) and runs in that
check's venv (CPU torch, triton, numpy, psutil, msgspec) plus ``packaging`` (in
``.venv-sglang-check/bench-deps``), which ``sglang.srt.utils.common`` calls at import time.
:func:`install` puts both directories first on ``sys.path`` and installs the stub finder of
``tests/sglang_check/stubs.py`` with the replacements below. Everything SGLang runs in the
benchmark -- ``radix_cache``, ``unified_radix_cache`` and its ``unified_cache`` package, the Rust
TreeCore extension (``mem_cache/rust_tree_core/mem_cache.*.so``, compiled, shipped in the wheel),
the allocators, ``memory_pool``, ``server_args``, ``sglang.srt.utils`` -- is SGLang's file as
installed (260 of its modules load unchanged).

Bare packages (``__init__`` not run, submodules load from the installed files):

- ``sglang``: its ``__init__`` imports the frontend language and applies HuggingFace patches.
- ``sglang.srt.configs``: its ``__init__`` imports every model's config class (transformers);
  ``memory_pool`` needs only ``configs.mamba_utils``.
- ``sglang.srt.layers.quantization``: its ``__init__`` imports every quantization method and the
  whole model-layer stack (deep_gemm, MoE runners); ``memory_pool`` needs only
  ``fp4_kv_cache_quant_method``.

Stubbed SGLang modules (their names are placeholders that raise if called):

- ``sglang.srt.observability.metrics_collector``: Prometheus metrics; imported by
  ``base_prefix_cache``, used only with ``enable_metrics`` (off here); its own imports reach the
  model configs and transformers.
- ``sglang.srt.managers.schedule_batch``: the scheduler's request batch; imported by
  ``session.streaming_session`` for ``ReqKvInfo``, used only by streaming sessions (none here).

Stubbed third-party packages (unconditional imports of modules the trees never call into):

- ``orjson``, ``pybase64``, ``requests``, ``PIL``, ``starlette`` (+ ``starlette.routing``):
  HTTP, JSON and image helpers of ``sglang.srt.utils.common``.
- ``pydantic_core``: ``sglang.srt.utils.msgspec_utils`` (request schema helpers).
- ``pydantic``: ``sglang.srt.disaggregation.kv_events`` (KV event publishing, off here).
- ``zmq`` (+ ``zmq.auth``, ``zmq.auth.thread``): IPC sockets of ``sglang.srt.utils.network``.
- ``tvm_ffi``: JIT CUDA all-reduce kernels, reached from ``memory_pool`` through
  ``layers.dp_attention``.

A placeholder that is called raises ``StubUsed``, so a stub reached by the trace stops the
benchmark instead of changing what is measured. :func:`stub_report` lists the replacements this
process actually used; the benchmark prints it and writes it to its JSON.
"""

from __future__ import annotations

import logging
import os
import sys
from typing import Any

from tests.sglang_check.stubs import Stub, StubFinder, install_importer, report

logger = logging.getLogger(__name__)

DEFAULT_SITE = ".venv-sglang-check/sglang-0.5.23"
DEFAULT_DEPS = ".venv-sglang-check/bench-deps"

BARE_PACKAGES: dict[str, str] = {
    "sglang": "package __init__ imports the frontend language and HF patches",
    "sglang.srt.configs": "package __init__ imports every model config (transformers); "
    "memory_pool needs only configs.mamba_utils",
    "sglang.srt.layers.quantization": "package __init__ imports every quantization method and "
    "the model-layer stack; memory_pool needs only fp4_kv_cache_quant_method",
}

_STUB_REASONS: dict[str, str] = {
    "sglang.srt.observability.metrics_collector": "Prometheus metrics, used only with "
    "enable_metrics (off); its imports reach the model configs",
    "sglang.srt.managers.schedule_batch": "scheduler request batch; ReqKvInfo is used only by "
    "streaming sessions (none)",
    "orjson": "JSON responses in sglang.srt.utils.common",
    "pybase64": "image decoding in sglang.srt.utils.common",
    "requests": "file downloads in sglang.srt.utils.common",
    "PIL": "image loading in sglang.srt.utils.common",
    "starlette": "HTTP routing in sglang.srt.utils.common",
    "starlette.routing": "HTTP routing in sglang.srt.utils.common",
    "pydantic_core": "request schema helpers in sglang.srt.utils.msgspec_utils",
    "pydantic": "KV event messages in sglang.srt.disaggregation.kv_events (events off)",
    "zmq": "IPC sockets in sglang.srt.utils.network",
    "zmq.auth": "IPC sockets in sglang.srt.utils.network",
    "zmq.auth.thread": "IPC sockets in sglang.srt.utils.network",
    "tvm_ffi": "JIT CUDA all-reduce kernels, reached from memory_pool via layers.dp_attention",
}


def stubs() -> dict[str, Stub]:
    """A fresh :class:`Stub` per stubbed module (each records the names imported from it)."""
    return {name: Stub(reason) for name, reason in _STUB_REASONS.items()}


def install(site: str = DEFAULT_SITE, deps: str | None = DEFAULT_DEPS) -> StubFinder:
    """Put the pin directory ``site`` (and ``deps`` when it exists) first on ``sys.path`` and
    install the stub finder. Raises ``ValueError`` naming ``site`` when it holds no ``sglang``;
    nothing is changed then. Call before the first ``import sglang``."""
    if not os.path.isdir(os.path.join(site, "sglang")):
        raise ValueError(f"site={site!r} holds no sglang package: run make bench-vs-sglang")
    if "sglang" in sys.modules:
        logger.warning("sglang was imported before the loader; stubs apply to new imports only")
    paths = [site] + ([deps] if deps and os.path.isdir(deps) else [])
    for p in reversed(paths):
        if p not in sys.path:
            sys.path.insert(0, p)
    return install_importer(stubs(), BARE_PACKAGES)


def stub_report(finder: StubFinder) -> list[dict[str, Any]]:
    """Every bare package and stub this process used, with its reason and placeholder names."""
    return report(finder)


def stub_lines(rows: list[dict[str, Any]]) -> list[str]:
    out = []
    for r in rows:
        names = ", ".join(r.get("placeholders", [])) or "none"
        tail = f" [names imported: {names}]" if r["kind"] == "stub" else ""
        out.append(f"  - {r['module']} ({r['kind']}): {r['reason']}{tail}")
    return out
