"""A DeepSeek-shaped decoder with multi-head latent attention (MLA) over an MLA KV pool.

The blocks are ``prefill.model.paged``'s; only the attention differs (DeepSeek-V2/V3): the
cache holds ``[c, rope(k_pe)]`` per token and layer (``kv_lora_rank + qk_rope_head_dim``
values), and ``kv_b`` expands the latent into each head's key and value. ``forward_extend``
uses the naive form (SGLang's MLA prefill path: expand the whole latent read back from the pool,
causal SDPA); ``forward_reference`` (the tests' oracle) uses the absorbed form over the latent
and never touches a pool, so the two agree up to reduction order. Rotary uses the rotate-half
pairing. Tensor parallelism: ``prefill.model.mla_tp``.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch
import torch.nn.functional as F
from torch.nn.attention.bias import causal_lower_right

from prefill.model.paged import ExtendBatch, ModelConfig, PagedTransformer, RMSNorm

if TYPE_CHECKING:
    from hicache.memory.device_pool import MLATokenToKVPool
    from server_args import ServerArgs

_REF_SCORES = 1 << 26
"""Largest score block (values) the reference materializes at once."""


@dataclass(frozen=True)
class MLAConfig(ModelConfig):
    """``ModelConfig`` with DeepSeek's attention geometry (defaults: DeepSeek-V2-Lite's heads).

    ``num_kv_heads`` is 1 (the latent is one KV "head" every query head reads; SGLang's MLA pool
    has one head) and ``head_dim`` the query/key head width, ``qk_nope_head_dim +
    qk_rope_head_dim``. ``q_lora_rank`` 0: a full query projection.
    """

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
        """Values cached per token and layer: the latent and the rotary key."""
        return self.kv_lora_rank + self.qk_rope_head_dim

    @classmethod
    def tiny(
        cls, seed: int = 0, dtype: torch.dtype = torch.float32, q_lora_rank: int = 0
    ) -> MLAConfig:
        """The CPU test geometry: 4 layers, 4 heads, hidden 64, latent 32 + rope 16 (C = 48),
        nope 16, value 16, fp32."""
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
        """Geometry from resolved ``ServerArgs`` with ``use_mla`` (MLA fields filled in)."""
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
    """Decoder-only transformer whose attention is MLA over an ``MLATokenToKVPool`` (see the
    module docstring). Parameters on ``device`` in ``config.dtype``; the same calls as
    ``PagedTransformer`` (``forward_extend``, ``forward_reference``)."""

    config: MLAConfig

    def __init__(self, config: MLAConfig, device: torch.device | str = "cpu") -> None:
        if not isinstance(config, MLAConfig):
            raise ValueError(f"config must be an MLAConfig, got {type(config).__name__}")
        super().__init__(config, device)

    # ------------------------------------------------------------------ hooks of paged
    def _init_attention(
        self, layer: torch.nn.Module, w: Callable[[int, int], torch.nn.Parameter]
    ) -> None:
        """MLA weights of one layer, drawn in this order: ``q_a`` + its norm and ``q_b`` (with
        a query LoRA) or ``q_proj``; ``kv_a`` (latent + rotary key) + its norm; ``kv_b``;
        ``o``."""
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

    # ------------------------------------------------------------------ projections
    def _queries(
        self, layer: torch.nn.Module, x: torch.Tensor, positions: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """``(q_nope [n, H, nope], q_pe [n, H, rope])`` of normed hidden states ``x``; ``q_pe``
        after rotary."""
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
        """What the pool caches for tokens ``x`` at ``positions``: ``[n, 1, C]`` = the normed
        latent ``c`` and the rotary key, in the model dtype."""
        c = self.config
        c_kv, k_pe = (x @ layer.kv_a.t()).split([c.kv_lora_rank, c.qk_rope_head_dim], dim=-1)
        k_pe = self._rope(k_pe.unsqueeze(1), positions)
        return torch.cat([layer.kv_a_norm(c_kv).unsqueeze(1), k_pe], dim=-1)

    def _kv_b_halves(self, layer: torch.nn.Module) -> tuple[torch.Tensor, torch.Tensor]:
        """``kv_b`` per head: ``(w_uk [H, nope, R], w_uv [H, v, R])``."""
        c = self.config
        w = layer.kv_b.view(c.num_attention_heads, c.qk_nope_head_dim + c.v_head_dim, -1)
        return w[:, : c.qk_nope_head_dim], w[:, c.qk_nope_head_dim :]

    # ------------------------------------------------------------------ extend (naive form)
    def _extend_attention(
        self,
        pool: MLATokenToKVPool,
        layer_id: int,
        layer: torch.nn.Module,
        x: torch.Tensor,
        extend: ExtendBatch,
    ) -> torch.Tensor:
        """Writes the new tokens' ``[c, rope(k_pe)]`` at ``slots[i][prefix_len:]``, reads each
        request's whole latent back by slot, attends in the naive form (module docstring) and
        returns ``o``'s (partial, under TP) output ``[N, hidden]``."""
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
        """Causal attention of ``q`` ``[n, H, nope + rope]`` over the latent ``cached``
        ``[T, 1, C]`` (``T = prefix_len + n``), expanded by ``kv_b`` into per-head K ``[T, H,
        nope + rope]`` and V ``[T, H, v]``. Returns ``[n, H * v]``."""
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
        if prefix_len > 0:
            o = F.scaled_dot_product_attention(qf, kf, vf, attn_mask=causal_lower_right(n, total))
        else:
            o = F.scaled_dot_product_attention(qf, kf, vf, is_causal=True)
        o = o[0, ..., : c.v_head_dim].transpose(0, 1)  # [n, H, v]
        return o.reshape(n, heads * c.v_head_dim)

    # ------------------------------------------------------------------ reference (absorbed)
    def _full_attention(
        self, layer: torch.nn.Module, x: torch.Tensor, positions: torch.Tensor
    ) -> tuple[torch.Tensor, tuple[torch.Tensor, ...]]:
        """The absorbed form over a whole prompt, no pool (module docstring): ``o``'s output
        ``[n, hidden]`` and the cache ``([n, 1, C],)`` as the pool would hold it."""
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
