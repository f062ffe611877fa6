"""Decides, once and before Triton is first imported, whether Triton kernels run interpreted.

On a machine without a CUDA device the same Triton kernels run on CPU tensors under
``TRITON_INTERPRET=1``. A value the user set explicitly is always respected.
"""

from __future__ import annotations

import itertools
import logging
import os

logger = logging.getLogger(__name__)


def version_tuple(text: str, parts: int = 2) -> tuple[int, ...]:
    """The leading ``parts`` numbers of a version string (``"3.6.0+git"`` -> ``(3, 6)``), the
    project's one version parser; missing or non-numeric parts read as 0."""
    out = []
    for piece in text.split(".")[:parts]:
        digits = "".join(itertools.takewhile(str.isdigit, piece))
        out.append(int(digits) if digits else 0)
    return tuple(out + [0] * (parts - len(out)))


def cuda_available() -> bool:
    """True when torch sees at least one CUDA device."""
    import torch

    return torch.cuda.is_available()


def ensure_triton_interpret() -> bool:
    """Set ``TRITON_INTERPRET=1`` when no CUDA device exists and the user did not choose.

    Returns whether Triton kernels will run interpreted. Must run before ``import triton``
    anywhere in the process to take effect for kernels defined afterwards.
    """
    if "TRITON_INTERPRET" not in os.environ and not cuda_available():
        os.environ["TRITON_INTERPRET"] = "1"
        logger.debug("no CUDA device: TRITON_INTERPRET=1 (Triton kernels run on CPU)")
    return os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")
