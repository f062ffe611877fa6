"""``build_model(args)``: the paged model ``ServerArgs`` describe, on one rank or this rank's
shard under tensor parallelism (the one place that chooses between ``prefill.model.paged`` and
``prefill.model.tp``)."""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING

import torch.distributed as dist

from prefill.model.paged import ModelConfig, PagedTransformer
from prefill.model.tp import TPPagedTransformer

if TYPE_CHECKING:
    from server_args import ServerArgs

logger = logging.getLogger(__name__)


def build_model(args: ServerArgs) -> PagedTransformer:
    """The model described by ``args`` on ``args.resolved_device()`` (weights from the seed).
    With ``tp_size > 1``: this rank's ``TPPagedTransformer`` (``prefill.model.tp``), its rank
    and model group the initialized default process group's, which must have ``tp_size``
    ranks."""
    config = ModelConfig.from_server_args(args)
    tp_size = getattr(args, "tp_size", 1)
    if tp_size > 1:
        if not dist.is_initialized() or dist.get_world_size() != tp_size:
            world = dist.get_world_size() if dist.is_initialized() else None
            raise ValueError(
                f"tp_size: --tp-size={tp_size} needs an initialized default process group of "
                f"that many ranks (world size {world})"
            )
        return TPPagedTransformer(config, dist.get_rank(), tp_size, device=args.resolved_device())
    model = PagedTransformer(config, args.resolved_device())
    logger.info(
        "model %s: %d layers, %d/%d heads x %d, hidden %d, %s, seed %d",
        getattr(args, "model_preset", "?"), config.num_layers, config.num_attention_heads,
        config.num_kv_heads, config.head_dim, config.hidden_size, config.dtype, config.seed,
    )
    return model
