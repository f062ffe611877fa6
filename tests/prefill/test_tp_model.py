"""The tensor-parallel paged model equals the single-rank model: logits on every rank and each
rank's KV shard, at 2 ranks (KV heads split) and 4 ranks (KV heads replicated), run in real
processes over gloo.

Tolerance (fp32, tiny model): logits atol/rtol 1e-4, KV 1e-5, as tests/prefill/test_model.py; the
differences come from the order of the partial sums over ranks (observed ~1e-6).
"""

from __future__ import annotations

import pytest
import torch

from hicache_prefill.hicache.memory.allocator import TokenToKVPoolAllocator
from hicache_prefill.hicache.memory.device_pool import MHATokenToKVPool
from hicache_prefill.prefill.model.paged import ExtendInput, ModelConfig, PagedTransformer
from hicache_prefill.prefill.model.tp import TPPagedTransformer, TPShard
from tests.support.harness import single_torch_thread
from tests.support.tp_harness import run_ranks

LOGIT_TOL = dict(atol=1e-4, rtol=1e-4)
KV_TOL = dict(atol=1e-5, rtol=1e-5)
PAGE = 4


def tokens(n: int, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, 512, (n,), generator=g, dtype=torch.int64)


def run_story(model: PagedTransformer, kv_heads: int) -> dict[str, torch.Tensor]:
    """The same steps on any model: a one-shot prefill of A, B reading A's 16 cached tokens and
    adding 9 in two chunks, then a batch of two fresh requests. Returns every logit and the
    pool's K/V at every slot used, ``[L, n, H, D]`` (``H = kv_heads``)."""
    c = model.config
    pool = MHATokenToKVPool(128, PAGE, c.dtype, kv_heads, c.head_dim, c.num_layers, "cpu")
    alloc = TokenToKVPoolAllocator(128, PAGE, "cpu")

    def slots(n: int) -> torch.Tensor:
        s = alloc.alloc((n + PAGE - 1) // PAGE * PAGE)
        assert s is not None
        return s[:n]

    a, b_tail = tokens(16, 1), tokens(9, 2)
    c1, c2 = tokens(7, 3), tokens(12, 4)
    sa, sb, s1, s2 = slots(16), slots(9), slots(7), slots(12)
    out: dict[str, torch.Tensor] = {}
    out["a"] = model.forward_extend(pool, [ExtendInput(a, sa, 0)], return_all_logits=True)[0]
    sab = torch.cat([sa, sb])
    out["b1"] = model.forward_extend(pool, [ExtendInput(b_tail[:4], sab[:20], 16)])[0]
    out["b2"] = model.forward_extend(
        pool, [ExtendInput(b_tail[4:], sab, 20)], return_all_logits=True
    )[0]
    l1, l2 = model.forward_extend(pool, [ExtendInput(c1, s1, 0), ExtendInput(c2, s2, 0)])
    out["c1"], out["c2"] = l1, l2
    out["ref_logits"], out["ref_k"], out["ref_v"] = model.forward_reference(torch.cat([a, b_tail]))
    used = torch.cat([sab, s1, s2])
    out["k"] = torch.stack([pool.k_buffer[i][used] for i in range(c.num_layers)])
    out["v"] = torch.stack([pool.v_buffer[i][used] for i in range(c.num_layers)])
    return out


def _tp_rank_story(
    rank: int, world_size: int, dtypes: list[torch.dtype]
) -> dict[torch.dtype, dict[str, torch.Tensor]]:
    """One rank, per dtype: the TP model over the default (gloo) group, its own pool of its KV
    heads."""
    runs = {}
    for dtype in dtypes:
        model = TPPagedTransformer(ModelConfig.tiny(seed=5, dtype=dtype), rank, world_size)
        assert model.local_kv_heads == model.config.num_kv_heads
        out = run_story(model, model.local_kv_heads)
        out["kv_heads"] = torch.tensor(model.shard.kv_heads)
        runs[dtype] = out
    return runs


DTYPES = {2: [torch.float32, torch.bfloat16], 4: [torch.float32]}


@pytest.fixture(scope="module")
def tp_runs() -> dict[int, list[dict[torch.dtype, dict[str, torch.Tensor]]]]:
    """One multi-process run per world size, shared by the tests below (spawns are costly)."""
    return {}


def tp_run(tp_runs: dict, world_size: int) -> list[dict[torch.dtype, dict[str, torch.Tensor]]]:
    if world_size not in tp_runs:
        tp_runs[world_size] = run_ranks(_tp_rank_story, world_size, DTYPES[world_size])
    return tp_runs[world_size]


def single_rank_story(dtype: torch.dtype) -> dict[str, torch.Tensor]:
    with single_torch_thread():
        model = PagedTransformer(ModelConfig.tiny(seed=5, dtype=dtype))
        return run_story(model, model.config.num_kv_heads)


@pytest.mark.parametrize("world_size", [2, 4])
def test_tp_model_equals_single_rank_model(world_size, tp_runs):
    """Every rank's logits equal the single-rank model's (and each other's, bit for bit); each
    rank's pool holds exactly its KV heads of the single-rank pool's content."""
    single = single_rank_story(torch.float32)
    ranks = [run[torch.float32] for run in tp_run(tp_runs, world_size)]
    logit_keys = ("a", "b1", "b2", "c1", "c2", "ref_logits")
    for r, out in enumerate(ranks):
        for key in logit_keys:
            torch.testing.assert_close(out[key], single[key], **LOGIT_TOL, msg=f"{r} {key}")
            assert torch.equal(out[key], ranks[0][key]), f"rank {r} {key} differs from rank 0"
        h0, h1 = out["kv_heads"].tolist()
        assert out["k"].shape[2] == h1 - h0
        for key in ("k", "v", "ref_k", "ref_v"):
            torch.testing.assert_close(
                out[key], single[key][:, :, h0:h1], **KV_TOL, msg=f"rank {r} {key}"
            )
    covered = sorted({tuple(o["kv_heads"].tolist()) for o in ranks})
    assert covered == [(0, 1), (1, 2)]  # both KV heads held (split at 2, replicated at 4)


def test_tp_model_bf16_close_to_single_rank(tp_runs):
    """bf16 (the GPU dtype) over gloo at 2 ranks: bf16 rounding tolerance (atol 5e-2)."""
    single = single_rank_story(torch.bfloat16)
    for run in tp_run(tp_runs, 2):
        out = run[torch.bfloat16]
        h0, h1 = out["kv_heads"].tolist()
        for key in ("a", "b2", "c1", "c2"):
            torch.testing.assert_close(out[key], single[key], atol=5e-2, rtol=5e-2)
        torch.testing.assert_close(out["k"], single["k"][:, :, h0:h1], atol=5e-2, rtol=5e-2)


# ---------------------------------------------------------------- shard plans (one process)
def test_shard_plan_splits_heads_and_columns():
    c = ModelConfig.tiny()
    plans = [TPShard.plan(c, r, 2) for r in range(2)]
    assert [p.q_heads for p in plans] == [(0, 2), (2, 4)]
    assert [p.kv_heads for p in plans] == [(0, 1), (1, 2)]
    assert [p.intermediate for p in plans] == [(0, 64), (64, 128)]
    assert all(p.kv_replicas == 1 for p in plans)
    local = plans[1].local_config(c)
    assert (local.num_attention_heads, local.num_kv_heads, local.intermediate_size) == (2, 1, 64)


def test_shard_plan_replicates_kv_heads_beyond_num_kv_heads():
    """tp_size 4 > 2 KV heads: each KV head on 2 consecutive ranks, whose query heads are in
    that head's group (query head i uses KV head i // 4 with 8 query heads)."""
    c = ModelConfig(num_attention_heads=8, num_kv_heads=2, intermediate_size=128)
    plans = [TPShard.plan(c, r, 4) for r in range(4)]
    assert [p.kv_heads for p in plans] == [(0, 1), (0, 1), (1, 2), (1, 2)]
    assert all(p.kv_replicas == 2 for p in plans)
    for p in plans:
        group = c.num_attention_heads // c.num_kv_heads
        assert {q // group for q in range(*p.q_heads)} == {p.kv_heads[0]}


@pytest.mark.parametrize(
    "kw,tp_size,match",
    [
        (dict(num_attention_heads=12, num_kv_heads=6), 4, "num_kv_heads=6"),
        (dict(num_attention_heads=4, num_kv_heads=2), 3, "num_attention_heads=4"),
        (dict(intermediate_size=130), 4, "intermediate_size=130"),
    ],
)
def test_shard_plan_rejects_indivisible_geometry(kw, tp_size, match):
    with pytest.raises(ValueError, match=f"tp_size={tp_size}.*{match}"):
        TPShard.plan(ModelConfig(**kw), 0, tp_size)


def test_shard_plan_rejects_bad_rank_and_size():
    with pytest.raises(ValueError, match="tp_size"):
        TPShard.plan(ModelConfig.tiny(), 0, 0)
    with pytest.raises(ValueError, match="tp_rank"):
        TPShard.plan(ModelConfig.tiny(), 2, 2)


def test_tp_size_one_is_the_single_rank_model():
    with single_torch_thread():
        full = PagedTransformer(ModelConfig.tiny(seed=2))
        one = TPPagedTransformer(ModelConfig.tiny(seed=2), 0, 1)
        ids = tokens(9, 7)
        assert torch.equal(one.forward_reference(ids)[0], full.forward_reference(ids)[0])


def test_tp_model_rejects_a_pool_of_the_full_head_count():
    """A rank's pool must hold its KV heads only (the pool check names the pool)."""
    with single_torch_thread():
        model = TPPagedTransformer(ModelConfig.tiny(), 0, 2)  # group unused: fails before
        pool = MHATokenToKVPool(16, 1, torch.float32, 2, 16, 4, "cpu")
        with pytest.raises(ValueError, match="pool"):
            model.forward_extend(pool, [ExtendInput(tokens(2, 1), torch.tensor([1, 2]), 0)])
