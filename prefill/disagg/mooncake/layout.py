"""What the two sides register with their engines and how a page is addressed: ``KVGeometry``
(both sides must share it; it crosses as REGISTER's item lengths and ``PrefillServerInfo``'s page
size and KV dtype), ``layer_buffers`` (page ``p`` of buffer ``i`` at ``ptr[i] + p *
item_len[i]``) and ``MetadataBuffers`` (SGLang's ten default buffers, one row each per request:
first output token, cached tokens, logprob and speculative fields, bootstrap room)."""

from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from hicache_prefill.hicache.memory.device_pool import KVPool, MHATokenToKVPool, MLATokenToKVPool

_DTYPES = {
    "float32": torch.float32,
    "bfloat16": torch.bfloat16,
    "float16": torch.float16,
    "float8_e4m3fn": torch.float8_e4m3fn,
    "uint8": torch.uint8,
}


@dataclass(frozen=True)
class KVGeometry:
    """The KV layout both sides of a transfer must share: MHA or MLA, page size, dtype."""

    kind: str
    layer_num: int
    page_size: int
    dtype: str
    head_num: int = 0
    head_dim: int = 0
    v_head_dim: int = 0
    kv_lora_rank: int = 0
    qk_rope_head_dim: int = 0

    def __post_init__(self) -> None:
        if self.kind not in ("mha", "mla"):
            raise ValueError(f"geometry kind must be 'mha' or 'mla', got {self.kind!r}")
        if self.dtype not in _DTYPES:
            raise ValueError(f"geometry dtype must be one of {sorted(_DTYPES)}, got {self.dtype!r}")
        need = (
            ("head_num", "head_dim", "v_head_dim")
            if self.kind == "mha"
            else ("kv_lora_rank", "qk_rope_head_dim")
        )
        for name in ("layer_num", "page_size", *need):
            if not isinstance(getattr(self, name), int) or getattr(self, name) < 1:
                raise ValueError(
                    f"geometry {name} must be a positive integer, got {getattr(self, name)!r}"
                )

    @classmethod
    def from_pool(cls, pool: KVPool) -> KVGeometry:
        dtype = str(pool.dtype).removeprefix("torch.")
        if isinstance(pool, MLATokenToKVPool):
            return cls(
                "mla",
                pool.layer_num,
                pool.page_size,
                dtype,
                kv_lora_rank=pool.kv_lora_rank,
                qk_rope_head_dim=pool.qk_rope_head_dim,
            )
        return cls(
            "mha",
            pool.layer_num,
            pool.page_size,
            dtype,
            head_num=pool.head_num,
            head_dim=pool.head_dim,
            v_head_dim=pool.v_head_dim,
        )

    def to_json(self) -> str:
        return json.dumps(dataclasses.asdict(self), sort_keys=True)

    @classmethod
    def from_json(cls, text: str | dict[str, Any]) -> KVGeometry:
        try:
            data = json.loads(text) if isinstance(text, str) else dict(text)
        except ValueError:
            raise ValueError(f"geometry is not JSON: {str(text)[:80]!r}") from None
        names = {f.name for f in dataclasses.fields(cls)}
        unknown = set(data) - names
        if unknown or "kind" not in data:
            raise ValueError(f"geometry {data}: unknown fields {sorted(unknown)} or no kind")
        return cls(**data)

    def mismatches(self, other: KVGeometry) -> list[str]:
        """``"field: X vs Y"`` for every field that differs."""
        return [
            f"{f.name}: {getattr(self, f.name)!r} vs {getattr(other, f.name)!r}"
            for f in dataclasses.fields(self)
            if getattr(self, f.name) != getattr(other, f.name)
        ]

    @property
    def torch_dtype(self) -> torch.dtype:
        return _DTYPES[self.dtype]

    def token_bytes(self) -> list[int]:
        el = torch.empty((), dtype=self.torch_dtype).element_size()
        if self.kind == "mla":
            return [(self.kv_lora_rank + self.qk_rope_head_dim) * el] * self.layer_num
        k, v = self.head_num * self.head_dim * el, self.head_num * self.v_head_dim * el
        return [k] * self.layer_num + [v] * self.layer_num

    def kv_cache_dtype_str(self) -> str:
        """SGLang's ``kv_cache_dtype_str`` of a pool of this dtype: ``"auto"`` (the model's own
        dtype, unquantized) or the fp8 name."""
        return {"float8_e4m3fn": "fp8_e4m3"}.get(self.dtype, "auto")

    def item_lens(self) -> list[int]:
        """SGLang's ``kv_item_lens``: bytes of one page of each layer buffer."""
        return [self.page_size * b for b in self.token_bytes()]

    def make_pool(self, size: int, device: str | torch.device = "cpu") -> KVPool:
        """A zeroed pool of this geometry with ``size`` slots (plus the padding page)."""
        if self.kind == "mla":
            return MLATokenToKVPool(
                size,
                self.page_size,
                self.torch_dtype,
                self.kv_lora_rank,
                self.qk_rope_head_dim,
                self.layer_num,
                device,
            )
        return MHATokenToKVPool(
            size,
            self.page_size,
            self.torch_dtype,
            self.head_num,
            self.head_dim,
            self.layer_num,
            device,
            v_head_dim=self.v_head_dim,
        )


def buffer_kinds(pool: KVPool) -> list[list[torch.Tensor]]:
    """The pool's per-layer buffers, one list per kind (MLA: the latent; MHA: K, then V)."""
    if isinstance(pool, MLATokenToKVPool):
        return [pool.kv_buffer]
    return [pool.k_buffer, pool.v_buffer]


def layer_buffers(pool: KVPool) -> list[torch.Tensor]:
    """One contiguous ``[size + page_size, ...]`` tensor per layer buffer, kind after kind."""
    return [layer for kind in buffer_kinds(pool) for layer in kind]


def pool_region(pool: KVPool) -> tuple[int, int]:
    """``(address, bytes)`` spanning every layer buffer of the pool."""
    bufs = layer_buffers(pool)
    start = min(b.data_ptr() for b in bufs)
    end = max(b.data_ptr() + b.numel() * b.element_size() for b in bufs)
    return start, end - start


def read_pool(pool: KVPool, slots: torch.Tensor) -> list[torch.Tensor]:
    """Copies of what ``pool`` holds at ``slots``, one ``[L, n, ...]`` tensor per buffer kind."""
    return [torch.stack([layer[slots] for layer in kind]) for kind in buffer_kinds(pool)]


class MetadataBuffers:
    """SGLang 0.5.23's ``MetadataBuffers`` with its defaults (no sampling mask, no DSA top-k, no
    checksum, no speculative hidden states): ``size`` zeroed rows of ten host buffers, in the
    order of its ``get_buf_infos``, matched by index with a decode's. The prefill writes the
    first output token, the cached-token count and the bootstrap room; the logprob and
    speculative fields stay zero."""

    def __init__(self, size: int) -> None:
        if size < 1:
            raise ValueError(f"size must be >= 1, got {size}")
        self.size = size
        self.output_ids = np.zeros((size, 16), dtype=np.int32)
        self.cached_tokens = np.zeros((size, 16), dtype=np.int32)
        self.output_token_logprobs_val = np.zeros((size, 16), dtype=np.float32)
        self.output_token_logprobs_idx = np.zeros((size, 16), dtype=np.int32)
        self.output_top_logprobs_val = np.zeros((size, 128), dtype=np.float32)
        self.output_top_logprobs_idx = np.zeros((size, 128), dtype=np.int32)
        self.output_topk_p = np.zeros((size, 16), dtype=np.float32)
        self.output_topk_index = np.zeros((size, 16), dtype=np.int64)
        self.output_hidden_states = np.zeros((size, 16), dtype=np.float32)
        self.bootstrap_room = np.zeros((size, 8), dtype=np.uint64)
        self._bufs = [
            self.output_ids,
            self.cached_tokens,
            self.output_token_logprobs_val,
            self.output_token_logprobs_idx,
            self.output_top_logprobs_val,
            self.output_top_logprobs_idx,
            self.output_topk_p,
            self.output_topk_index,
            self.output_hidden_states,
            self.bootstrap_room,
        ]

    @property
    def ptrs(self) -> list[int]:
        return [b.ctypes.data for b in self._bufs]

    @property
    def row_lens(self) -> list[int]:
        return [b.shape[1] * b.itemsize for b in self._bufs]

    def regions(self) -> list[tuple[int, int]]:
        return [(b.ctypes.data, b.nbytes) for b in self._bufs]

    def _check(self, index: int) -> None:
        if not 0 <= index < self.size:
            raise ValueError(f"metadata index {index} is not a row (size {self.size})")

    def set_row(
        self,
        index: int,
        first_token: int,
        cached_tokens: int,
        room: int,
        by_tier: tuple[int, int, int] = (0, 0, 0),
    ) -> None:
        """SGLang's ``set_buf`` for a text request without logprobs: the row zeroed, then the
        first token, ``cached_tokens`` (slot 0) and its split ``by_tier`` (device, host,
        storage: slots 1-3; slots 4-6, multimodal token counts, stay 0), and the room."""
        self._check(index)
        for b in self._bufs:
            b[index] = 0
        self.output_ids[index, 0] = first_token
        self.cached_tokens[index, :4] = (cached_tokens, *by_tier)
        self.bootstrap_room[index, 0] = room

    def get_row(self, index: int) -> tuple[int, int, int]:
        """``(first_token, cached_tokens, room)``."""
        self._check(index)
        return (
            int(self.output_ids[index, 0]),
            int(self.cached_tokens[index, 0]),
            int(self.bootstrap_room[index, 0]),
        )

    def clear_row(self, index: int) -> None:
        """Room 0 means "not written" to the next owner (SGLang's ``clear_slot`` zeroes the
        room; this zeroes the whole row)."""
        self._check(index)
        for b in self._bufs:
            b[index] = 0
