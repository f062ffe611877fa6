"""One compiled kernel per pool geometry: what Triton specializes ``kv_copy_kernel`` on.

Keys are computed with Triton's own binder for an sm_90 target (``tests/support/triton_keys.py``),
the key a CUDA launch looks its compiled kernel up by. Index tensors are slices of an allocator's
free list or of a request's slot list, so they start at any multiple of 8 bytes: the kernel must
not be specialized on their alignment, or a misaligned slice would compile a new variant on the
scheduler thread (and a warm-up would have to launch every alignment combination).
"""

from __future__ import annotations

import pytest
import torch

from hicache_prefill import kernels
from hicache_prefill.kernels.layout import addressing as a
from hicache_prefill.kernels.ops.dispatch import validate
from hicache_prefill.kernels.triton.launch import plan_launch
from tests.support.triton_keys import available, launch_key

pytestmark = pytest.mark.skipif(not available(), reason="Triton has no NVIDIA backend here")

L, T, ITEM = 3, 32, 64


def _calls():
    lf = [torch.zeros(T, ITEM, dtype=torch.uint8) for _ in range(2)]
    dev = [torch.zeros(L, T, ITEM, dtype=torch.uint8) for _ in range(2)]
    pf = [torch.zeros(T, L, ITEM, dtype=torch.uint8) for _ in range(2)]
    tables = [kernels.data_ptr_table(list(t), "cpu") for t in dev]
    return {
        "per_layer": lambda i, j: a.KVCopy(a.LF_TO_LF, tuple(lf), tuple(lf), i, j, ITEM),
        "all_layer_lf_pf": lambda i, j: a.KVCopy(
            a.TABLE_TO_PF, tuple(tables), tuple(pf), i, j, ITEM, layout_dim=ITEM * L,
            num_layers=L,
        ),
    }  # fmt: skip


def _key(call: a.KVCopy) -> str:
    call, (part,) = validate(call, 2, 4)
    launch = plan_launch(part, call.src_indices, call.dst_indices, layer_begin=call.layer_id,
                         num_layers=call.num_layers, block_quota=2, num_warps=4,
                         cache_hints=True)  # fmt: skip
    return launch_key(*launch.args, **launch.constexprs, num_warps=launch.num_warps)


def _index_pair(offset_src: int, offset_dst: int) -> tuple[torch.Tensor, torch.Tensor]:
    base = torch.arange(64, dtype=torch.int64)
    start = 0 if base.data_ptr() % 16 == 0 else 1
    src = base[start + offset_src // 8 : start + offset_src // 8 + 8]
    dst = base[start + offset_dst // 8 : start + offset_dst // 8 + 8]
    assert (src.data_ptr() % 16, dst.data_ptr() % 16) == (offset_src, offset_dst)
    return src, dst


@pytest.mark.parametrize("op", ["per_layer", "all_layer_lf_pf"])
def test_index_alignment_does_not_change_the_compiled_kernel(op: str) -> None:
    make = _calls()[op]
    keys = {_key(make(*_index_pair(s, d))) for s in (0, 8) for d in (0, 8)}
    assert len(keys) == 1


def test_the_key_sees_what_triton_does_specialize_on() -> None:
    """Control: data pointer alignment and an argument equal to 1 do change the key."""
    src, dst = _index_pair(0, 0)
    call, (part,) = validate(_calls()["per_layer"](src, dst), 2, 4)
    launch = plan_launch(part, src, dst, layer_begin=0, num_layers=1, block_quota=2,
                         num_warps=4, cache_hints=True)  # fmt: skip
    base = launch_key(*launch.args, **launch.constexprs, num_warps=4)
    args = list(launch.args)
    args[0] = args[0][1:]  # src_k one word further: no longer 16-byte aligned
    assert launch_key(*args, **launch.constexprs, num_warps=4) != base
    args = list(launch.args)
    args[8] = 2  # n_layers: 1 is specialized as a constant
    assert launch_key(*args, **launch.constexprs, num_warps=4) != base
    args = list(launch.args)
    args[6] = 7  # n_items is not specialized
    assert launch_key(*args, **launch.constexprs, num_warps=4) == base
