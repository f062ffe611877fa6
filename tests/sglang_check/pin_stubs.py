"""The stub list of ``make sglang-check``: every SGLang module replaced, and why.

Only imports unrelated to KV transfer are replaced; the host-pool modules
(``sglang.srt.mem_cache.pool_host.*``, ``memory_pool_host``), their base classes, allocators,
``device_pool_info`` and the gate functions are SGLang's files as installed. The same list is in
docs/SGLANG_FORK.md; the check prints the ones each pin actually used.
"""

from __future__ import annotations

import logging
from typing import Any

from tests.sglang_check.stubs import Stub

logger = logging.getLogger(__name__)

BARE_PACKAGES: dict[str, str] = {
    "sglang": "package __init__ imports the whole runtime (frontend language, HF patches); "
    "submodules load from the installed files",
    "sglang.srt.layers": "package __init__ imports the model layers; only layers.dcp.layout is "
    "used",
    "sglang.srt.layers.dcp": "package __init__ imports the distributed communicators; only "
    "dcp.layout (maybe_dcp_kernel_indices, used by the 0.5.23 MLA host pool) is loaded",
}


def _platform(cuda_shaped: bool) -> dict[str, Any]:
    """SGLang's platform probes: the real answers, or CUDA for the cuda-shaped run."""
    import torch

    def is_cuda() -> bool:
        return cuda_shaped or (torch.cuda.is_available() and torch.version.cuda is not None)

    return {
        "is_cuda": is_cuda,
        "is_hip": lambda: (not cuda_shaped) and torch.version.hip is not None,
        "is_npu": lambda: False,
        "is_xpu": lambda: False,
        "is_mps": lambda: False,
        "is_cpu": lambda: not is_cuda(),
    }


def _jit_hicache(cuda_shaped: bool) -> dict[str, Any]:
    """SGLang's JIT HiCache kernels cannot build here. The predicates answer 'usable' in the
    cuda-shaped run (as on CUDA when the per-token size is a multiple of 128 bytes: only the
    compat module's route-around keeps SGLang off the placeholder kernels), else 'not usable'."""

    def predicate(*args: Any, **kwargs: Any) -> bool:
        return cuda_shaped

    return {"can_use_hicache_jit_kernel": predicate, "can_use_write_back_jit_kernel": predicate}


def stubs(cuda_shaped: bool) -> dict[str, Stub]:
    """The stub modules for one run. ``cuda_shaped``: SGLang's platform probe says CUDA, so the
    host-pool modules run their CUDA import branch (``from sgl_kernel.kvcacheio import ...``)."""
    return {
        "sglang.srt.utils": Stub(
            "package __init__ star-imports utils.common (the whole runtime's helpers); provides "
            "the platform probes is_cuda/is_hip/is_npu/is_xpu/is_mps/is_cpu"
            + (" answering CUDA (cuda-shaped run)" if cuda_shaped else " with torch's answers"),
            lambda: _platform(cuda_shaped),
        ),
        "sglang.srt.utils.common": Stub(
            "runtime helpers (imports orjson, HF, networking); the gate modules import a few "
            "names that the gate never calls"
        ),
        "sglang.kernels.ops.kvcache.hicache": Stub(
            "SGLang's JIT CUDA HiCache kernels (need nvcc and tvm_ffi); the two predicates "
            "answer "
            + ("True (as on CUDA with 128-byte multiples)" if cuda_shaped else "False")
            + ", the kernels are placeholders that fail the check if called",
            lambda: _jit_hicache(cuda_shaped),
        ),
        "sglang.kernels.ops.kvcache.hisparse": Stub(
            "HiSparse / DeepSeek-V4 JIT kernels, imported by memory_pool_host for its DSV4 pools"
        ),
        "sglang.kernels.ops.mamba.transfer_mamba": Stub(
            "mamba state JIT kernels, imported by memory_pool_host (cuda-shaped run only)"
        ),
        "sglang.srt.mem_cache.memory_pool": Stub(
            "SGLang's device pools: replaced by this project's (hicache.memory.device_pool); the "
            "host pools use these names as type annotations only"
        ),
        "sglang.srt.hardware_backend.mlx.runtime": Stub(
            "Apple MLX runtime probe (imports packaging), reached from the 0.5.23 gate module"
        ),
        "requests": Stub(
            "HTTP client, imported by SGLang's mooncake_store for check_server (the master's "
            "metrics probe), which the L3 rows leave off (the cpu and cuda-shaped runs keep "
            "SGLang's import surface to the KV path; the real-stack run imports the real one)"
        ),
        "sglang.srt.observability.metrics_collector": Stub(
            "Prometheus metrics (imports the model configs and transformers); SGLang's "
            "mooncake_store imports StorageMetrics, used only with storage metrics on (off here)"
        ),
        "sglang.utils": Stub(
            "frontend utilities (imports pybase64, requests), reached from the 0.5.23 gate module"
        ),
    }
