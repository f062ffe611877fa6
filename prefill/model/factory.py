"""``build_model(args)``: the model ``ServerArgs`` describe (GQA, or MLA with ``--use-mla``),
on one rank or this rank's shard under tensor parallelism."""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING

import torch.distributed as dist

from hicache_prefill.prefill.model.mla import MLAConfig, MLATransformer
from hicache_prefill.prefill.model.mla_tp import TPMLATransformer
from hicache_prefill.prefill.model.paged import ModelConfig, PagedTransformer
from hicache_prefill.prefill.model.tp import TPPagedTransformer

if TYPE_CHECKING:
    from hicache_prefill.server_args import ServerArgs

logger = logging.getLogger(__name__)


def model_config(args: ServerArgs) -> ModelConfig:
    if getattr(args, "use_mla", False):
        return MLAConfig.from_server_args(args)
    return ModelConfig.from_server_args(args)


def build_model(args: ServerArgs) -> PagedTransformer:
    """With ``tp_size > 1``: this rank's shard, on the default process group (which must have
    ``tp_size`` ranks)."""
    config = model_config(args)
    mla = isinstance(config, MLAConfig)
    tp_size = getattr(args, "tp_size", 1)
    if tp_size > 1:
        if not dist.is_initialized() or dist.get_world_size() != tp_size:
            world = dist.get_world_size() if dist.is_initialized() else None
            raise ValueError(
                f"tp_size: --tp-size={tp_size} needs an initialized default process group of "
                f"that many ranks (world size {world})"
            )
        cls = TPMLATransformer if mla else TPPagedTransformer
        return cls(config, dist.get_rank(), tp_size, device=args.resolved_device())
    model = (MLATransformer if mla else PagedTransformer)(config, args.resolved_device())
    logger.info("model %s: %s", getattr(args, "model_preset", "?"), config)
    return model
