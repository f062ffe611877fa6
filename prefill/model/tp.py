"""The paged transformer split across tensor-parallel ranks (Megatron-style, as SGLang's
``QKVParallelLinear`` / ``MergedColumnParallelLinear`` / ``RowParallelLinear``): each rank
holds its query and KV heads and its MLP slice; row-parallel outputs are all-reduced on the
model group (not the cache's agreement group). With ``tp_size > num_kv_heads`` KV heads are
replicated, as SGLang does. Every rank draws the full model from the seed and keeps its slice.
"""

from __future__ import annotations

import dataclasses
import logging
from dataclasses import dataclass
from typing import Any

import torch

from hicache_prefill.prefill.model.paged import ModelConfig, PagedTransformer
from hicache_prefill.server_args import tp_geometry_errors

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class TPShard:
    """What rank ``tp_rank`` of ``tp_size`` holds of a model; ranges are ``[start, end)``."""

    tp_rank: int
    tp_size: int
    q_heads: tuple[int, int]
    kv_heads: tuple[int, int]
    intermediate: tuple[int, int]
    kv_replicas: int

    @classmethod
    def plan(cls, config: ModelConfig, tp_rank: int, tp_size: int) -> TPShard:
        """``ValueError`` for a geometry that cannot be split ``tp_size`` ways."""
        if tp_size < 1:
            raise ValueError(f"tp_size must be >= 1, got {tp_size}")
        if not 0 <= tp_rank < tp_size:
            raise ValueError(f"tp_rank must be in [0, {tp_size}), got {tp_rank}")
        c = config
        hq, hkv, inter = c.num_attention_heads, c.num_kv_heads, c.intermediate_size
        errors = tp_geometry_errors(tp_size, hq, hkv, inter)
        if errors:
            raise ValueError(errors[0])
        q_per = hq // tp_size
        if tp_size <= hkv:
            kv_per, replicas = hkv // tp_size, 1
            kv0 = tp_rank * kv_per
        else:
            kv_per, replicas = 1, tp_size // hkv
            kv0 = tp_rank // replicas
        i_per = inter // tp_size
        return cls(
            tp_rank=tp_rank,
            tp_size=tp_size,
            q_heads=(tp_rank * q_per, (tp_rank + 1) * q_per),
            kv_heads=(kv0, kv0 + kv_per),
            intermediate=(tp_rank * i_per, (tp_rank + 1) * i_per),
            kv_replicas=replicas,
        )

    def local_config(self, config: ModelConfig) -> ModelConfig:
        """``config`` with this rank's head counts and intermediate size."""
        return dataclasses.replace(
            config,
            num_attention_heads=self.q_heads[1] - self.q_heads[0],
            num_kv_heads=self.kv_heads[1] - self.kv_heads[0],
            intermediate_size=self.intermediate[1] - self.intermediate[0],
        )


def keep_param(t: torch.Tensor) -> torch.nn.Parameter:
    """A contiguous copy of the slice ``t`` (the full draw is freed)."""
    return torch.nn.Parameter(t.contiguous().clone(), requires_grad=False)


class TPPagedTransformer(PagedTransformer):
    """One rank's part of ``PagedTransformer(config)``: ``config`` is this rank's geometry,
    ``full_config`` the whole model's. The forwards are collective (same order, same batch)."""

    def __init__(
        self,
        config: ModelConfig,
        tp_rank: int,
        tp_size: int,
        group: Any = None,
        device: torch.device | str = "cpu",
    ) -> None:
        shard = TPShard.plan(config, tp_rank, tp_size)
        super().__init__(config, device)
        self.full_config = config
        self.shard = shard
        self.group = group
        self._shard_weights()
        self.config = shard.local_config(config)
        logger.info(
            "tp rank %d/%d: query heads %s, KV heads %s (x%d replicas), intermediate %s",
            tp_rank,
            tp_size,
            shard.q_heads,
            shard.kv_heads,
            shard.kv_replicas,
            shard.intermediate,
        )

    @property
    def local_kv_heads(self) -> int:
        return self.shard.kv_heads[1] - self.shard.kv_heads[0]

    def _shard_weights(self) -> None:
        c, s = self.full_config, self.shard
        inter, (i0, i1) = c.intermediate_size, s.intermediate
        for layer in self.layers:
            self._shard_attention(layer)
            gate, up = layer.gate_up.split([inter, inter], dim=0)
            layer.gate_up = keep_param(torch.cat([gate[i0:i1], up[i0:i1]]))
            layer.down = keep_param(layer.down[:, i0:i1])

    def _shard_attention(self, layer: torch.nn.Module) -> None:
        c, s = self.full_config, self.shard
        d, hid = c.head_dim, c.hidden_size
        q_dim, kv_dim = c.num_attention_heads * d, c.num_kv_heads * d
        (q0, q1), (k0, k1) = s.q_heads, s.kv_heads
        q, k, v = layer.qkv.split([q_dim, kv_dim, kv_dim], dim=0)
        layer.qkv = keep_param(
            torch.cat(
                [
                    q.view(-1, d, hid)[q0:q1].reshape(-1, hid),
                    k.view(-1, d, hid)[k0:k1].reshape(-1, hid),
                    v.view(-1, d, hid)[k0:k1].reshape(-1, hid),
                ]
            )
        )
        layer.o = keep_param(layer.o.view(hid, -1, d)[:, q0:q1].reshape(hid, -1))

    def _reduce(self, partial: torch.Tensor) -> torch.Tensor:
        if self.shard.tp_size == 1:
            return partial
        import torch.distributed as dist

        partial = partial.contiguous()
        dist.all_reduce(partial, group=self.group)
        return partial
