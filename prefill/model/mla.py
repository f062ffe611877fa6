"""A DeepSeek-shaped decoder with multi-head latent attention (MLA) over an MLA KV pool.

The blocks are ``prefill.model.paged``'s; the cache holds ``[c, rope(k_pe)]`` per token and
layer, and ``kv_b`` expands the latent into each head's key and value. ``forward_extend`` uses
the naive form (SGLang's MLA prefill: expand the latent read back from the pool, causal SDPA);
``forward_reference`` uses the absorbed form, so the two agree up to reduction order.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch
import torch.nn.functional as F
from torch.nn.attention.bias import causal_lower_right

from hicache_prefill.prefill.model.paged import (
    ExtendBatch,
    ModelConfig,
    PagedTransformer,
    RMSNorm,
    _sdpa,
)

if TYPE_CHECKING:
    from hicache_prefill.hicache.memory.device_pool import MLATokenToKVPool
    from hicache_prefill.server_args import ServerArgs

_REF_SCORES = 1 << 26  # largest score block (values) the reference materializes at once


@dataclass(frozen=True)
class MLAConfig(ModelConfig):
    """DeepSeek's attention geometry (defaults: DeepSeek-V2-Lite's heads). ``num_kv_heads`` is
    1 (one latent), ``head_dim`` is ``qk_nope_head_dim + qk_rope_head_dim``; ``q_lora_rank`` 0:
    a full query projection."""

    num_kv_heads: int = 1
    head_dim: int = 192
    kv_lora_rank: int = 512
    qk_rope_head_dim: int = 64
    qk_nope_head_dim: int = 128
    v_head_dim: int = 128
    q_lora_rank: int = 0

    def __post_init__(self) -> None:
        for name in (
            "num_layers",
            "num_attention_heads",
            "hidden_size",
            "intermediate_size",
            "vocab_size",
            "kv_lora_rank",
            "qk_rope_head_dim",
            "qk_nope_head_dim",
            "v_head_dim",
        ):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
        if self.q_lora_rank < 0:
            raise ValueError(f"q_lora_rank must be >= 0 (0: no query LoRA), got {self.q_lora_rank}")
        if self.qk_rope_head_dim % 2:
            raise ValueError(f"qk_rope_head_dim must be even (rotary), got {self.qk_rope_head_dim}")
        if self.num_kv_heads != 1:
            raise ValueError(f"num_kv_heads must be 1 (MLA: one latent), got {self.num_kv_heads}")
        if self.head_dim != self.qk_head_dim:
            raise ValueError(
                f"head_dim={self.head_dim} must be qk_nope_head_dim + qk_rope_head_dim = "
                f"{self.qk_head_dim}"
            )

    @property
    def qk_head_dim(self) -> int:
        return self.qk_nope_head_dim + self.qk_rope_head_dim

    @property
    def kv_cache_dim(self) -> int:
        return self.kv_lora_rank + self.qk_rope_head_dim

    @classmethod
    def tiny(
        cls, seed: int = 0, dtype: torch.dtype = torch.float32, q_lora_rank: int = 0
    ) -> MLAConfig:
        return cls(
            num_layers=4,
            num_attention_heads=4,
            hidden_size=64,
            intermediate_size=128,
            vocab_size=512,
            kv_lora_rank=32,
            qk_rope_head_dim=16,
            qk_nope_head_dim=16,
            head_dim=32,
            v_head_dim=16,
            q_lora_rank=q_lora_rank,
            dtype=dtype,
            seed=seed,
        )

    @classmethod
    def from_server_args(cls, args: ServerArgs) -> MLAConfig:
        if not getattr(args, "use_mla", False):
            raise ValueError("use_mla: an MLA model needs --use-mla")
        return cls(
            num_layers=args.num_layers,
            num_attention_heads=args.num_attention_heads,
            hidden_size=args.hidden_size,
            intermediate_size=args.intermediate_size,
            vocab_size=args.vocab_size,
            kv_lora_rank=args.kv_lora_rank,
            qk_rope_head_dim=args.qk_rope_head_dim,
            qk_nope_head_dim=args.qk_nope_head_dim,
            head_dim=args.qk_nope_head_dim + args.qk_rope_head_dim,
            v_head_dim=args.v_head_dim,
            q_lora_rank=args.q_lora_rank,
            dtype=args.torch_dtype(),
            seed=args.random_seed,
        )


class MLATransformer(PagedTransformer):
    """``PagedTransformer`` whose attention is MLA over an ``MLATokenToKVPool``."""

    config: MLAConfig

    def __init__(self, config: MLAConfig, device: torch.device | str = "cpu") -> None:
        if not isinstance(config, MLAConfig):
            raise ValueError(f"config must be an MLAConfig, got {type(config).__name__}")
        super().__init__(config, device)

    def _init_attention(
        self, layer: torch.nn.Module, w: Callable[[int, int], torch.nn.Parameter]
    ) -> None:
        c = self.config
        heads, eps = c.num_attention_heads, c.rms_norm_eps
        if c.q_lora_rank:
            layer.q_a = w(c.q_lora_rank, c.hidden_size)
            layer.q_a_norm = RMSNorm(c.q_lora_rank, eps, c.dtype, self.device)
            layer.q_b = w(heads * c.qk_head_dim, c.q_lora_rank)
        else:
            layer.q_proj = w(heads * c.qk_head_dim, c.hidden_size)
        layer.kv_a = w(c.kv_cache_dim, c.hidden_size)
        layer.kv_a_norm = RMSNorm(c.kv_lora_rank, eps, c.dtype, self.device)
        layer.kv_b = w(heads * (c.qk_nope_head_dim + c.v_head_dim), c.kv_lora_rank)
        layer.o = w(c.hidden_size, heads * c.v_head_dim)

    def _rotary_dim(self) -> int:
        return self.config.qk_rope_head_dim

    def _check_pool(self, pool: Any) -> None:
        c = self.config
        if not hasattr(pool, "kv_lora_rank"):
            raise ValueError(
                f"pool {type(pool).__name__} is not an MLA pool: an MLA model needs "
                "MLATokenToKVPool (--use-mla)"
            )
        got = (pool.layer_num, pool.kv_lora_rank, pool.qk_rope_head_dim)
        want = (c.num_layers, c.kv_lora_rank, c.qk_rope_head_dim)
        if got != want:
            raise ValueError(
                f"pool geometry (L, kv_lora_rank, qk_rope_head_dim) = {got} does not match the "
                f"model's {want}"
            )

    def _queries(
        self, layer: torch.nn.Module, x: torch.Tensor, positions: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """``(q_nope [n, H, nope], q_pe [n, H, rope])``, ``q_pe`` after rotary."""
        c = self.config
        if c.q_lora_rank:
            q = layer.q_a_norm(x @ layer.q_a.t()) @ layer.q_b.t()
        else:
            q = x @ layer.q_proj.t()
        q_nope, q_pe = q.view(-1, c.num_attention_heads, c.qk_head_dim).split(
            [c.qk_nope_head_dim, c.qk_rope_head_dim], dim=-1
        )
        return q_nope, self._rope(q_pe, positions)

    def _latent(
        self, layer: torch.nn.Module, x: torch.Tensor, positions: torch.Tensor
    ) -> torch.Tensor:
        """What the pool caches: ``[n, 1, C]``, the normed latent and the rotary key."""
        c = self.config
        c_kv, k_pe = (x @ layer.kv_a.t()).split([c.kv_lora_rank, c.qk_rope_head_dim], dim=-1)
        k_pe = self._rope(k_pe.unsqueeze(1), positions)
        return torch.cat([layer.kv_a_norm(c_kv).unsqueeze(1), k_pe], dim=-1)

    def _kv_b_halves(self, layer: torch.nn.Module) -> tuple[torch.Tensor, torch.Tensor]:
        """``kv_b`` per head: ``(w_uk [H, nope, R], w_uv [H, v, R])``."""
        c = self.config
        w = layer.kv_b.view(c.num_attention_heads, c.qk_nope_head_dim + c.v_head_dim, -1)
        return w[:, : c.qk_nope_head_dim], w[:, c.qk_nope_head_dim :]

    def _extend_attention(
        self,
        pool: MLATokenToKVPool,
        layer_id: int,
        layer: torch.nn.Module,
        x: torch.Tensor,
        extend: ExtendBatch,
    ) -> torch.Tensor:
        c = self.config
        q_nope, q_pe = self._queries(layer, x, extend.positions)
        q = torch.cat([q_nope, q_pe], dim=-1)
        latent = self._latent(layer, x, extend.positions)
        out = []
        start = 0
        for r, n, s in zip(extend.inputs, extend.lens, extend.slots, strict=True):
            pool.set_mla_kv_buffer(layer_id, s[r.prefix_len :], latent[start : start + n])
            cached = pool.get_key_buffer(layer_id)[s]  # [T, 1, C]: prefix + new, by slot
            out.append(self._naive_attention(layer, q[start : start + n], cached, r.prefix_len))
            start += n
        return torch.cat(out).to(c.dtype) @ layer.o.t()

    def _naive_attention(
        self, layer: torch.nn.Module, q: torch.Tensor, cached: torch.Tensor, prefix_len: int
    ) -> torch.Tensor:
        """Causal attention of ``q`` ``[n, H, nope + rope]`` over the latent ``cached`` ``[T, 1,
        C]`` expanded by ``kv_b``. Returns ``[n, H * v]``."""
        c = self.config
        heads, n, total = c.num_attention_heads, q.shape[0], cached.shape[0]
        c_kv, k_pe = cached[:, 0].split([c.kv_lora_rank, c.qk_rope_head_dim], dim=-1)
        kv = (c_kv @ layer.kv_b.t()).view(total, heads, c.qk_nope_head_dim + c.v_head_dim)
        k_nope, v = kv.split([c.qk_nope_head_dim, c.v_head_dim], dim=-1)
        k = torch.cat([k_nope, k_pe[:, None, :].expand(total, heads, c.qk_rope_head_dim)], dim=-1)
        on_cpu = q.device.type == "cpu"
        dt = torch.float32 if on_cpu else q.dtype
        pad = 0 if on_cpu else max(0, c.qk_head_dim - c.v_head_dim)
        if pad:
            v = F.pad(v, (0, pad))
        # A batch dimension of 1 (SDPA's fused kernels take 4-D inputs only, see paged).
        qf = q.to(dt).transpose(0, 1).unsqueeze(0)  # [1, H, n, D]
        kf = k.to(dt).transpose(0, 1).unsqueeze(0)  # [1, H, T, D]
        vf = v.to(dt).transpose(0, 1).unsqueeze(0)  # [1, H, T, v (+ pad)]
        o = _sdpa(qf, kf, vf, causal_lower_right(n, total) if prefix_len > 0 else None)
        o = o[0, ..., : c.v_head_dim].transpose(0, 1)  # [n, H, v]
        return o.reshape(n, heads * c.v_head_dim)

    def _full_attention(
        self, layer: torch.nn.Module, x: torch.Tensor, positions: torch.Tensor
    ) -> tuple[torch.Tensor, tuple[torch.Tensor, ...]]:
        """The absorbed form, no pool: ``o``'s output and the cache ``([n, 1, C],)``."""
        c = self.config
        n = x.shape[0]
        q_nope, q_pe = self._queries(layer, x, positions)
        latent = self._latent(layer, x, positions)
        lat = latent[:, 0].float()  # the cached values, as the extend path reads them
        c_kv, k_pe = lat.split([c.kv_lora_rank, c.qk_rope_head_dim], dim=-1)
        w_uk, w_uv = (t.float() for t in self._kv_b_halves(layer))
        q_lat = torch.einsum("nhd,hdr->hnr", q_nope.float(), w_uk)  # [H, n, R]
        q_rot = q_pe.float().transpose(0, 1)  # [H, n, rope]
        scale = 1.0 / math.sqrt(c.qk_head_dim)
        rows = max(1, _REF_SCORES // max(1, c.num_attention_heads * n))
        out_lat = []
        for i in range(0, n, rows):
            j = min(n, i + rows)
            scores = (q_lat[:, i:j] @ c_kv[:j].t() + q_rot[:, i:j] @ k_pe[:j].t()) * scale
            keys, queries = torch.arange(j, device=x.device), torch.arange(i, j, device=x.device)
            future = keys[None, :] > queries[:, None]
            probs = torch.softmax(scores.masked_fill(future, float("-inf")), dim=-1)
            out_lat.append(probs @ c_kv[:j])  # [H, j - i, R]
        o = torch.einsum("hnr,hvr->nhv", torch.cat(out_lat, dim=1), w_uv)
        o = o.reshape(n, c.num_attention_heads * c.v_head_dim).to(c.dtype)
        return o @ layer.o.t(), (latent,)
