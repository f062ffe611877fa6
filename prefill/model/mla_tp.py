"""The MLA model split across tensor-parallel ranks, as SGLang splits DeepSeek's attention:
each rank holds its query heads and the whole latent (``kv_a`` replicated); the rest as
``prefill.model.tp``."""

from __future__ import annotations

import torch

from hicache_prefill.prefill.model.mla import MLATransformer
from hicache_prefill.prefill.model.tp import TPPagedTransformer, keep_param


class TPMLATransformer(TPPagedTransformer, MLATransformer):
    """One rank's part of ``MLATransformer(config)``, attention sharded by query head."""

    def _shard_attention(self, layer: torch.nn.Module) -> None:
        c, (q0, q1) = self.full_config, self.shard.q_heads
        heads = c.num_attention_heads

        def rows(t: torch.Tensor, per_head: int) -> torch.nn.Parameter:
            return keep_param(t.view(heads, per_head, -1)[q0:q1].reshape(-1, t.shape[1]))

        if c.q_lora_rank:
            layer.q_b = rows(layer.q_b, c.qk_head_dim)
        else:
            layer.q_proj = rows(layer.q_proj, c.qk_head_dim)
        layer.kv_b = rows(layer.kv_b, c.qk_nope_head_dim + c.v_head_dim)
        hid = c.hidden_size
        layer.o = keep_param(layer.o.view(hid, heads, c.v_head_dim)[:, q0:q1].reshape(hid, -1))
