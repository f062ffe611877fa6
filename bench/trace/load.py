"""Traces in the Mooncake format and their token ids.

One JSON object per line: ``timestamp`` (ms), ``input_length``, ``hash_ids`` (one per ``block``
tokens, each covering its block and all before it; the last block may be partial). Invariant of
``tokens``: block ``h`` is the token ids ``h * block .. h * block + block - 1``, so equal hash ids
give equal tokens, different ids disjoint ones, and a partial last block is the first
``input_length - block * (n - 1)`` of its ids.
"""

from __future__ import annotations

import json
from array import array
from dataclasses import dataclass
from pathlib import Path

import numpy as np

DEFAULT_TRACE = (
    Path(__file__).resolve().parents[1] / "data/mooncake_fast25/conversation_trace.jsonl"
)
BLOCK = 512


@dataclass(frozen=True)
class Request:
    arrival_s: float
    input_length: int
    hash_ids: tuple[int, ...]


def load_trace(path: Path | str = DEFAULT_TRACE, limit: int | None = None) -> list[Request]:
    """The first ``limit`` requests of ``path`` (all when ``None``), in file order."""
    out: list[Request] = []
    with open(path) as f:
        for line in f:
            if limit is not None and len(out) >= limit:
                break
            if line.strip():
                r = json.loads(line)
                out.append(Request(r["timestamp"] / 1e3, r["input_length"], tuple(r["hash_ids"])))
    return out


def tokens(req: Request, block: int = BLOCK) -> np.ndarray:
    """The prompt's token ids (int64, ``input_length`` of them; module docstring)."""
    n = len(req.hash_ids)
    if n != -(-req.input_length // block) or n == 0:
        raise ValueError(f"{n} hash ids for {req.input_length} tokens of blocks of {block}")
    ids = np.asarray(req.hash_ids, dtype=np.int64)
    return (ids[:, None] * block + np.arange(block, dtype=np.int64)).reshape(-1)[: req.input_length]


def key_array(t: np.ndarray) -> array:
    """Token ids as ``array('q')``, the key type SGLang's trees get."""
    a = array("q")
    a.frombytes(t.tobytes())
    return a
