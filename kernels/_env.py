"""Decides, before Triton is first imported, whether Triton kernels run interpreted (on CPU
tensors, ``TRITON_INTERPRET=1``, when there is no CUDA device); a value the user set is kept."""

from __future__ import annotations

import itertools
import logging
import os

logger = logging.getLogger(__name__)


def version_tuple(text: str, parts: int = 2) -> tuple[int, ...]:
    """The leading ``parts`` numbers of a version (``"3.6.0+git"`` -> ``(3, 6)``); missing as 0."""
    out = []
    for piece in text.split(".")[:parts]:
        digits = "".join(itertools.takewhile(str.isdigit, piece))
        out.append(int(digits) if digits else 0)
    return tuple(out + [0] * (parts - len(out)))


def cuda_available() -> bool:
    import torch

    return torch.cuda.is_available()


def ensure_triton_interpret() -> bool:
    """Set ``TRITON_INTERPRET=1`` when no CUDA device exists and the user did not choose;
    returns whether kernels run interpreted. Must run before ``import triton``."""
    if "TRITON_INTERPRET" not in os.environ and not cuda_available():
        os.environ["TRITON_INTERPRET"] = "1"
        logger.debug("no CUDA device: TRITON_INTERPRET=1 (Triton kernels run on CPU)")
    return os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")
