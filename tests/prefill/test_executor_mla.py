"""The executor with ``--use-mla``: the DeepSeek-shaped model over ``MLATokenToKVPool`` /
``MLATokenToKVPoolHost``, a decode side of MLA pools, and decode-side latents checked against the
model's absorbed-form recompute, as for MHA.

- every layout / io backend pair the MLA host pool supports, under every write policy: a prompt
  evicted from the device comes back from L2 (loaded layer by layer) and every request's decode
  latent equals a recompute;
- on CUDA (marked ``gpu``; the same story runs on CPU): bf16, SDPA restricted to its fused
  kernels, the decode side's copies through ``transfer_kv_all_layer_mla``;
- optimistic attempts under write_back and write_through: a pending attempt yields to a
  bootstrapped request (write_back keeps its pages, write_through recomputes them), then a short
  soak with random delays, failures and forced retries.

Tiny MLA geometry (4 layers, 4 heads, latent 32 + rope 16), page 4, fp32, a virtual clock,
``check_integrity`` after every step.
"""

from __future__ import annotations

from contextlib import nullcontext

import pytest
import torch

from hicache_prefill.hicache.memory.device_pool import MLATokenToKVPool
from hicache_prefill.hicache.memory.host_pool import MLATokenToKVPoolHost
from hicache_prefill.prefill.disagg.simulated import PeerConfig
from hicache_prefill.prefill.executor import OptimisticPrefillExecutor
from hicache_prefill.prefill.model.mla import MLATransformer
from hicache_prefill.prefill.request.state import Outcome
from hicache_prefill.server_args import ServerArgs
from tests.prefill.executor_helpers import (
    NEVER,
    NOW,
    WRITE_THROUGH,
    assert_drained,
    executor_args,
    prompt,
    step,
)
from tests.support.harness import (
    assert_decode_kv_matches,
    decode_kv_and_reference,
    kv_max_rel_error,
    make_executor,
)
from tests.support.soak import SoakConfig, run_soak, soak_executor

pytestmark = pytest.mark.usefixtures("one_torch_thread")

MLA = dict(use_mla=True, kv_lora_rank=32, qk_rope_head_dim=16, qk_nope_head_dim=16,
           v_head_dim=16)  # fmt: skip

# (layout, io backend) pairs after SGLang's resolutions: page_first + direct becomes
# page_first_direct, page_first_direct + kernel becomes direct.
LAYOUT_IO = [("layer_first", "kernel"), ("layer_first", "direct"), ("page_first", "kernel"),
             ("page_first_direct", "direct")]  # fmt: skip
POLICIES = ["write_through", "write_through_selective", "write_back"]


def mla_args(**kw) -> ServerArgs:
    return executor_args(**{**MLA, **WRITE_THROUGH, **kw})


def make(args: ServerArgs, delay=NOW, **peer) -> OptimisticPrefillExecutor:
    cfg = PeerConfig(bootstrap_delay=delay, transfer_latency_s=0.01, **peer)
    return make_executor(args, peer_config=cfg)


def finish(ex: OptimisticPrefillExecutor) -> None:
    ex.run_until_idle(max_steps=10_000, check=True)
    assert_drained(ex)


@pytest.mark.parametrize("policy", POLICIES)
@pytest.mark.parametrize("layout,io", LAYOUT_IO)
def test_host_hit_of_an_evicted_prompt_under_every_layout_and_policy(layout, io, policy):
    """A runs twice (its second hit makes write_through_selective back it up), B and C push it
    out of the 96-token device pool, then A plus a question hits L2 and loads it back."""
    args = mla_args(max_total_tokens=96, hicache_mem_layout=layout, hicache_io_backend=io,
                    hicache_write_policy=policy, hicache_ratio=4, load_back_threshold=4,
                    optimistic_prefill_attempts=0)  # fmt: skip
    ex = make(args)
    assert isinstance(ex.model, MLATransformer) and isinstance(ex.pool, MLATokenToKVPool)
    assert isinstance(ex.cache.host_pool, MLATokenToKVPoolHost)
    assert isinstance(ex.decode.pool, MLATokenToKVPool)  # the decode side holds latents too
    assert (ex.cache.host_pool.layout, ex.cache.controller.io_backend) == (layout, io)
    a = prompt(40, seed=1)
    stories = [("a1", a), ("a2", a), ("b", prompt(40, seed=2)), ("c", prompt(40, seed=3)),
               ("a3", a + prompt(8, seed=4))]  # fmt: skip
    for rid, tokens in stories:
        ex.submit(rid, tokens)
        finish(ex)
    results = {r.rid: r for r in ex.pop_results()}
    assert all(r.outcome == Outcome.SUCCESS for r in results.values())
    assert results["a2"].cached_device_tokens == 36  # a device hit (the last token recomputed)
    a3 = results["a3"]  # A's pages evicted from the device come back from L2
    assert a3.cached_host_tokens >= 16 and a3.cached_device_tokens + a3.cached_host_tokens == 40
    cs = ex.cache.stats
    assert cs.loaded_tokens == a3.cached_host_tokens and cs.evicted_device_tokens > 0
    assert cs.h2d_bytes == a3.cached_host_tokens * 4 * 48 * 4  # L x C fp32 latents per token
    for rid, _ in stories:
        assert_decode_kv_matches(ex, rid)
    ex.cache.close()


@pytest.mark.parametrize("policy", ["write_through", "write_back"])
def test_pending_attempt_yields_and_its_retry_matches_the_recompute(policy):
    ex = make(mla_args(hicache_write_policy=policy), delay=NEVER)
    assert ex.max_attempts == 2
    ex.submit("a", prompt(40, seed=1))
    step(ex)  # a computes [0, 16) while its peer bootstraps
    ex.submit("b", prompt(8, seed=2))
    ex.requests["b"].peer.set_ready()
    step(ex)  # chunk boundary: b is bootstrapped and waiting, so a yields
    wt = policy == "write_through"
    a = ex.requests["a"]
    assert ex.stats.yields == 1 and a.attempt_log == [(1, True), (2, True)]
    assert a.cached_device == (0 if wt else 16)  # write_back published its pages
    assert ex.cache.stats.backed_up_tokens == (8 if wt else 0)  # only b's, at its insert
    a.peer.set_ready()
    finish(ex)
    r = ex.result("a")
    assert r.outcome == Outcome.SUCCESS and r.yields == 1
    assert r.total_computed_tokens == (56 if wt else 40)
    assert {(s.rid, s.attempt) for s in ex.decode.send_log} == {("b", 1), ("a", 2)}
    for rid in ("a", "b"):
        assert_decode_kv_matches(ex, rid)
    ex.cache.close()


@pytest.mark.parametrize(
    "policy, layout, io",
    [("write_through", "page_first_direct", "direct"), ("write_back", "layer_first", "direct")],
)
def test_soak_with_two_optimistic_attempts(policy, layout, io):
    """80 requests: random bootstrap delays, bootstrap and transfer failures, forced retries,
    peers killed at random, device and host eviction, copies racing the scheduler; every 4th
    success's decode latent is checked. The direct io backend: the kernel one runs interpreted
    Triton on a CPU (about 0.1 s a copy), covered by the layout test above."""
    args = mla_args(hicache_write_policy=policy, max_total_tokens=192, chunked_prefill_size=32,
                    hicache_ratio=1.5, hicache_mem_layout=layout, hicache_io_backend=io,
                    load_back_threshold=4, random_seed=3)  # fmt: skip
    ex = soak_executor(args, seed=3, copy_delay_seed=3)
    rep = run_soak(ex, SoakConfig(requests=80, seed=3, verify_every=4, max_prompt=96))
    assert_drained(ex)
    assert rep.protocol_errors == [] and rep.kv_mismatches == 0 and rep.verified > 12
    assert rep.max_attempts_used <= 2 and rep.successes > 55
    s, cs = ex.stats, ex.cache.stats
    assert s.optimistic_admissions > 50 and s.yields > 0 and s.parks > 0
    assert cs.loaded_tokens > 0 and cs.evicted_device_tokens > 0 and s.cached_host_tokens > 0
    ex.cache.close()


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)])
def test_write_back_host_hit_on_the_device(device):
    """The host-hit story on ``device``: on CUDA in bf16 with SDPA's fused kernels only (the
    naive form pads V to the query/key width for them), pinned host pool, Triton copies, and
    decode-side copies by ``transfer_kv_all_layer_mla``; decode latents within bf16 noise."""
    cuda = device == "cuda"
    args = mla_args(device=device, dtype="bfloat16" if cuda else "float32", max_total_tokens=96,
                    hicache_write_policy="write_back", hicache_ratio=4, load_back_threshold=4,
                    optimistic_prefill_attempts=0)  # fmt: skip
    ex = make(args)
    fused = nullcontext()
    if cuda:
        from torch.nn.attention import SDPBackend, sdpa_kernel

        fused = sdpa_kernel([SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION])
    a = prompt(40, seed=1)
    stories = [("a", a), ("b", prompt(40, seed=2)), ("c", prompt(40, seed=3)),
               ("a2", a + prompt(8, seed=4))]  # fmt: skip
    with fused:
        for rid, tokens in stories:
            ex.submit(rid, tokens)
            finish(ex)
    results = {r.rid: r for r in ex.pop_results()}
    assert all(r.outcome == Outcome.SUCCESS for r in results.values())
    assert results["a2"].cached_host_tokens > 0
    limit = 0.05 if cuda else 1e-5
    for rid, _ in stories:
        pairs = decode_kv_and_reference(ex, rid)
        assert pairs[0][0].device.type == device and pairs[0][0].dtype == ex.pool.dtype
        assert kv_max_rel_error(pairs) < limit, rid
    if cuda:
        torch.cuda.synchronize()
    ex.cache.close()
