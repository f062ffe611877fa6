"""KV transfer kernels between the device pool and the host pool (SGLang ``kvcacheio`` ops)."""

from __future__ import annotations

from kernels._env import ensure_triton_interpret

TRITON_INTERPRETED = ensure_triton_interpret()
