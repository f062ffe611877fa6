"""The MLA model split across tensor-parallel ranks, as SGLang splits DeepSeek's attention:
each rank holds its query heads (rows of ``q_proj`` / ``q_b`` and ``kv_b``, columns of ``o``)
and **the whole latent** (``kv_a`` replicated, so every rank's MLA pool holds all of it); the
rest as ``prefill.model.tp``. ``tp_size`` must divide ``num_attention_heads`` and
``intermediate_size`` (``ValueError`` naming ``tp_size``).
"""

from __future__ import annotations

import torch

from prefill.model.mla import MLATransformer
from prefill.model.tp import TPPagedTransformer, keep_param


class TPMLATransformer(TPPagedTransformer, MLATransformer):
    """One rank's part of ``MLATransformer(config)``: ``TPPagedTransformer``'s construction,
    all-reduce and ``config`` / ``full_config`` (``config.num_attention_heads`` is this rank's),
    with MLA's attention sharded by query head (see the module docstring)."""

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
