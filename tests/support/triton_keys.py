"""Triton's own specialization key for a launch of ``kernels.triton.copy_kernel.kv_copy_kernel``.

A compiled Triton kernel is cached per key: the type and specialization of every argument
(16-byte alignment of pointers, value 1 and multiples of 16 of integers, except those in
``do_not_specialize``), the constexprs and the launch options. Two launches with the same key
share one compiled kernel; a launch whose key is new compiles, on the launching thread. This
module computes the key with Triton's own binder for an sm_90 target, whether the kernel is
interpreted (``TRITON_INTERPRET=1``, as on this CPU machine) or compiled, so tests and
``make sglang-check`` can tell which launches would compile on an H200 without one.
"""

from __future__ import annotations

import functools
import logging
from typing import Any

logger = logging.getLogger(__name__)


@functools.lru_cache(maxsize=1)
def _binder() -> Any:
    from triton.backends.compiler import GPUTarget
    from triton.compiler import make_backend
    from triton.runtime.jit import JITFunction, create_function_from_signature

    from hicache_prefill.kernels.triton.copy_kernel import kv_copy_kernel

    kernel = kv_copy_kernel
    if not isinstance(kernel, JITFunction):  # interpreted: the same function, as @triton.jit
        options = getattr(kernel, "kwargs", {})
        kernel = JITFunction(
            kernel.fn,
            **{k: options[k] for k in ("do_not_specialize", "do_not_specialize_on_alignment")
               if options.get(k) is not None},
        )  # fmt: skip
    backend = make_backend(GPUTarget("cuda", 90, 32))
    return create_function_from_signature(kernel.signature, kernel.params, backend)


def available() -> bool:
    """Whether this Triton installation has the NVIDIA backend the keys are computed with."""
    try:
        _binder()
    except Exception:  # noqa: BLE001 - no NVIDIA backend in this Triton build
        return False
    return True


def launch_key(*args: Any, **kwargs: Any) -> str:
    """The cache key a CUDA launch ``kv_copy_kernel[grid](*args, **kwargs)`` would look up
    (specialization and options, as ``triton.runtime.jit.compute_cache_key`` forms it)."""
    _, specialization, options = _binder()(*args, **kwargs)
    return str(tuple(specialization)) + str(options)
