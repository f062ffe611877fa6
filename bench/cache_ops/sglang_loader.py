"""Load SGLang's radix trees from a release installed without its dependency tree.

``make bench-vs-sglang`` installs ``sglang==0.5.23`` with ``pip install --no-deps --target
.venv-sglang-check/sglang-0.5.23`` and runs in the venv of ``make sglang-check`` (CPU torch,
triton, numpy, psutil, msgspec) plus ``packaging`` in ``.venv-sglang-check/bench-deps``.
:func:`install` puts both first on ``sys.path`` and installs the stub finder of
``tests/sglang_check/stubs.py``; everything the trees run (``radix_cache``,
``unified_radix_cache``, the Rust TreeCore extension shipped in the wheel, the allocators,
``memory_pool``, ``sglang.srt.utils``) is SGLang's installed file. Replaced, with the reasons in
``BARE_PACKAGES`` and ``_STUB_REASONS``:

- bare packages (``__init__`` not run, submodules load from the installed files): ``sglang``,
  ``sglang.srt.configs``, ``sglang.srt.layers.quantization``;
- stubbed SGLang modules (never called by the trees):
  ``sglang.srt.observability.metrics_collector``, ``sglang.srt.managers.schedule_batch``;
- stubbed third-party packages imported unconditionally by modules the trees never call into:
  ``orjson``, ``pybase64``, ``requests``, ``PIL``, ``starlette``, ``starlette.routing``,
  ``pydantic_core``, ``pydantic``, ``zmq``, ``zmq.auth``, ``zmq.auth.thread``, ``tvm_ffi``.

A placeholder that is called raises ``StubUsed``, so a stub reached by a benchmark stops it
instead of changing what is measured; :func:`stub_report` lists the replacements used.
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

_UTILS = "in sglang.srt.utils.common"
_STUB_REASONS: dict[str, str] = {
    "sglang.srt.observability.metrics_collector": "Prometheus metrics, used only with "
    "enable_metrics (off); its imports reach the model configs",
    "sglang.srt.managers.schedule_batch": "scheduler request batch; ReqKvInfo is used only by "
    "streaming sessions (none)",
    "orjson": f"JSON responses {_UTILS}",
    "pybase64": f"image decoding {_UTILS}",
    "requests": f"file downloads {_UTILS}",
    "PIL": f"image loading {_UTILS}",
    "starlette": f"HTTP routing {_UTILS}",
    "starlette.routing": f"HTTP routing {_UTILS}",
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
    """Put ``site`` (and ``deps`` when it exists) first on ``sys.path`` and install the stub
    finder. ``ValueError`` naming ``site`` when it holds no ``sglang``; nothing changes then."""
    if not os.path.isdir(os.path.join(site, "sglang")):
        raise ValueError(f"site={site!r} holds no sglang package: run make bench-vs-sglang")
    if "sglang" in sys.modules:
        logger.warning("sglang was imported before the loader; stubs apply to new imports only")
    for p in reversed([site] + ([deps] if deps and os.path.isdir(deps) else [])):
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
