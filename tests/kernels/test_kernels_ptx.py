"""The kernels as an H200 would run them, checked on the CPU: every kvcacheio op variant compiled
ahead of time for sm_90 by Triton and its bundled ptxas (``tests/kernels/ptx_variants.py``, in a
child process with the interpreter off), at 2 KiB and 576-byte items, MHA and MLA twins, page_head.

- Data loads and stores are 16 bytes wide on both sides, pointer-table sides included, whenever
  the alignment is known (tables built by ``kernels.data_ptr_table``); a table of unknown
  alignment falls back to 8-byte loads on its side only.
- No register spills, and registers within the budget of the program size (64 at 1024 threads).
- The default grid keeps at least 256 KiB of loads in flight for 2 KiB items (docs/DESIGN.md section
  8), with ``block_quota`` an upper bound on programs: this part needs no ptxas.

Skipped only when Triton's ptxas for sm_90 is absent.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from tests.kernels.ptx_variants import calls, ptxas_path

SIXTEEN_BYTES = re.compile(r"\.(v2\.b64|v4\.b32|b128)$")
VARIANTS = [name for name, _, _ in calls()]


@pytest.fixture(scope="module")
def report(tmp_path_factory: pytest.TempPathFactory) -> dict:
    if ptxas_path() is None:
        pytest.skip("no ptxas for sm_90 in this Triton installation")
    out = tmp_path_factory.mktemp("ptx") / "report.json"
    env = dict(os.environ, TRITON_INTERPRET="0", TRITON_DEFAULT_FP_FUSION="1")
    script = Path(__file__).with_name("ptx_variants.py")
    proc = subprocess.run([sys.executable, str(script), str(out)], env=env, capture_output=True,
                          text=True, timeout=900)  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-4000:]
    return json.loads(out.read_text())


def test_every_variant_compiles(report: dict) -> None:
    assert sorted(report) == sorted(VARIANTS)


@pytest.mark.parametrize("name", VARIANTS)
def test_data_accesses_are_16_bytes_on_both_sides(report: dict, name: str) -> None:
    r = report[name]
    assert r["data_loads"] and r["data_stores"], r
    assert all(SIXTEEN_BYTES.search(op) for op in r["data_stores"]), r["data_stores"]
    if "unverified" in name:  # the narrower variant: 8-byte loads from the unverified side
        assert r["data_loads"] == ["ld.global.cg.b64"], r["data_loads"]
        assert r["hints"] == [0, 16]
    else:
        assert all(SIXTEEN_BYTES.search(op) for op in r["data_loads"]), r["data_loads"]
        assert r["hints"] == [16, 16]


@pytest.mark.parametrize("name", VARIANTS)
def test_no_spills_within_the_register_budget(report: dict, name: str) -> None:
    r = report[name]
    assert r["spill_bytes"] == 0, r
    assert r["registers"] <= 65536 // r["threads"], r


# ---------------------------------------------------------------------------------------------
# Bytes in flight at the default grid (no compiler needed)
# ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize("op", ["per_layer", "per_layer_pf_lf", "all_layer", "all_layer_lf_pf"])
@pytest.mark.parametrize("kv", ["mha", "mla"])
def test_default_grid_keeps_256_kib_in_flight_for_2_kib_items(op: str, kv: str) -> None:
    """2 programs (SGLang's block_quota) of 32 warps, each with one 128 KiB block of loads
    outstanding; fewer items than two blocks simply use fewer programs. With Triton 3.6 a block
    is half as big (``MAX_ROWS_PER_THREAD``: that compiler spills at two rows per thread), so
    128 KiB are in flight there."""
    from hicache_prefill.kernels.ops.dispatch import validate
    from hicache_prefill.kernels.ops.kernel_backend import DEFAULT_BLOCK_QUOTA, DEFAULT_NUM_WARPS
    from hicache_prefill.kernels.triton.launch import MAX_ROWS_PER_THREAD, plan_launch

    (call,) = [c for n, c, _ in calls() if n == f"{op}[{kv},2048B]"]
    call, (part,) = validate(call, DEFAULT_BLOCK_QUOTA, DEFAULT_NUM_WARPS)
    rows = 32 * MAX_ROWS_PER_THREAD  # one 2 KiB row per warp and repetition
    for n_items in (1024, 2 * rows, rows, 1):
        idx = torch.arange(n_items) % 64
        launch = plan_launch(part, idx, idx, layer_begin=call.layer_id, num_layers=1,
                             block_quota=DEFAULT_BLOCK_QUOTA, num_warps=DEFAULT_NUM_WARPS,
                             cache_hints=False)  # fmt: skip
        assert launch.geometry.rows == rows
        assert launch.grid == (min(DEFAULT_BLOCK_QUOTA, -(-n_items // rows)),)
        if n_items >= 2 * rows:
            assert launch.grid[0] * launch.geometry.block_bytes >= MAX_ROWS_PER_THREAD * 128 * 1024


@pytest.mark.parametrize("block_quota", [1, 2, 3, 7, 64])
def test_block_quota_bounds_the_programs(block_quota: int) -> None:
    from hicache_prefill.kernels.ops.dispatch import validate
    from hicache_prefill.kernels.triton.launch import plan_launch

    (call,) = [c for n, c, _ in calls() if n == "per_layer_pf_lf[mha,576B]"]
    call, (part,) = validate(call, block_quota, 32)
    for n_items in (1, 63, 64, 65, 1000, 100_000):
        idx = torch.zeros(n_items, dtype=torch.int64)
        launch = plan_launch(part, idx, idx, layer_begin=1, num_layers=1, block_quota=block_quota,
                             num_warps=32, cache_hints=False)  # fmt: skip
        tiles = -(-n_items // launch.geometry.rows)
        assert launch.grid == (min(block_quota, tiles),)
