"""Token keys as the radix tree stores and compares them: packed int64 bytes, whole pages.

A key (a caller's token ids) becomes one ``bytes`` object of native int64s, 8 bytes a token
(``key_bytes``); every node stores its edge the same way (``TreeNode.tokens``). A walk then costs
C-level byte work per node and no Python work per token:

- a node's children are keyed by their first page's bytes (``page_size * 8`` bytes; page 1: one
  token), so a lookup hashes one short bytes object;
- a node whose whole edge matches is confirmed by ``key.startswith(node.tokens, offset)`` (one
  ``memcmp``, no slice); only the last node of a walk, where the key diverges or ends inside the
  edge, needs the common prefix (``match_bytes``: one numpy comparison).

``key_bytes`` takes what a scheduler holds: ``array('q')`` (SGLang 0.5.23 keeps token ids in one:
``.tobytes()`` is a copy of the buffer), a list of ints (SGLang's Python ``RadixCache`` tests, this
project's executor: one ``struct.pack``, about a list comparison's cost per token), a 1-D
integer tensor or numpy array, or any other sequence of ints. Nothing here knows the tree.
"""

from __future__ import annotations

import logging
import struct
from array import array
from collections.abc import Sequence

import numpy as np
import torch

logger = logging.getLogger(__name__)

TOKEN_BYTES = 8  # one int64 token id

_INT_DTYPES = (torch.int8, torch.int16, torch.int32, torch.int64, torch.uint8)


def _not_token_ids(exc: Exception) -> ValueError:
    return ValueError(f"key must be a sequence of int64 token ids ({type(exc).__name__}: {exc})")


def key_bytes(key: Sequence[int] | torch.Tensor | array | np.ndarray) -> bytes:
    """``key``'s token ids as native int64 bytes (8 per token); the caller's object is never
    changed. ``ValueError`` for a string, a tensor or array that is not 1-D or not of an integer
    dtype, or items that are not int64 token ids. Cost: a buffer copy for ``array('q')``; for a
    list one ``struct.pack`` (about what comparing two lists of the same length costs)."""
    kind = type(key)
    if kind is array:
        if key.typecode == "q":
            return key.tobytes()
        try:
            return array("q", key).tobytes()
        except (TypeError, OverflowError) as exc:
            raise _not_token_ids(exc) from exc
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
    """``key[start:stop]`` (a list of ints) as native int64 bytes; ``ValueError`` for items that
    are not int64 token ids. ``match_prefix`` reads a list key's first page this way before it
    converts the rest, so a miss on a long key converts one page."""
    try:  # struct converts a list of ints faster than array() or numpy do (~1 compare each)
        if start == 0 and stop == len(key):
            return struct.pack(f"{stop}q", *key)  # no slice: the whole key, as insert needs it
        return struct.pack(f"{stop - start}q", *key[start:stop])
    except struct.error as exc:
        raise _not_token_ids(exc) from exc


def token_list(tokens: bytes) -> list[int]:
    """Packed token bytes back as a list of ints (for checks, digests and readers; O(n))."""
    return memoryview(tokens).cast("q").tolist()


def match_bytes(tokens: bytes, key: bytes, start: int, end: int, page_bytes: int) -> int:
    """Bytes of the longest common prefix of ``tokens`` and ``key[start:end]``, in whole pages
    (a multiple of ``page_bytes``). One ``memcmp`` when the shorter one is a prefix of the
    other, else one numpy comparison of the overlap (the walk's last node only)."""
    n = min(len(tokens), end - start)
    if key.startswith(tokens if n == len(tokens) else tokens[:n], start):
        return n
    count = n // TOKEN_BYTES
    a = np.frombuffer(tokens, dtype=np.int64, count=count)
    b = np.frombuffer(key, dtype=np.int64, count=count, offset=start)
    same = int(np.argmin(a == b)) * TOKEN_BYTES  # the first differing token exists (see above)
    return same - same % page_bytes
