"""A small Llama-style decoder (RMSNorm, rotary, GQA, SwiGLU) with paged attention over a KV
pool; random weights from ``random_seed``. As SGLang's extend path, each layer writes the new
tokens' K/V at their slots and reads the request's whole K/V back by slot; ``layer_wait``
runs before each layer touches the pool. ``prefill.model.mla`` overrides the attention hooks.
RMSNorm, rotary and CPU attention in fp32; logits match a full recompute to ~1e-5 in fp32.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F
from torch.nn.attention.bias import causal_lower_right

from hicache_prefill.kernels._env import version_tuple

if TYPE_CHECKING:
    from hicache_prefill.hicache.memory.device_pool import MHATokenToKVPool
    from hicache_prefill.server_args import ServerArgs

logger = logging.getLogger(__name__)

LayerWait = Callable[[int], None]

# SDPA's enable_gqa exists from torch 2.5; cleared at the first kernel path that rejects it.
_GQA_OK = version_tuple(torch.__version__) >= (2, 5)


def _sdpa(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: object, **kw: bool
) -> torch.Tensor:
    if mask is None:
        return F.scaled_dot_product_attention(q, k, v, is_causal=True, **kw)
    return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, **kw)


@dataclass(frozen=True)
class ModelConfig:
    num_layers: int = 4
    num_attention_heads: int = 4
    num_kv_heads: int = 2
    head_dim: int = 16
    hidden_size: int = 64
    intermediate_size: int = 128
    vocab_size: int = 512
    rope_theta: float = 500000.0
    rms_norm_eps: float = 1e-5
    dtype: torch.dtype = torch.float32
    seed: int = 0

    def __post_init__(self) -> None:
        for name in (
            "num_layers",
            "num_attention_heads",
            "num_kv_heads",
            "head_dim",
            "hidden_size",
            "intermediate_size",
            "vocab_size",
        ):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
        if self.num_attention_heads % self.num_kv_heads != 0:
            raise ValueError(
                f"num_attention_heads={self.num_attention_heads} must be a multiple of "
                f"num_kv_heads={self.num_kv_heads}"
            )
        if self.head_dim % 2 != 0:
            raise ValueError(f"head_dim must be even (rotary), got {self.head_dim}")

    @classmethod
    def tiny(cls, seed: int = 0, dtype: torch.dtype = torch.float32) -> ModelConfig:
        return cls(seed=seed, dtype=dtype)

    @classmethod
    def from_server_args(cls, args: ServerArgs) -> ModelConfig:
        return cls(
            num_layers=args.num_layers,
            num_attention_heads=args.num_attention_heads,
            num_kv_heads=args.head_num,
            head_dim=args.head_dim,
            hidden_size=args.hidden_size,
            intermediate_size=args.intermediate_size,
            vocab_size=args.vocab_size,
            dtype=args.torch_dtype(),
            seed=args.random_seed,
        )


@dataclass(frozen=True)
class ExtendInput:
    """``input_ids``: int64 ``[n]`` new tokens; ``slots``: int64 ``[prefix_len + n]`` pool slots
    of the whole sequence so far; ``prefix_len``: tokens whose K/V are already in the pool."""

    input_ids: torch.Tensor
    slots: torch.Tensor
    prefix_len: int


@dataclass(frozen=True)
class ExtendBatch:
    """An extend batch on the model's device, as every layer's attention reads it."""

    inputs: Sequence[ExtendInput]
    positions: torch.Tensor
    lens: list[int]
    slots: list[torch.Tensor]


class RMSNorm(torch.nn.Module):
    def __init__(self, dim: int, eps: float, dtype: torch.dtype, device: torch.device) -> None:
        super().__init__()
        self.weight = torch.nn.Parameter(torch.ones(dim, dtype=dtype, device=device))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        xf = x.float()
        xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)
        return (xf * self.weight.float()).to(x.dtype)


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((-x2, x1), dim=-1)


class PagedTransformer(torch.nn.Module):
    def __init__(self, config: ModelConfig, device: torch.device | str = "cpu") -> None:
        super().__init__()
        self.config = config
        self.device = torch.device(device)
        c = config
        gen = torch.Generator(device=self.device)
        gen.manual_seed(c.seed)

        def w(out_f: int, in_f: int) -> torch.nn.Parameter:
            t = torch.randn(out_f, in_f, generator=gen, device=self.device, dtype=torch.float32)
            return torch.nn.Parameter((t / math.sqrt(in_f)).to(c.dtype), requires_grad=False)

        emb = torch.randn(c.vocab_size, c.hidden_size, generator=gen, device=self.device)
        self.embed = torch.nn.Parameter(emb.to(c.dtype), requires_grad=False)
        self.layers = torch.nn.ModuleList()
        for _ in range(c.num_layers):
            layer = torch.nn.Module()
            layer.input_norm = RMSNorm(c.hidden_size, c.rms_norm_eps, c.dtype, self.device)
            layer.post_norm = RMSNorm(c.hidden_size, c.rms_norm_eps, c.dtype, self.device)
            self._init_attention(layer, w)
            layer.gate_up = w(2 * c.intermediate_size, c.hidden_size)
            layer.down = w(c.hidden_size, c.intermediate_size)
            self.layers.append(layer)
        self.norm = RMSNorm(c.hidden_size, c.rms_norm_eps, c.dtype, self.device)
        self.lm_head = w(c.vocab_size, c.hidden_size)
        rot = self._rotary_dim()
        exponents = torch.arange(0, rot, 2, dtype=torch.float32, device=self.device)
        inv_freq = 1.0 / (c.rope_theta ** (exponents / rot))
        self.register_buffer("inv_freq", inv_freq, persistent=False)
        self.requires_grad_(False)

    # Attention hooks (overridden by ``prefill.model.mla``); weights drawn in this order.
    def _init_attention(
        self, layer: torch.nn.Module, w: Callable[[int, int], torch.nn.Parameter]
    ) -> None:
        c = self.config
        q_dim, kv_dim = c.num_attention_heads * c.head_dim, c.num_kv_heads * c.head_dim
        layer.qkv = w(q_dim + 2 * kv_dim, c.hidden_size)
        layer.o = w(c.hidden_size, q_dim)

    def _rotary_dim(self) -> int:
        return self.config.head_dim

    def _rope(self, x: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        freqs = positions.to(torch.float32)[:, None] * self.inv_freq[None, :]
        emb = torch.cat((freqs, freqs), dim=-1)
        cos, sin = emb.cos()[:, None, :], emb.sin()[:, None, :]
        xf = x.float()
        return (xf * cos + _rotate_half(xf) * sin).to(x.dtype)

    def _reduce(self, partial: torch.Tensor) -> torch.Tensor:
        """Sum a row-parallel projection's output over TP ranks (identity on one rank)."""
        return partial

    def _check_pool(self, pool: MHATokenToKVPool) -> None:
        c = self.config
        if not hasattr(pool, "head_num"):
            raise ValueError(
                f"pool {type(pool).__name__} has no KV heads (an MLA pool?): this model's "
                "attention is GQA, the MLA model is built with --use-mla"
            )
        if pool.layer_num != c.num_layers or pool.head_num != c.num_kv_heads:
            raise ValueError(
                f"pool geometry (L={pool.layer_num}, H={pool.head_num}) does not match the model "
                f"(L={c.num_layers}, H={c.num_kv_heads})"
            )
        if pool.head_dim != c.head_dim:
            raise ValueError(f"pool head_dim={pool.head_dim} != model head_dim={c.head_dim}")

    def _check_inputs(self, batch: Sequence[ExtendInput]) -> None:
        if len(batch) == 0:
            raise ValueError("batch must hold at least one request")
        for i, r in enumerate(batch):
            for name in ("input_ids", "slots"):
                t = getattr(r, name)
                if not isinstance(t, torch.Tensor) or t.dim() != 1 or t.dtype != torch.int64:
                    raise ValueError(f"batch[{i}].{name} must be a 1-D torch.int64 tensor")
            n = r.input_ids.numel()
            if n == 0:
                raise ValueError(f"batch[{i}].input_ids is empty")
            if r.prefix_len < 0 or r.slots.numel() != r.prefix_len + n:
                raise ValueError(
                    f"batch[{i}].slots has {r.slots.numel()} entries, expected prefix_len "
                    f"({r.prefix_len}) + len(input_ids) ({n})"
                )
            if r.input_ids.device.type == "cpu" and (
                int(r.input_ids.min()) < 0 or int(r.input_ids.max()) >= self.config.vocab_size
            ):
                raise ValueError(f"batch[{i}].input_ids out of range [0, {self.config.vocab_size})")

    @torch.no_grad()
    def forward_extend(
        self,
        pool: MHATokenToKVPool,
        batch: Sequence[ExtendInput],
        layer_wait: LayerWait | None = None,
        return_all_logits: bool = False,
    ) -> list[torch.Tensor]:
        """One extend pass. Returns one fp32 tensor per request: its last token's logits, or
        all new tokens' with ``return_all_logits``. Does not synchronize the device."""
        self._check_pool(pool)
        self._check_inputs(batch)
        dev = self.device
        lens = [r.input_ids.numel() for r in batch]
        # Pageable host ids: the copy is staged at once, so non_blocking never races the source,
        # and the host does not wait here for the previous forward to finish.
        ids = torch.cat([r.input_ids for r in batch]).to(dev, non_blocking=True)
        positions = torch.cat(
            [
                torch.arange(r.prefix_len, r.prefix_len + n, dtype=torch.int64, device=dev)
                for r, n in zip(batch, lens, strict=True)
            ]
        )
        slots = [r.slots.to(dev, non_blocking=True) for r in batch]
        extend = ExtendBatch(batch, positions, lens, slots)
        h = self.embed[ids]
        for layer_id, layer in enumerate(self.layers):
            if layer_wait is not None:
                layer_wait(layer_id)
            x = layer.input_norm(h)
            o = self._extend_attention(pool, layer_id, layer, x, extend)
            h = h + self._reduce(o)
            h = h + self._mlp(layer, h)
        h = self.norm(h)
        out = []
        start = 0
        for n in lens:
            hs = h[start : start + n] if return_all_logits else h[start + n - 1]
            out.append((hs @ self.lm_head.t()).float())
            start += n
        return out

    def _extend_attention(
        self,
        pool: MHATokenToKVPool,
        layer_id: int,
        layer: torch.nn.Module,
        x: torch.Tensor,
        extend: ExtendBatch,
    ) -> torch.Tensor:
        """Writes the new tokens' K/V at ``slots[i][prefix_len:]``, attends over each request's
        slots; returns ``o``'s (partial, under TP) output ``[N, hidden]``."""
        q, k, v = self._qkv(layer, x, extend.positions)
        attn_out = []
        start = 0
        for r, n, s in zip(extend.inputs, extend.lens, extend.slots, strict=True):
            new_k, new_v = k[start : start + n], v[start : start + n]
            pool.set_kv_buffer(layer_id, s[r.prefix_len :], new_k, new_v)
            k_all = pool.get_key_buffer(layer_id)[s]
            v_all = pool.get_value_buffer(layer_id)[s]
            attn_out.append(self._attention(q[start : start + n], k_all, v_all, r.prefix_len))
            start += n
        return torch.cat(attn_out).to(self.config.dtype) @ layer.o.t()

    def _full_attention(
        self, layer: torch.nn.Module, x: torch.Tensor, positions: torch.Tensor
    ) -> tuple[torch.Tensor, tuple[torch.Tensor, ...]]:
        """No pool: ``o``'s output ``[n, hidden]`` and what the pool would hold, ``(k, v)``."""
        q, k, v = self._qkv(layer, x, positions)
        return self._attention(q, k, v, 0).to(self.config.dtype) @ layer.o.t(), (k, v)

    def _qkv(
        self, layer: torch.nn.Module, x: torch.Tensor, positions: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """``q [n, Hq, D]``, ``k`` and ``v`` ``[n, H, D]``; rotary applied to ``q`` and ``k``."""
        c = self.config
        q_dim, kv_dim = c.num_attention_heads * c.head_dim, c.num_kv_heads * c.head_dim
        q, k, v = (x @ layer.qkv.t()).split([q_dim, kv_dim, kv_dim], dim=-1)
        q = self._rope(q.view(-1, c.num_attention_heads, c.head_dim), positions)
        k = self._rope(k.view(-1, c.num_kv_heads, c.head_dim), positions)
        return q, k, v.reshape(-1, c.num_kv_heads, c.head_dim)

    def _mlp(self, layer: torch.nn.Module, h: torch.Tensor) -> torch.Tensor:
        gate, up = (layer.post_norm(h) @ layer.gate_up.t()).chunk(2, dim=-1)
        return self._reduce((F.silu(gate) * up) @ layer.down.t())

    def _attention(
        self, q: torch.Tensor, k_all: torch.Tensor, v_all: torch.Tensor, prefix_len: int
    ) -> torch.Tensor:
        """Causal (bottom-right aligned) GQA attention of ``q`` ``[n, Hq, D]`` over ``[T, H, D]``
        keys and values. fp32 on CPU; the model dtype on CUDA, for SDPA's fused kernels."""
        c = self.config
        n, total = q.shape[0], k_all.shape[0]
        dt = torch.float32 if q.device.type == "cpu" else q.dtype
        # A batch dimension of 1: SDPA's fused kernels take 4-D inputs only (3-D ones fall back
        # to the math kernel, which materializes the fp32 score matrix).
        qf = q.to(dt).transpose(0, 1).unsqueeze(0)  # [1, Hq, n, D]
        kf = k_all.to(dt).transpose(0, 1).unsqueeze(0)  # [1, H, T, D]
        vf = v_all.to(dt).transpose(0, 1).unsqueeze(0)
        global _GQA_OK
        group = c.num_attention_heads // c.num_kv_heads
        mask = causal_lower_right(n, total) if prefix_len > 0 else None
        out = None
        if _GQA_OK and group > 1:
            try:
                out = _sdpa(qf, kf, vf, mask, enable_gqa=True)
            except RuntimeError as exc:  # a kernel path without native GQA: expand instead
                _GQA_OK = False
                logger.warning("SDPA with enable_gqa failed (%s); expanding KV heads", exc)
        if out is None:
            if group > 1:
                kf, vf = kf.repeat_interleave(group, dim=1), vf.repeat_interleave(group, dim=1)
            out = _sdpa(qf, kf, vf, mask)
        return out[0].transpose(0, 1).reshape(n, c.num_attention_heads * c.head_dim)

    @torch.no_grad()
    def forward_reference(self, input_ids: torch.Tensor) -> tuple[torch.Tensor, ...]:
        """Full recompute without a pool (the tests' oracle). Returns ``(logits [n, vocab] fp32,
        *kv)``, one ``[L, n, H, D]`` tensor per pool buffer, as the pool holds it."""
        ids = input_ids.to(self.device)
        n = ids.numel()
        positions = torch.arange(n, dtype=torch.int64, device=self.device)
        caches = []
        h = self.embed[ids]
        for layer in self.layers:
            x = layer.input_norm(h)
            o, cache = self._full_attention(layer, x, positions)
            caches.append(cache)
            h = h + self._reduce(o)
            h = h + self._mlp(layer, h)
        logits = (self.norm(h) @ self.lm_head.t()).float()
        return (logits, *(torch.stack(parts) for parts in zip(*caches, strict=True)))
