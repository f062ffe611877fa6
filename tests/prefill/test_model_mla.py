"""The MLA model (``prefill.model.mla``): the latent it caches and its logits, computed over an MLA
pool by slot in the naive form, equal the pool-free absorbed-form recompute; chunked prefill over
a cached prefix (on the device, or device -> host -> device) equals it too; batching, the pool
check, bad input; the tensor-parallel model (2 ranks, query heads split, the latent whole on every
rank) equals the single-rank one; the DeepSeek presets' geometry.

Tolerance (fp32, tiny MLA geometry): logits and latent atol/rtol 1e-5 / 1e-4 as
tests/prefill/test_model.py (observed ~2e-6: reduction order, and the two forms' order of the
``kv_b`` products).
"""

from __future__ import annotations

import pytest
import torch

from hicache_prefill.hicache.memory.allocator import TokenToKVPoolAllocator
from hicache_prefill.hicache.memory.device_pool import MHATokenToKVPool, MLATokenToKVPool
from hicache_prefill.prefill.model.factory import build_model
from hicache_prefill.prefill.model.mla import MLAConfig, MLATransformer
from hicache_prefill.prefill.model.mla_tp import TPMLATransformer
from hicache_prefill.prefill.model.paged import ExtendInput, ModelConfig, PagedTransformer
from hicache_prefill.server_args import ServerArgs
from tests.support.harness import single_torch_thread
from tests.support.tp_harness import run_ranks

pytestmark = pytest.mark.usefixtures("one_torch_thread")

LOGIT_TOL = dict(atol=1e-4, rtol=1e-4)
KV_TOL = dict(atol=1e-5, rtol=1e-5)


def make(page_size: int = 1, size: int = 256, q_lora_rank: int = 0, seed: int = 0,
         dtype: torch.dtype = torch.float32):  # fmt: skip
    cfg = MLAConfig.tiny(seed=seed, dtype=dtype, q_lora_rank=q_lora_rank)
    model = MLATransformer(cfg)
    pool = MLATokenToKVPool(size, page_size, dtype, cfg.kv_lora_rank, cfg.qk_rope_head_dim,
                            cfg.num_layers, "cpu")  # fmt: skip
    return model, pool, TokenToKVPoolAllocator(size, page_size, "cpu")


def tokens(n: int, seed: int = 1) -> torch.Tensor:
    return torch.randint(0, 512, (n,), generator=torch.Generator().manual_seed(seed))


def alloc_slots(alloc: TokenToKVPoolAllocator, n: int) -> torch.Tensor:
    ps = alloc.page_size
    slots = alloc.alloc((n + ps - 1) // ps * ps)
    assert slots is not None
    return slots[:n]


def pool_latent(pool: MLATokenToKVPool, slots: torch.Tensor) -> torch.Tensor:
    return torch.stack([pool.kv_buffer[i][slots] for i in range(pool.layer_num)])


def test_weights_are_deterministic_from_seed_and_shaped_like_deepseek():
    a, b = MLATransformer(MLAConfig.tiny(0)), MLATransformer(MLAConfig.tiny(0))
    c = MLATransformer(MLAConfig.tiny(1))
    assert torch.equal(a.layers[0].kv_a, b.layers[0].kv_a)
    assert not torch.equal(a.layers[0].kv_a, c.layers[0].kv_a)
    cfg = a.config
    assert a.layers[0].kv_a.shape == (cfg.kv_lora_rank + cfg.qk_rope_head_dim, cfg.hidden_size)
    assert a.layers[0].kv_b.shape == (4 * (16 + 16), cfg.kv_lora_rank)
    assert a.layers[0].q_proj.shape == (4 * 32, cfg.hidden_size)
    lora = MLATransformer(MLAConfig.tiny(0, q_lora_rank=24)).layers[0]
    assert lora.q_a.shape == (24, 64) and lora.q_b.shape == (4 * 32, 24)
    assert not hasattr(lora, "q_proj")


@pytest.mark.parametrize("q_lora_rank", [0, 24], ids=["q_proj", "q_lora"])
@pytest.mark.parametrize("page_size", [1, 4])
def test_one_shot_prefill_matches_the_absorbed_reference(page_size, q_lora_rank):
    model, pool, alloc = make(page_size, q_lora_rank=q_lora_rank)
    ids = tokens(21)
    slots = alloc_slots(alloc, 21)
    logits = model.forward_extend(pool, [ExtendInput(ids, slots, 0)], return_all_logits=True)[0]
    ref_logits, ref_kv = model.forward_reference(ids)
    torch.testing.assert_close(logits, ref_logits, **LOGIT_TOL)
    assert ref_kv.shape == (4, 21, 1, 48)  # [L, n, 1, kv_lora_rank + qk_rope_head_dim]
    torch.testing.assert_close(pool_latent(pool, slots), ref_kv, **KV_TOL)


@pytest.mark.parametrize("q_lora_rank", [0, 24], ids=["q_proj", "q_lora"])
@pytest.mark.parametrize("chunk", [1, 7, 16])
def test_chunked_prefill_over_a_cached_prefix_matches_the_reference(chunk, q_lora_rank):
    """B shares A's 16 cached tokens (read by slot) and adds 14 chunk by chunk."""
    model, pool, alloc = make(4, q_lora_rank=q_lora_rank)
    a = tokens(16, seed=2)
    b = torch.cat([a, tokens(14, seed=3)])
    a_slots = alloc_slots(alloc, 16)
    model.forward_extend(pool, [ExtendInput(a, a_slots, 0)])
    slots = torch.cat([a_slots, alloc_slots(alloc, 14)])
    logits = []
    for start in range(16, 30, chunk):
        end = min(start + chunk, 30)
        logits.append(model.forward_extend(pool, [ExtendInput(b[start:end], slots[:end], start)],
                                           return_all_logits=True)[0])  # fmt: skip
    ref_logits, ref_kv = model.forward_reference(b)
    torch.testing.assert_close(torch.cat(logits), ref_logits[16:], **LOGIT_TOL)
    torch.testing.assert_close(pool_latent(pool, slots), ref_kv, **KV_TOL)


def test_small_batch_equals_separate_calls():
    model, pool, alloc = make(1)
    a, b = tokens(12, seed=5), tokens(5, seed=6)
    out = model.forward_extend(
        pool, [ExtendInput(a, alloc_slots(alloc, 12), 0), ExtendInput(b, alloc_slots(alloc, 5), 0)]
    )
    torch.testing.assert_close(out[0], model.forward_reference(a)[0][-1], **LOGIT_TOL)
    torch.testing.assert_close(out[1], model.forward_reference(b)[0][-1], **LOGIT_TOL)


@pytest.mark.parametrize("layout,io", [("layer_first", "kernel"), ("page_first", "kernel"),
                                       ("page_first_direct", "direct")])  # fmt: skip
def test_prefix_copied_device_host_device_matches_recompute(layout, io):
    """A's latent goes D2H, its device slots are scrubbed (NaN) and freed, and the prefix comes
    back H2D into other slots, one layer per ``layer_wait``; B reads it from there."""
    from hicache_prefill.hicache.memory.host_pool import MLATokenToKVPoolHost

    model, pool, alloc = make(4, size=128)
    host = MLATokenToKVPoolHost(pool, 2.0, 0.0, 4, layout, pin_memory=False)
    a = tokens(16, seed=8)
    b = torch.cat([a, tokens(6, seed=9)])
    a_slots = alloc_slots(alloc, 16)
    model.forward_extend(pool, [ExtendInput(a, a_slots, 0)])
    host_slots = host.alloc(16)
    host.backup_from_device_all_layer(pool, host_slots, a_slots, io)
    pool.kv_buffer_all[:, a_slots] = float("nan")
    alloc.free(a_slots)
    back, new = alloc_slots(alloc, 16), alloc_slots(alloc, 6)

    def load(layer_id: int) -> None:
        host.load_to_device_per_layer(pool, host_slots, back, layer_id, io)

    out = model.forward_extend(pool, [ExtendInput(b[16:], torch.cat([back, new]), 16)],
                               layer_wait=load, return_all_logits=True)[0]  # fmt: skip
    ref_logits, ref_kv = model.forward_reference(b)
    torch.testing.assert_close(out, ref_logits[16:], **LOGIT_TOL)
    torch.testing.assert_close(pool_latent(pool, new), ref_kv[:, 16:], **KV_TOL)


def test_bf16_prefix_matches_recompute_loosely():
    model, pool, alloc = make(1, size=64, seed=3, dtype=torch.bfloat16)
    ids = tokens(20, seed=10)
    s1 = alloc_slots(alloc, 12)
    model.forward_extend(pool, [ExtendInput(ids[:12], s1, 0)])
    out = model.forward_extend(pool, [ExtendInput(ids[12:], torch.cat([s1, alloc_slots(alloc, 8)]),
                                                  12)])[0]  # fmt: skip
    torch.testing.assert_close(out, model.forward_reference(ids)[0][-1], atol=5e-2, rtol=5e-2)


def test_pool_of_the_other_kind_or_geometry_raises_and_changes_nothing():
    model, pool, alloc = make(1)
    mha_model = PagedTransformer(ModelConfig.tiny())
    mha_pool = MHATokenToKVPool(16, 1, torch.float32, 2, 16, 4, "cpu")
    batch = [ExtendInput(tokens(2), torch.tensor([1, 2]), 0)]
    with pytest.raises(ValueError, match="not an MLA pool"):
        model.forward_extend(mha_pool, batch)
    with pytest.raises(ValueError, match="has no KV heads"):
        mha_model.forward_extend(pool, batch)
    narrow = MLATokenToKVPool(16, 1, torch.float32, 24, 16, 4, "cpu")
    with pytest.raises(ValueError, match="kv_lora_rank"):
        model.forward_extend(narrow, batch)
    before = pool.kv_buffer_all.clone()
    with pytest.raises(ValueError, match="slots"):
        model.forward_extend(pool, [ExtendInput(tokens(4), alloc_slots(alloc, 3), 0)])
    assert torch.equal(pool.kv_buffer_all, before)


@pytest.mark.parametrize(
    "changes,message",
    [
        (dict(qk_rope_head_dim=15, head_dim=31), "qk_rope_head_dim must be even"),
        (dict(num_kv_heads=2), "num_kv_heads must be 1"),
        (dict(head_dim=48), "head_dim=48 must be qk_nope_head_dim"),
        (dict(q_lora_rank=-1), "q_lora_rank must be >= 0"),
        (dict(kv_lora_rank=0), "kv_lora_rank must be >= 1"),
    ],
)
def test_bad_config_names_the_field(changes, message):
    import dataclasses

    with pytest.raises(ValueError, match=message):
        dataclasses.replace(MLAConfig.tiny(), **changes)


def test_factory_and_presets_build_deepseek_geometry():
    args = ServerArgs(use_mla=True, device="cpu", num_layers=2, kv_lora_rank=32,
                      qk_rope_head_dim=8, qk_nope_head_dim=8, v_head_dim=12)  # fmt: skip
    model = build_model(args)
    assert isinstance(model, MLATransformer)
    c = model.config
    assert (c.kv_cache_dim, c.head_dim, c.v_head_dim) == (40, 16, 12)
    assert type(build_model(ServerArgs(device="cpu"))) is PagedTransformer
    # The presets' numbers, without drawing billions of random weights.
    v2 = MLAConfig.from_server_args(ServerArgs(model_preset="deepseek-v2-lite-shape", use_mla=True,
                                               device="cpu"))  # fmt: skip
    assert (v2.num_layers, v2.num_attention_heads, v2.kv_cache_dim, v2.q_lora_rank) == (
        27, 16, 576, 0)  # fmt: skip
    v3 = MLAConfig.from_server_args(ServerArgs(model_preset="deepseek-v3-shape", use_mla=True,
                                               device="cpu"))  # fmt: skip
    assert (v3.num_layers, v3.num_attention_heads, v3.hidden_size, v3.q_lora_rank) == (
        61, 128, 7168, 1536)  # fmt: skip
    with pytest.raises(ValueError, match="needs --use-mla"):
        MLAConfig.from_server_args(ServerArgs(device="cpu"))


# ------------------------------------------------------------------------------ tensor parallel
def _story(model: PagedTransformer) -> dict[str, torch.Tensor]:
    """A prefill of A, then B over A's cached 16 tokens in two chunks; logits, the latent of
    every slot used and the reference."""
    c = model.config
    pool = MLATokenToKVPool(128, 4, c.dtype, c.kv_lora_rank, c.qk_rope_head_dim, c.num_layers,
                            "cpu")  # fmt: skip
    alloc = TokenToKVPoolAllocator(128, 4, "cpu")
    a, tail = tokens(16, 1), tokens(9, 2)
    sa, sb = alloc_slots(alloc, 16), alloc_slots(alloc, 9)
    out = {"a": model.forward_extend(pool, [ExtendInput(a, sa, 0)], return_all_logits=True)[0]}
    s = torch.cat([sa, sb])
    out["b1"] = model.forward_extend(pool, [ExtendInput(tail[:4], s[:20], 16)])[0]
    out["b2"] = model.forward_extend(pool, [ExtendInput(tail[4:], s, 20)],
                                     return_all_logits=True)[0]  # fmt: skip
    out["ref_logits"], out["ref_kv"] = model.forward_reference(torch.cat([a, tail]))
    out["kv"] = pool_latent(pool, s)
    return out


def _tp_rank(rank: int, world_size: int) -> dict[int, dict[str, torch.Tensor]]:
    runs = {}
    for q_lora in (0, 24):
        model = TPMLATransformer(MLAConfig.tiny(seed=5, q_lora_rank=q_lora), rank, world_size)
        assert model.config.num_attention_heads == 4 // world_size and model.local_kv_heads == 1
        runs[q_lora] = _story(model)
    return runs


def test_tp_mla_model_equals_single_rank_and_holds_the_whole_latent():
    ranks = run_ranks(_tp_rank, 2)
    for q_lora in (0, 24):
        with single_torch_thread():
            single = _story(MLATransformer(MLAConfig.tiny(seed=5, q_lora_rank=q_lora)))
        for r, runs in enumerate(ranks):
            out = runs[q_lora]
            for key in ("a", "b1", "b2", "ref_logits"):
                torch.testing.assert_close(out[key], single[key], **LOGIT_TOL, msg=f"{r} {key}")
                assert torch.equal(out[key], ranks[0][q_lora][key]), f"rank {r} {key}"
            for key in ("kv", "ref_kv"):  # every rank: the whole latent
                torch.testing.assert_close(out[key], single[key], **KV_TOL, msg=f"{r} {key}")
    with pytest.raises(ValueError, match="tp_size=3 must divide num_attention_heads=4"):
        TPMLATransformer(MLAConfig.tiny(), 0, 3)
