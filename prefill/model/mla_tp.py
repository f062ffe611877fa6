"""The MLA model split across tensor-parallel ranks, as SGLang splits DeepSeek's attention.

Rank ``r`` of ``tp_size`` holds (``TPShard.plan`` with the latent as the one KV head):

- its query heads: rows of ``q_proj`` (or of ``q_b``; ``q_a`` and its norm are replicated) and
  of ``kv_b`` (each head's non-rotary key and value expansion), columns of ``o`` (row-parallel:
  its partial output is all-reduced);
- **the whole latent**: ``kv_a`` and its norm are replicated, so every rank computes the same
  ``[c, rope(k_pe)]`` for every token and its MLA pool (and host pool) holds all of it, ``C``
  values per token and layer (SGLang's MLA pools are not split by TP either);
- the MLP, embedding, norms and LM head as ``prefill.model.tp``.

``tp_size`` must divide ``num_attention_heads`` and ``intermediate_size`` (``ValueError`` naming
``tp_size`` otherwise); there is no KV-head condition. Weights: every rank draws the full model
from the seed and keeps its slice, so the TP model computes the single-rank model's function
(logits equal up to the order of the partial sums); ``forward_extend`` / ``forward_reference``
are collective, as ``TPPagedTransformer``'s.
"""

from __future__ import annotations

import logging

import torch

from prefill.model.mla import MLATransformer
from prefill.model.tp import TPPagedTransformer, keep_param

__all__ = ["TPMLATransformer"]

logger = logging.getLogger(__name__)


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
