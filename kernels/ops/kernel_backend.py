"""SGLang's kernel-backend ``kvcacheio`` ops as a table of op specs, and the builder that turns
it into the 11 functions with upstream's exact names, parameters, order and defaults; each hands
a :class:`kernels.layout.addressing.KVCopy` to a runner (Triton launcher or torch reference).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

from hicache_prefill.kernels.layout.addressing import (
    LF_TO_LF,
    LF_TO_PF,
    PF_TO_LF,
    PH_TO_LF,
    TABLE_TO_PF,
    TABLE_TO_PH,
    TABLE_TO_TABLE,
    Addressing,
    KVCopy,
    buffer_names,
)

DEFAULT_BLOCK_QUOTA = 2
DEFAULT_NUM_WARPS = 16 if torch.version.hip is not None else 32

Runner = Callable[[KVCopy, int, int], None]  # (call, block_quota, num_warps_per_block)


@dataclass(frozen=True)
class OpSpec:
    """One op; ``scalars``: upstream's int parameters after the indices, in order."""

    name: str
    how: Addressing
    mla: bool
    scalars: str  # space-separated


_PH = "page_size head_num"

OP_SPECS: tuple[OpSpec, ...] = (
    OpSpec("transfer_kv_per_layer", LF_TO_LF, False, "item_size"),
    OpSpec("transfer_kv_per_layer_pf_lf", PF_TO_LF, False, "layer_id item_size src_layout_dim"),
    OpSpec(
        "transfer_kv_per_layer_ph_lf", PH_TO_LF, False, f"layer_id item_size src_layout_dim {_PH}"
    ),
    OpSpec("transfer_kv_all_layer", TABLE_TO_TABLE, False, "item_size num_layers"),
    OpSpec(
        "transfer_kv_all_layer_lf_pf", TABLE_TO_PF, False, "item_size dst_layout_dim num_layers"
    ),
    OpSpec(
        "transfer_kv_all_layer_lf_ph",
        TABLE_TO_PH,
        False,
        f"item_size dst_layout_dim num_layers {_PH}",
    ),
    OpSpec("transfer_kv_per_layer_mla", LF_TO_LF, True, "item_size"),
    OpSpec("transfer_kv_per_layer_mla_pf_lf", PF_TO_LF, True, "layer_id item_size src_layout_dim"),
    OpSpec("transfer_kv_per_layer_mla_lf_pf", LF_TO_PF, True, "layer_id item_size dst_layout_dim"),
    OpSpec("transfer_kv_all_layer_mla", TABLE_TO_TABLE, True, "item_size num_layers"),
    OpSpec(
        "transfer_kv_all_layer_mla_lf_pf", TABLE_TO_PF, True, "item_size dst_layout_dim num_layers"
    ),
)

# KVCopy's field for each scalar parameter (the one layout_dim is the page_first/page_head side's).
_FIELDS = {"src_layout_dim": "layout_dim", "dst_layout_dim": "layout_dim"}


def build_ops(run: Runner, module: str) -> dict[str, Callable[..., None]]:
    return {spec.name: _build(spec, run, module) for spec in OP_SPECS}


def _build(spec: OpSpec, run: Runner, module: str) -> Callable[..., None]:
    src = buffer_names("src", spec.how.src, 1 if spec.mla else 2)
    dst = buffer_names("dst", spec.how.dst, 1 if spec.mla else 2)
    buffers = [name for pair in zip(src, dst, strict=True) for name in pair]
    params = [
        *(f"{name}: torch.Tensor" for name in (*buffers, "src_indices", "dst_indices")),
        *(f"{name}: int" for name in spec.scalars.split()),
        "block_quota: int = DEFAULT_BLOCK_QUOTA",
        "num_warps_per_block: int = DEFAULT_NUM_WARPS",
    ]
    fields = "".join(f"{_FIELDS.get(name, name)}={name}, " for name in spec.scalars.split())
    source = (
        f"def {spec.name}({', '.join(params)}) -> None:\n"
        f"    run(KVCopy(how, ({', '.join(src)},), ({', '.join(dst)},), src_indices, dst_indices,"
        f" {fields}op={spec.name!r}), block_quota, num_warps_per_block)\n"
    )
    namespace = {
        "run": run,
        "how": spec.how,
        "KVCopy": KVCopy,
        "torch": torch,
        "DEFAULT_BLOCK_QUOTA": DEFAULT_BLOCK_QUOTA,
        "DEFAULT_NUM_WARPS": DEFAULT_NUM_WARPS,
    }
    exec(source, namespace)  # noqa: S102 - built from the table above only
    fn = namespace[spec.name]
    fn.__module__ = module
    kind = "MLA latent" if spec.mla else "K and V"
    layers = "all layers" if spec.how.all_layers else "one layer"
    fn.__doc__ = (
        f"SGLang's ``{spec.name}``: ``dst[dst_indices[i]] = src[src_indices[i]]`` ({kind}, "
        f"{spec.how.src} -> {spec.how.dst}, {layers}). Mutates the destination only."
    )
    return fn
