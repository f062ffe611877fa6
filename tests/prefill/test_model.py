"""The paged model: a cached prefix (device, or device->host->device) gives the same logits and
the same new-token KV as a full recompute; chunked prefill equals one-shot prefill.

Tolerance (fp32, tiny model): logits atol 1e-4 / rtol 1e-4 (observed ~1e-6); KV atol 1e-5.
Differences come only from matmul reduction order over batches of different sizes.
"""

from __future__ import annotations

import pytest
import torch

from hicache_prefill.hicache.memory.allocator import TokenToKVPoolAllocator
from hicache_prefill.hicache.memory.device_pool import MHATokenToKVPool
from hicache_prefill.prefill.model.paged import ExtendInput, ModelConfig, PagedTransformer

pytestmark = pytest.mark.usefixtures("one_torch_thread")


LOGIT_TOL = dict(atol=1e-4, rtol=1e-4)
KV_TOL = dict(atol=1e-5, rtol=1e-5)


def make(page_size: int = 1, size: int = 256, seed: int = 0):
    cfg = ModelConfig.tiny(seed=seed)
    model = PagedTransformer(cfg)
    pool = MHATokenToKVPool(
        size, page_size, cfg.dtype, cfg.num_kv_heads, cfg.head_dim, cfg.num_layers, "cpu"
    )
    alloc = TokenToKVPoolAllocator(size, page_size, "cpu")
    return model, pool, alloc


def tokens(n: int, seed: int = 1) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, 512, (n,), generator=g, dtype=torch.int64)


def alloc_slots(alloc: TokenToKVPoolAllocator, n: int) -> torch.Tensor:
    ps = alloc.page_size
    slots = alloc.alloc((n + ps - 1) // ps * ps)
    assert slots is not None
    return slots[:n]


def pool_kv(pool: MHATokenToKVPool, slots: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    k = torch.stack([pool.k_buffer[i][slots] for i in range(pool.layer_num)])
    v = torch.stack([pool.v_buffer[i][slots] for i in range(pool.layer_num)])
    return k, v


def test_weights_are_deterministic_from_seed():
    a, b, c = (
        PagedTransformer(ModelConfig.tiny(0)),
        PagedTransformer(ModelConfig.tiny(0)),
        PagedTransformer(ModelConfig.tiny(1)),
    )
    assert torch.equal(a.layers[0].qkv, b.layers[0].qkv)
    assert not torch.equal(a.layers[0].qkv, c.layers[0].qkv)


@pytest.mark.parametrize("page_size", [1, 4])
def test_one_shot_prefill_matches_reference(page_size):
    model, pool, alloc = make(page_size)
    ids = tokens(21)
    slots = alloc_slots(alloc, 21)
    logits = model.forward_extend(pool, [ExtendInput(ids, slots, 0)], return_all_logits=True)[0]
    ref_logits, ref_k, ref_v = model.forward_reference(ids)
    torch.testing.assert_close(logits, ref_logits, **LOGIT_TOL)
    k, v = pool_kv(pool, slots)
    torch.testing.assert_close(k, ref_k, **KV_TOL)
    torch.testing.assert_close(v, ref_v, **KV_TOL)


@pytest.mark.parametrize("page_size", [1, 4])
def test_prefix_written_by_earlier_call_matches_recompute(page_size):
    """Request B shares A's first 16 tokens: B reads them from A's slots (a device hit)."""
    model, pool, alloc = make(page_size)
    a = tokens(16, seed=2)
    b = torch.cat([a, tokens(9, seed=3)])
    a_slots = alloc_slots(alloc, 16)
    model.forward_extend(pool, [ExtendInput(a, a_slots, 0)])
    new_slots = alloc_slots(alloc, 9)
    b_slots = torch.cat([a_slots, new_slots])
    logits = model.forward_extend(pool, [ExtendInput(b[16:], b_slots, 16)], return_all_logits=True)
    ref_logits, ref_k, ref_v = model.forward_reference(b)
    torch.testing.assert_close(logits[0], ref_logits[16:], **LOGIT_TOL)
    k, v = pool_kv(pool, new_slots)
    torch.testing.assert_close(k, ref_k[:, 16:], **KV_TOL)
    torch.testing.assert_close(v, ref_v[:, 16:], **KV_TOL)


@pytest.mark.parametrize("chunk", [1, 4, 7, 16])
def test_chunked_prefill_equals_one_shot(chunk):
    model, pool, alloc = make(4)
    ids = tokens(30, seed=4)
    one_slots = alloc_slots(alloc, 30)
    one = model.forward_extend(pool, [ExtendInput(ids, one_slots, 0)])[0]
    slots = alloc_slots(alloc, 30)
    last = None
    for start in range(0, 30, chunk):
        end = min(start + chunk, 30)
        last = model.forward_extend(pool, [ExtendInput(ids[start:end], slots[:end], start)])[0]
    torch.testing.assert_close(last, one, **LOGIT_TOL)
    torch.testing.assert_close(pool_kv(pool, slots)[0], pool_kv(pool, one_slots)[0], **KV_TOL)
    torch.testing.assert_close(pool_kv(pool, slots)[1], pool_kv(pool, one_slots)[1], **KV_TOL)


def test_small_batch_equals_separate_calls():
    model, pool, alloc = make(1)
    a, b = tokens(12, seed=5), tokens(5, seed=6)
    sa, sb = alloc_slots(alloc, 12), alloc_slots(alloc, 5)
    out = model.forward_extend(pool, [ExtendInput(a, sa, 0), ExtendInput(b, sb, 0)])
    torch.testing.assert_close(out[0], model.forward_reference(a)[0][-1], **LOGIT_TOL)
    torch.testing.assert_close(out[1], model.forward_reference(b)[0][-1], **LOGIT_TOL)


def test_layer_wait_called_before_each_layer_in_order():
    model, pool, alloc = make(1)
    seen: list[int] = []
    ids = tokens(3)
    model.forward_extend(pool, [ExtendInput(ids, alloc_slots(alloc, 3), 0)], layer_wait=seen.append)
    assert seen == list(range(model.config.num_layers))


def test_layer_wait_gates_reads_of_a_loading_prefix():
    """Layer l's prefix KV is written by the hook itself (a stand-in for an H2D load that
    completes at layer_wait(l)); the result still matches the recompute."""
    model, pool, alloc = make(1)
    ids = tokens(20, seed=7)
    _, ref_k, ref_v = model.forward_reference(ids)
    prefix_slots = alloc_slots(alloc, 12)
    new_slots = alloc_slots(alloc, 8)

    def load(layer_id: int) -> None:
        pool.k_buffer[layer_id][prefix_slots] = ref_k[layer_id, :12]
        pool.v_buffer[layer_id][prefix_slots] = ref_v[layer_id, :12]

    out = model.forward_extend(
        pool, [ExtendInput(ids[12:], torch.cat([prefix_slots, new_slots]), 12)], layer_wait=load
    )[0]
    torch.testing.assert_close(out, model.forward_reference(ids)[0][-1], **LOGIT_TOL)


def test_bad_input_raises_and_leaves_pool_unchanged():
    model, pool, alloc = make(1)
    before = pool.kv_buffer.clone()
    ids = tokens(4)
    with pytest.raises(ValueError, match="slots"):
        model.forward_extend(pool, [ExtendInput(ids, alloc_slots(alloc, 3), 0)])
    with pytest.raises(ValueError, match="input_ids"):
        model.forward_extend(pool, [ExtendInput(ids.int(), alloc_slots(alloc, 4), 0)])
    with pytest.raises(ValueError, match="input_ids"):
        model.forward_extend(pool, [ExtendInput(ids + 10_000, alloc_slots(alloc, 4), 0)])
    with pytest.raises(ValueError, match="batch"):
        model.forward_extend(pool, [])
    assert torch.equal(pool.kv_buffer, before)


def test_pool_geometry_mismatch_raises():
    model, _, _ = make(1)
    bad = MHATokenToKVPool(16, 1, torch.float32, 3, 16, 4, "cpu")
    with pytest.raises(ValueError, match="pool"):
        model.forward_extend(bad, [ExtendInput(tokens(2), torch.tensor([1, 2]), 0)])


@pytest.mark.parametrize(
    "layout,io",
    [("page_first", "kernel"), ("layer_first", "kernel"), ("page_first_direct", "direct")],
)
def test_prefix_copied_device_host_device_matches_recompute(layout, io):
    """A's KV goes D2H into the host pool, A's device slots are scrubbed and freed, then the
    prefix comes back H2D into different slots layer by layer (one load per layer_wait) and B
    reads it from there."""
    from hicache_prefill.hicache.memory.host_pool import MHATokenToKVPoolHost

    model, pool, alloc = make(4, size=128)
    host = MHATokenToKVPoolHost(pool, 2.0, 0.0, 4, layout, pin_memory=False)
    a = tokens(16, seed=8)
    b = torch.cat([a, tokens(6, seed=9)])
    a_slots = alloc_slots(alloc, 16)
    model.forward_extend(pool, [ExtendInput(a, a_slots, 0)])
    host_slots = host.alloc(16)
    host.backup_from_device_all_layer(pool, host_slots, a_slots, io)
    pool.kv_buffer[:, :, a_slots] = float("nan")
    alloc.free(a_slots)
    back = alloc_slots(alloc, 16)
    new_slots = alloc_slots(alloc, 6)

    def load(layer_id: int) -> None:
        host.load_to_device_per_layer(pool, host_slots, back, layer_id, io)

    out = model.forward_extend(
        pool,
        [ExtendInput(b[16:], torch.cat([back, new_slots]), 16)],
        layer_wait=load,
        return_all_logits=True,
    )[0]
    ref_logits, ref_k, ref_v = model.forward_reference(b)
    torch.testing.assert_close(out, ref_logits[16:], **LOGIT_TOL)
    k, v = pool_kv(pool, new_slots)
    torch.testing.assert_close(k, ref_k[:, 16:], **KV_TOL)
    torch.testing.assert_close(v, ref_v[:, 16:], **KV_TOL)


def test_bf16_prefix_matches_recompute_loosely():
    """bf16 (the GPU dtype): same paths, tolerance of bf16 rounding (logits atol 5e-2)."""
    cfg = ModelConfig.tiny(seed=3, dtype=torch.bfloat16)
    model = PagedTransformer(cfg)
    pool = MHATokenToKVPool(64, 1, cfg.dtype, cfg.num_kv_heads, cfg.head_dim, cfg.num_layers, "cpu")
    alloc = TokenToKVPoolAllocator(64, 1, "cpu")
    ids = tokens(20, seed=10)
    s1 = alloc_slots(alloc, 12)
    model.forward_extend(pool, [ExtendInput(ids[:12], s1, 0)])
    s2 = alloc_slots(alloc, 8)
    out = model.forward_extend(pool, [ExtendInput(ids[12:], torch.cat([s1, s2]), 12)])[0]
    ref = model.forward_reference(ids)[0][-1]
    torch.testing.assert_close(out, ref, atol=5e-2, rtol=5e-2)


def test_expanded_kv_heads_path_equals_native_gqa(monkeypatch):
    """The fallback for SDPA kernels without native GQA gives the same logits."""
    import hicache_prefill.prefill.model.paged as pm

    model, pool, alloc = make(1)
    ids = tokens(18, seed=11)
    s1, s2 = alloc_slots(alloc, 10), alloc_slots(alloc, 8)
    model.forward_extend(pool, [ExtendInput(ids[:10], s1, 0)])
    native = model.forward_extend(pool, [ExtendInput(ids[10:], torch.cat([s1, s2]), 10)])[0]
    monkeypatch.setattr(pm, "_GQA_OK", False)
    expanded = model.forward_extend(pool, [ExtendInput(ids[10:], torch.cat([s1, s2]), 10)])[0]
    torch.testing.assert_close(expanded, native, **LOGIT_TOL)
