"""The 11 kernel-backend ``kvcacheio`` ops (SGLang's names and signatures, built from
:data:`kernels.ops.kernel_backend.OP_SPECS`) over the validating Triton launcher."""

from __future__ import annotations

from kernels.ops.dispatch import transfer
from kernels.ops.kernel_backend import build_ops

globals().update(build_ops(transfer, __name__))
