"""Compile every kernel-backend kvcacheio variant ahead of time for sm_90 and measure its PTX.

No GPU is needed: Triton's compiler and its bundled ptxas run on the CPU. Each op is called the
way a CUDA pool calls it (pointer tables from ``kernels.data_ptr_table``, so their alignment is
verified; one extra variant with an unverified table records the fallback), validated and
planned by the real code path (:func:`kernels.ops.dispatch.validate`,
:func:`kernels.triton.launch.plan_launch` with the CUDA cache hints), then compiled with Triton's
own argument specialization (what a launch on the GPU would compile). For each variant:

- the data loads and stores (the ``.cg`` accesses: index and table loads carry no cache hint),
- registers and spill bytes from ``ptxas -v`` (the same ptxas and options Triton uses),
- the tile geometry and the bytes a program keeps in flight.

Run as a script, with ``TRITON_INTERPRET=0`` so the kernels are JIT functions:
``TRITON_INTERPRET=0 python tests/kernels/ptx_variants.py OUT.json``;
``tests/kernels/test_kernels_ptx.py`` does.
"""

from __future__ import annotations

import dataclasses
import json
import os
import re
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

import torch  # noqa: E402

ITEM_SIZES = (2048, 576)  # one token-layer of an 8B model (bf16), and a 576-byte MLA latent
LAYERS, SLOTS, PAGE = 4, 64, 16


def ptxas_path() -> str | None:
    """The ptxas Triton uses for sm_90 (bundled under ``triton/backends/nvidia/bin``)."""
    try:
        from triton.backends.nvidia.compiler import get_ptxas

        path = get_ptxas(90).path
    except Exception:  # noqa: BLE001 - no NVIDIA backend, or no ptxas found
        return None
    return path if path and os.path.exists(path) else None


def calls():  # noqa: ANN201 - a list of (name, KVCopy, unverified_tables)
    """Every kernel-backend op (MHA and MLA twins, page_head) at each item size."""
    from hicache_prefill import kernels
    from hicache_prefill.kernels.layout import addressing as a

    out = []
    for item in ITEM_SIZES:
        heads = 8 if item == 2048 else 4  # page_head: 256- and 144-byte head chunks
        z = lambda *shape: torch.zeros(*shape, dtype=torch.uint8)  # noqa: E731
        lf = [z(SLOTS, item) for _ in range(2)]
        pf = [z(SLOTS, LAYERS, item) for _ in range(2)]
        ph = [z(SLOTS // PAGE, heads, PAGE, LAYERS, item // heads) for _ in range(2)]
        dev = [z(LAYERS, SLOTS, item) for _ in range(2)]
        host = [z(LAYERS, SLOTS, item) for _ in range(2)]
        tbl = [kernels.data_ptr_table(list(t), "cpu") for t in dev]
        htbl = [kernels.data_ptr_table(list(t), "cpu") for t in host]
        idx = torch.arange(SLOTS)
        dim = item * LAYERS
        ph_geometry = dict(page_size=PAGE, head_num=heads)
        specs = [  # name, addressing, source, destination, arguments, K+V (2) and/or MLA (1)
            ("per_layer", a.LF_TO_LF, lf, lf, {}, (2, 1)),
            ("per_layer_pf_lf", a.PF_TO_LF, pf, lf, dict(layout_dim=dim, layer_id=1), (2, 1)),
            ("per_layer_lf_pf", a.LF_TO_PF, lf, pf, dict(layout_dim=dim, layer_id=2), (1,)),
            ("per_layer_ph_lf", a.PH_TO_LF, ph, lf,
             dict(layout_dim=dim, layer_id=1, **ph_geometry), (2,)),
            ("all_layer", a.TABLE_TO_TABLE, tbl, htbl, dict(num_layers=LAYERS), (2, 1)),
            ("all_layer_lf_pf", a.TABLE_TO_PF, tbl, pf,
             dict(layout_dim=dim, num_layers=LAYERS), (2, 1)),
            ("all_layer_lf_ph", a.TABLE_TO_PH, tbl, ph,
             dict(layout_dim=dim, num_layers=LAYERS, **ph_geometry), (2,)),
        ]  # fmt: skip
        for name, how, src, dst, kw, kinds in specs:
            for kv in kinds:
                call = a.KVCopy(how, tuple(src[:kv]), tuple(dst[:kv]), idx, idx, item, **kw)
                out.append((f"{name}[{'mha' if kv == 2 else 'mla'},{item}B]", call, False))
        # A table built elsewhere and never verified (on CUDA it cannot be read for free).
        out.append((f"all_layer_unverified_src[mla,{item}B]",
                    a.KVCopy(a.TABLE_TO_TABLE, (tbl[0],), (htbl[0],), idx, idx, item,
                             num_layers=LAYERS), True))  # fmt: skip
    return out


def compile_variant(call, unverified: bool, ptxas: str) -> dict:  # noqa: ANN001
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.backends.nvidia.compiler import sm_arch_from_capability
    from triton.compiler import ASTSource, make_backend
    from triton.runtime.jit import create_function_from_signature

    from hicache_prefill.kernels.ops.dispatch import validate
    from hicache_prefill.kernels.ops.kernel_backend import DEFAULT_BLOCK_QUOTA, DEFAULT_NUM_WARPS
    from hicache_prefill.kernels.triton.copy_kernel import kv_copy_kernel
    from hicache_prefill.kernels.triton.launch import plan_launch

    call, parts = validate(call, DEFAULT_BLOCK_QUOTA, DEFAULT_NUM_WARPS)
    (part,) = parts
    if unverified:
        part = dataclasses.replace(part, src=dataclasses.replace(part.src, table_align=(0,)))
    launch = plan_launch(
        part, call.src_indices, call.dst_indices, layer_begin=call.layer_id,
        num_layers=call.num_layers, block_quota=DEFAULT_BLOCK_QUOTA,
        num_warps=DEFAULT_NUM_WARPS, cache_hints=True,
    )  # fmt: skip
    target = GPUTarget("cuda", 90, 32)
    backend = make_backend(target)
    kernel = kv_copy_kernel
    kwargs = dict(launch.constexprs, num_warps=launch.num_warps)
    binder = create_function_from_signature(kernel.signature, kernel.params, backend)
    bound, spec, opts = binder(*launch.args, **kwargs)
    options, signature, constexprs, attrs = kernel._pack_args(backend, kwargs, bound, spec, opts)
    compiled = triton.compile(ASTSource(kernel, signature, constexprs, attrs), target=target,
                              options=options.__dict__)  # fmt: skip
    ptx = compiled.asm["ptx"]
    with tempfile.TemporaryDirectory() as tmp:
        src = Path(tmp) / "k.ptx"
        src.write_text(ptx)
        log = subprocess.run(
            [ptxas, "-lineinfo", "-v", "--regAllocOptLevel=2",
             f"--gpu-name={sm_arch_from_capability(90)}", str(src), "-o", str(Path(tmp) / "k.o")],
            capture_output=True, text=True, check=True,
        ).stderr  # fmt: skip
    spills = [int(n) for n in re.findall(r"(\d+) bytes spill (?:stores|loads)", log)]
    g = launch.geometry
    return {
        "data_loads": sorted(set(re.findall(r"ld\.global\.cg[\w.]*", ptx))),
        "data_stores": sorted(set(re.findall(r"st\.global\.cg[\w.]*", ptx))),
        "registers": int(re.search(r"Used (\d+) registers", log).group(1)),
        "spill_bytes": sum(spills),
        "threads": launch.num_warps * 32,
        "word": g.word,
        "rows": g.rows,
        "block_bytes": g.block_bytes,
        "grid_max": DEFAULT_BLOCK_QUOTA,
        "hints": [g.src_align, g.dst_align],
    }


def main(out_path: str) -> None:
    ptxas = ptxas_path()
    assert ptxas is not None, "no ptxas for sm_90"
    report = {name: compile_variant(call, unverified, ptxas) for name, call, unverified in calls()}
    Path(out_path).write_text(json.dumps(report, indent=1, sort_keys=True))


if __name__ == "__main__":
    if os.environ.get("TRITON_INTERPRET", "0") not in ("", "0"):
        raise SystemExit("run with TRITON_INTERPRET=0: interpreted kernels cannot be compiled")
    main(sys.argv[1])
