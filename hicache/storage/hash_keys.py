"""Page keys for L3 storage: SGLang 0.5.23's SHA-256 chain, byte for byte, and ``page_hashes``.
A page's key is the hex SHA-256 of the previous page's digest (if any, or a ``prior_hash`` /
namespace seed) and its token ids as little-endian uint32 (a token above ``2**32 - 1``: ``b"\\xff"``
and uint64 ids). Ranks and model name are not hashed (backends add them to object names).
"""

from __future__ import annotations

import hashlib
import logging
from collections.abc import Sequence
from typing import Any

import numpy as np
import torch

logger = logging.getLogger(__name__)

DIGEST_BYTES = 32
NAMESPACE_DOMAIN = b"sglang-cache-namespace-v1"
_U32_MAX = 2**32 - 1
_I64_MAX = 2**63 - 1
_WIDE_TAG = b"\xff"

TokenIds = Sequence[int] | np.ndarray | torch.Tensor


def _as_tokens(token_ids: Any) -> np.ndarray:
    raw = getattr(token_ids, "token_ids", token_ids)  # a key object carrying its tokens
    if isinstance(raw, torch.Tensor):
        if raw.dtype.is_floating_point or raw.dtype.is_complex or raw.dtype == torch.bool:
            raise ValueError(f"token ids must be integers, got a {raw.dtype} tensor")
        arr = raw.detach().cpu().numpy()
    elif isinstance(raw, np.ndarray):
        arr = raw
    else:
        seq = list(raw)
        if not seq:
            return np.zeros(0, dtype=np.uint64)
        if any(isinstance(t, bool) or not isinstance(t, int | np.integer) for t in seq):
            raise ValueError("token ids must be integers")
        if any(t < 0 or t > _I64_MAX for t in seq):
            raise ValueError("token ids must be non-negative and fit in int64")
        return np.asarray(seq, dtype=np.uint64)
    if arr.ndim != 1:
        raise ValueError(f"token ids must be 1-D, got shape {tuple(arr.shape)}")
    if arr.size == 0:
        return np.zeros(0, dtype=np.uint64)
    if arr.dtype.kind not in "iu":
        raise ValueError(f"token ids must be integers, got dtype {arr.dtype}")
    if arr.dtype.kind == "i" and int(arr.min()) < 0:
        raise ValueError("token ids must be non-negative")
    if int(arr.max()) > _I64_MAX:
        raise ValueError("token ids must fit in int64")
    return arr.astype(np.uint64)


def _prior_digest(prior_hash: str | None) -> bytes | None:
    if not prior_hash:
        return None
    try:
        digest = bytes.fromhex(prior_hash)
    except (TypeError, ValueError):
        raise ValueError(f"prior_hash must be {2 * DIGEST_BYTES} hex characters") from None
    if len(digest) != DIGEST_BYTES:
        raise ValueError(f"prior_hash must be {2 * DIGEST_BYTES} hex characters")
    return digest


def _check_page_size(page_size: Any) -> None:
    if isinstance(page_size, bool) or not isinstance(page_size, int) or page_size <= 0:
        raise ValueError(f"page_size must be a positive int, got {page_size!r}")


def _hash_page(tokens: np.ndarray, prior: bytes | None) -> bytes:
    h = hashlib.sha256()
    if prior is not None:
        h.update(prior)
    if tokens.size and int(tokens.max()) > _U32_MAX:
        h.update(_WIDE_TAG)
        h.update(tokens.astype("<u8").tobytes())
    else:
        h.update(tokens.astype("<u4").tobytes())
    return h.digest()


def get_hash_str(
    token_ids: TokenIds, prior_hash: str | None = None, page_size: int | None = None
) -> str | list[str]:
    """One hex key per page (``page_size`` given) or one over all."""
    tokens = _as_tokens(token_ids)
    prior = _prior_digest(prior_hash)
    if page_size is None:
        return _hash_page(tokens, prior).hex()
    _check_page_size(page_size)
    keys: list[str] = []
    for start in range(0, tokens.size, page_size):
        prior = _hash_page(tokens[start : start + page_size], prior)
        keys.append(prior.hex())
    return keys


def storage_namespace_seed(extra_key: str | None, cache_salt: str | None) -> str | None:
    if extra_key is None and cache_salt is None:
        return None
    h = hashlib.sha256(NAMESPACE_DOMAIN)
    for part in (extra_key, cache_salt):
        if part is None:
            h.update(b"\x00")
            continue
        if not isinstance(part, str):
            raise ValueError(f"extra_key and cache_salt must be str or None, got {part!r}")
        encoded = part.encode("utf-8")
        h.update(b"\x01" + len(encoded).to_bytes(8, "little") + encoded)
    return h.hexdigest()


def get_storage_hash_str(
    key: Any, prior_hash: str | None = None, page_size: int | None = None
) -> str | list[str]:
    """``get_hash_str`` seeded with ``key``'s namespace (``extra_key`` / ``cache_salt``) when
    ``prior_hash`` is ``None``."""
    if prior_hash is None:
        prior_hash = storage_namespace_seed(
            getattr(key, "extra_key", None), getattr(key, "cache_salt", None) or None
        )
    return get_hash_str(key, prior_hash, page_size=page_size)


def page_hashes(
    token_ids: TokenIds,
    page_size: int,
    prior_hash: str | None = None,
    *,
    extra_key: str | None = None,
    cache_salt: str | None = None,
) -> list[str]:
    """One key per page of a page-aligned token list. ``prior_hash``: the last key before these;
    ``None`` starts a chain seeded with the namespace of ``extra_key`` / ``cache_salt``."""
    tokens = _as_tokens(token_ids)
    _check_page_size(page_size)
    if tokens.size % page_size:
        raise ValueError(f"{tokens.size} tokens are not whole pages of {page_size}")
    if prior_hash is None:
        prior_hash = storage_namespace_seed(extra_key, cache_salt or None)
    keys = get_hash_str(tokens, prior_hash, page_size)
    assert isinstance(keys, list)
    return keys
