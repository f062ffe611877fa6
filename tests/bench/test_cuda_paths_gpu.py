"""The CUDA paths end to end.

On CUDA (marked ``gpu``): kernels reading and writing pinned and ``cudaHostRegister``-ed host
memory, the controller on real streams (and without a host synchronization in ``write`` /
``start_loading``), the model's attention restricted to SDPA's fused kernels, and the executor
with the write-back L2 cache. On CPU the same checks run where they apply, so the checks
themselves stay tested on a machine without a GPU.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import pytest
import torch

from bench.common import sync_device
from hicache_prefill import kernels
from hicache_prefill.kernels.ops import reference

L = 3  # layers of the small pools
H, D = 8, 128  # an 8B model's KV heads and head dim: 2 KiB per token-layer in bf16


def _device() -> torch.device:
    return torch.device("cuda" if torch.cuda.is_available() else "cpu")


@contextlib.contextmanager
def _registered(t: torch.Tensor) -> Iterator[torch.Tensor]:
    """``t`` registered with ``cudaHostRegister`` for the duration (as the host pool does)."""
    cudart = torch.cuda.cudart()
    rc = int(cudart.cudaHostRegister(t.data_ptr(), t.numel() * t.element_size(), 0))
    assert rc == 0, f"cudaHostRegister failed: {rc}"
    try:
        assert t.is_pinned(), "registered host memory does not report is_pinned()"
        yield t
    finally:
        torch.cuda.synchronize()
        cudart.cudaHostUnregister(t.data_ptr())


# ---------------------------------------------------------------------------------------------
# Kernels
# ---------------------------------------------------------------------------------------------
def check_kernels_pinned(device: torch.device | None = None, registered: bool = True) -> None:
    """Each kernel op once, host side pinned (``registered``: ``cudaHostRegister``-ed plain
    memory instead of ``pin_memory()``); checked against torch indexing on CPU copies."""
    device = device or _device()
    cuda = device.type == "cuda"
    g = torch.Generator().manual_seed(0)
    t_dev, t_host, n = 96, 128, 40
    item = H * D * 2

    def rand(*shape: int) -> torch.Tensor:
        return torch.randn(*shape, generator=g).to(torch.bfloat16)

    dev = rand(2, L, t_dev, H, D).to(device)
    host_lf, host_pf = rand(2, L, t_host, H, D), rand(2, t_host, L, H, D)
    stack = contextlib.ExitStack()
    with stack:
        if cuda and registered:
            host_lf, host_pf = (
                stack.enter_context(_registered(host_lf)),
                stack.enter_context(_registered(host_pf)),
            )
        elif cuda:
            host_lf, host_pf = host_lf.pin_memory(), host_pf.pin_memory()
        s_dev = (torch.randperm(t_dev - 16, generator=g)[:n] + 16).to(device)  # page 0 padding
        s_host = torch.randperm(t_host, generator=g)[:n].to(device)
        sd, sh = s_dev.cpu(), s_host.cpu()
        dev_tbl = [kernels.data_ptr_table([dev[kv, i] for i in range(L)], device) for kv in (0, 1)]
        lf_tbl = [
            kernels.data_ptr_table([host_lf[kv, i] for i in range(L)], device) for kv in (0, 1)
        ]
        layer = 1

        # H2D, one layer, layer_first host
        before = dev.cpu()
        kernels.transfer_kv_per_layer(
            host_lf[0, layer], dev[0, layer], host_lf[1, layer], dev[1, layer], s_host, s_dev, item
        )
        sync_device(device)
        want = before.clone()
        want[:, layer, sd] = host_lf[:, layer, sh]
        assert torch.equal(dev.cpu(), want), "transfer_kv_per_layer (H2D) differs"

        # H2D, one layer, page_first host
        before = dev.cpu()
        kernels.transfer_kv_per_layer_pf_lf(
            host_pf[0], dev[0, layer], host_pf[1], dev[1, layer], s_host, s_dev,
            layer, item, item * L,
        )  # fmt: skip
        sync_device(device)
        want = before.clone()
        want[:, layer, sd] = host_pf[:, sh, layer]
        assert torch.equal(dev.cpu(), want), "transfer_kv_per_layer_pf_lf differs"

        # D2H, all layers, layer_first host (pointer tables both sides)
        dev.copy_(rand(*dev.shape).to(device))
        before = host_lf.clone()
        kernels.transfer_kv_all_layer(
            dev_tbl[0], lf_tbl[0], dev_tbl[1], lf_tbl[1], s_dev, s_host, item, L
        )
        sync_device(device)
        want = before.clone()
        want[:, :, sh] = dev.cpu()[:, :, sd]
        assert torch.equal(host_lf, want), "transfer_kv_all_layer (D2H) differs"

        # D2H, all layers, page_first host
        before = host_pf.clone()
        kernels.transfer_kv_all_layer_lf_pf(
            dev_tbl[0], host_pf[0], dev_tbl[1], host_pf[1], s_dev, s_host, item, item * L, L
        )
        sync_device(device)
        want = before.clone()
        want[:, sh] = dev.cpu()[:, :, sd].transpose(1, 2)
        assert torch.equal(host_pf, want), "transfer_kv_all_layer_lf_pf differs"

        # the torch reference agrees on one op (same argument order as the kernels)
        got, ref = dev.clone(), dev.cpu().clone()
        kernels.transfer_kv_per_layer(host_lf[0, 0], got[0, 0], host_lf[1, 0], got[1, 0],
                                      s_host, s_dev, item)  # fmt: skip
        reference.transfer_kv_per_layer(host_lf[0, 0], ref[0, 0], host_lf[1, 0], ref[1, 0],
                                        sh, sd, item)  # fmt: skip
        sync_device(device)
        assert torch.equal(got.cpu(), ref), "kernel and torch reference differ"


# ---------------------------------------------------------------------------------------------
# Controller
# ---------------------------------------------------------------------------------------------
def _controller(device: torch.device, layout: str, io: str, page: int = 16, size: int = 256):
    from hicache_prefill.hicache.memory.allocator import TokenToKVPoolAllocator
    from hicache_prefill.hicache.memory.device_pool import MHATokenToKVPool
    from hicache_prefill.hicache.memory.host_pool import make_host_pool
    from hicache_prefill.hicache.transfer.controller import HiCacheController

    pool = MHATokenToKVPool(size, page, torch.bfloat16, H, D, L, device)
    host = make_host_pool(pool, 2.0, 0, layout)
    alloc = TokenToKVPoolAllocator(size, page, device)
    return HiCacheController(alloc, pool, host, io)


def check_controller_round_trip(
    device: torch.device | None = None,
    pairs: tuple[tuple[str, str], ...] = (
        ("page_first", "kernel"), ("layer_first", "kernel"), ("layer_first", "direct"),
        ("page_first_direct", "direct"),
    ),
) -> None:  # fmt: skip
    """Backup, clear, load back through ``HiCacheController`` for each (layout, io) pair."""
    device = device or _device()
    for layout, io in pairs:
        c = _controller(device, layout, io)
        try:
            if device.type == "cuda":
                assert c.host_pool.pinned and c.host_pool.kv_buffer.is_pinned(), "host not pinned"
            d = c.device_allocator.alloc(64)
            kv = c.device_pool.kv_buffer
            kv.copy_(torch.randn(kv.shape).to(kv.dtype).to(device))
            want = kv[:, :, d].cpu()
            h = c.write(d, node_id=1)
            assert h is not None
            assert c.wait_write([1]) == [1], f"{layout}/{io}: backup not acked"
            kv[:, :, d] = 0
            c.evict_device(d)
            d2 = c.load(h, node_id=2)
            assert d2 is not None
            c.start_loading()
            for layer in range(L):
                c.layer_done_counter.wait_until(layer)  # CUDA: a stream wait, no host block
            got = kv[:, :, d2].cpu()  # on the compute stream: after the waits
            assert torch.equal(got, want), f"{layout}/{io}: KV differs after the round trip"
            assert c.wait_all()[1] == [2], f"{layout}/{io}: load not acked"
            c.check_integrity()
        finally:
            c.close()
            c.host_pool.destroy()


def check_controller_never_syncs(device: torch.device | None = None) -> None:
    """``write`` / ``start_loading`` / ``wait_until`` (kernel io, page_first) queue work and
    return: no host synchronization (``set_sync_debug_mode("error")`` raises on one). Slot
    allocation and eviction (which copy slots between host and device) stay outside."""
    device = device or _device()
    c = _controller(device, "page_first", "kernel")

    @contextlib.contextmanager
    def no_sync() -> Iterator[None]:
        if device.type != "cuda":  # a CPU stream has nothing to synchronize: order only
            yield
            return
        torch.cuda.synchronize()
        torch.cuda.set_sync_debug_mode("error")
        try:
            yield
        finally:
            torch.cuda.set_sync_debug_mode("default")

    try:
        for checked in (False, True):  # the first round compiles both kernels
            d = c.device_allocator.alloc(64)
            with no_sync() if checked else contextlib.nullcontext():
                h = c.write(d, node_id=1)
            assert h is not None
            c.wait_all()
            c.evict_device(d)
            d2 = c.load(h, node_id=2)
            assert d2 is not None
            with no_sync() if checked else contextlib.nullcontext():
                c.start_loading()
                for layer in range(L):
                    c.layer_done_counter.wait_until(layer)
            c.wait_all()
            c.evict_device(d2)
            c.evict_host(h)
        c.check_integrity()
    finally:
        c.close()
        c.host_pool.destroy()


# ---------------------------------------------------------------------------------------------
# Model and executor
# ---------------------------------------------------------------------------------------------
@contextlib.contextmanager
def _fused_sdpa_only(device: torch.device) -> Iterator[None]:
    """On CUDA, SDPA without its math kernel: an input the fused kernels reject raises."""
    if device.type != "cuda":
        yield
        return
    from torch.nn.attention import SDPBackend, sdpa_kernel

    backends = [SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION]
    if hasattr(SDPBackend, "CUDNN_ATTENTION"):
        backends.append(SDPBackend.CUDNN_ATTENTION)
    with sdpa_kernel(backends):
        yield


def check_model_fused_attention(device: torch.device | None = None) -> float:
    """Chunked paged prefill (two chunks, the second over a cached prefix: the bottom-right
    causal mask) vs a full recompute, bf16 on CUDA (fp32 on CPU), GQA 4:1, head dim 128.
    Returns the largest relative error of a (layer, token) K/V row."""
    from hicache_prefill.hicache.memory.device_pool import MHATokenToKVPool
    from hicache_prefill.prefill.model import paged as model_mod
    from hicache_prefill.prefill.model.paged import ExtendInput, ModelConfig, PagedTransformer
    from tests.support.harness import kv_max_rel_error

    device = device or _device()
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    cfg = ModelConfig(
        num_layers=4, num_attention_heads=32, num_kv_heads=H, head_dim=D, hidden_size=1024,
        intermediate_size=2048, vocab_size=1000, dtype=dtype, seed=0,
    )  # fmt: skip
    m = PagedTransformer(cfg, device)
    n, page = 640 if device.type == "cuda" else 96, 16
    pool = MHATokenToKVPool(n + page, page, dtype, H, D, cfg.num_layers, device)
    ids = torch.randint(1, 1000, (n,), generator=torch.Generator().manual_seed(1))
    slots = torch.arange(page, page + n, device=device)
    half = n // 2
    gqa_ok = model_mod._GQA_OK
    try:
        with _fused_sdpa_only(device):
            m.forward_extend(pool, [ExtendInput(ids[:half], slots[:half], 0)])
            m.forward_extend(pool, [ExtendInput(ids[half:], slots, half)])
            _, ref_k, ref_v = m.forward_reference(ids)
    finally:
        model_mod._GQA_OK = gqa_ok
    k = torch.stack([pool.k_buffer[i][slots] for i in range(cfg.num_layers)])
    v = torch.stack([pool.v_buffer[i][slots] for i in range(cfg.num_layers)])
    err = kv_max_rel_error([(k, ref_k), (v, ref_v)])
    limit = 0.05 if dtype == torch.bfloat16 else 1e-4
    assert err < limit, f"chunked prefill KV differs from a full recompute: rel err {err:.4f}"
    return err


def check_executor_l2(device: torch.device | None = None) -> None:
    """Write-back L2 end to end on ``device``: A is evicted to the host by B, C = A + more is a
    host hit loaded back layer by layer under its forward; integrity after every step; every
    request's decode-side KV equals a full recompute (fp32, tiny model)."""
    from hicache_prefill.prefill.disagg.simulated import DelayDistribution, PeerConfig
    from hicache_prefill.prefill.request.state import Outcome
    from hicache_prefill.server_args import ServerArgs
    from tests.support.harness import assert_decode_kv_matches, make_executor

    device = device or _device()
    args = ServerArgs(
        device=device.type, dtype="float32", page_size=4, max_total_tokens=64,
        chunked_prefill_size=16, disaggregation_mode="prefill", optimistic_prefill_attempts=2,
        enable_hierarchical_cache=True, hicache_write_policy="write_back",
        hicache_mem_layout="page_first", hicache_io_backend="kernel", load_back_threshold=4,
    )  # fmt: skip
    peer = PeerConfig(bootstrap_delay=DelayDistribution("fixed", 0.0), transfer_latency_s=1.0)
    ex = make_executor(args, peer_config=peer)
    g = torch.Generator().manual_seed(0)

    def prompt(n: int) -> list[int]:
        return torch.randint(0, 512, (n,), generator=g).tolist()

    def finish() -> None:
        ex.run_until_idle(max_steps=10_000, check=True)
        ex.drain_cache_events()
        ex.check_integrity()

    try:
        a = prompt(40)
        ex.submit("a", a)
        finish()
        ex.submit("b", prompt(44))  # needs the room: A's pages go to the host
        finish()
        ex.submit("c", a + prompt(6))
        finish()
        r = ex.result("c")
        assert r is not None and r.outcome == Outcome.SUCCESS, f"c: {r}"
        assert r.cached_host_tokens > 0, "c was not a host hit"
        assert ex.cache.stats.loaded_tokens > 0, "nothing was loaded back"
        for rid in "abc":
            assert_decode_kv_matches(ex, rid, atol=1e-4)
    finally:
        ex.cache.close()
        if ex.cache.host_pool is not None:
            ex.cache.host_pool.destroy()


CUDA = pytest.param("cuda", marks=pytest.mark.gpu)
DEVICES = ["cpu", CUDA]

pytestmark = pytest.mark.usefixtures("one_torch_thread")


@pytest.mark.parametrize("device", DEVICES)
def test_kernels_with_pinned_host(device: str) -> None:
    check_kernels_pinned(torch.device(device), registered=False)


@pytest.mark.gpu
def test_kernels_with_registered_host() -> None:
    check_kernels_pinned(torch.device("cuda"), registered=True)


@pytest.mark.parametrize("device", DEVICES)
def test_controller_round_trip(device: str) -> None:
    check_controller_round_trip(torch.device(device))


@pytest.mark.parametrize("device", DEVICES)
def test_controller_write_and_load_never_synchronize(device: str) -> None:
    check_controller_never_syncs(torch.device(device))


@pytest.mark.parametrize("device", DEVICES)
def test_model_attention_runs_on_fused_kernels(device: str) -> None:
    check_model_fused_attention(torch.device(device))


@pytest.mark.parametrize("device", DEVICES)
def test_executor_with_write_back_l2(device: str) -> None:
    check_executor_l2(torch.device(device))
