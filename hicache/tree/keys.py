"""Token keys as the tree stores and compares them: packed native int64 bytes, 8 a token, so a
walk does one dict lookup and one ``memcmp`` per node (docs/DESIGN.md section 6)."""

from __future__ import annotations

import struct
from array import array
from collections.abc import Sequence

import numpy as np
import torch

TOKEN_BYTES = 8  # one int64 token id

_INT_DTYPES = (torch.int8, torch.int16, torch.int32, torch.int64, torch.uint8)


def _not_token_ids(exc: Exception) -> ValueError:
    return ValueError(f"key must be a sequence of int64 token ids ({type(exc).__name__}: {exc})")


def key_bytes(key: Sequence[int] | torch.Tensor | array | np.ndarray) -> bytes:
    """``key``'s token ids as native int64 bytes; ``ValueError`` for a string, a tensor or
    array that is not 1-D integer, or items that are not int64 token ids."""
    kind = type(key)
    if kind is array and key.typecode == "q":
        return key.tobytes()
    if kind is list:
        return list_bytes(key, 0, len(key))
    if isinstance(key, torch.Tensor):
        if key.dim() != 1:
            raise ValueError(f"key must be 1-D, got shape {tuple(key.shape)}")
        if key.dtype not in _INT_DTYPES:
            raise ValueError(f"key must hold integer token ids, got {key.dtype}")
        return key.to(device="cpu", dtype=torch.int64).numpy().tobytes()
    if isinstance(key, np.ndarray):
        if key.ndim != 1:
            raise ValueError(f"key must be 1-D, got shape {key.shape}")
        if key.dtype.kind not in "iu":
            raise ValueError(f"key must hold integer token ids, got {key.dtype}")
        return key.astype(np.int64, copy=False).tobytes()
    if isinstance(key, (str, bytes, bytearray, memoryview)):
        raise ValueError("key must be a sequence of token ids, not a string or raw bytes")
    try:
        return array("q", key).tobytes()
    except (TypeError, OverflowError) as exc:
        raise _not_token_ids(exc) from exc


def list_bytes(key: list[int], start: int, stop: int) -> bytes:
    try:  # struct converts a list of ints faster than array() or numpy do (~1 compare each)
        if start == 0 and stop == len(key):
            return struct.pack(f"{stop}q", *key)  # no slice: the whole key, as insert needs it
        return struct.pack(f"{stop - start}q", *key[start:stop])
    except struct.error as exc:
        raise _not_token_ids(exc) from exc


def token_list(tokens: bytes) -> list[int]:
    return memoryview(tokens).cast("q").tolist()


def match_bytes(tokens: bytes, key: bytes, start: int, end: int, page_bytes: int) -> int:
    """Bytes of the longest common prefix of ``tokens`` and ``key[start:end]``, in whole
    pages: one ``memcmp``, else one numpy comparison of the overlap."""
    n = min(len(tokens), end - start)
    if key.startswith(tokens if n == len(tokens) else tokens[:n], start):
        return n
    count = n // TOKEN_BYTES
    a = np.frombuffer(tokens, dtype=np.int64, count=count)
    b = np.frombuffer(key, dtype=np.int64, count=count, offset=start)
    same = int(np.argmin(a == b)) * TOKEN_BYTES  # the first differing token exists (see above)
    return same - same % page_bytes
