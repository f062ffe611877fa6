"""Raw byte views of KV buffers (no copy)."""

from __future__ import annotations

import math

import torch


def row_bytes(t: torch.Tensor) -> int:
    return math.prod(t.shape[1:]) * t.element_size()


def token_rows(t: torch.Tensor, width: int) -> torch.Tensor:
    """A ``uint8`` view ``[nbytes // width, width]`` aliasing contiguous ``t``."""
    if not t.is_contiguous():
        raise ValueError(f"expected a contiguous tensor, got strides {t.stride()}")
    flat = t.reshape(-1).view(torch.uint8)
    if width <= 0 or flat.numel() % width:
        raise ValueError(f"{flat.numel()} bytes are not a whole number of {width}-byte rows")
    return flat.view(-1, width)


def page_rows(buf: torch.Tensor, page_size: int) -> torch.Tensor:
    """``uint8`` view ``[P, L, page_size, row_bytes]`` of a page_first_direct buffer."""
    p, n_layers = buf.shape[0], buf.shape[1]
    width = buf.nbytes // (p * n_layers * page_size)
    return token_rows(buf, width).view(p, n_layers, page_size, -1)
