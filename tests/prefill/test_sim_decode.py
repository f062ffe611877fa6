"""The simulated decode peer: KVPoll values, bootstrap delay and failure draws, sends that read
their source at ack time, transfer failures, determinism per rid, and the force hook."""

from __future__ import annotations

import math
import random

import pytest
import torch

from hicache_prefill.hicache.memory.device_pool import MHATokenToKVPool, MLATokenToKVPool
from hicache_prefill.prefill.clock import VirtualClock, WallClock
from hicache_prefill.prefill.disagg.protocol import KVPoll, force_not_ready
from hicache_prefill.prefill.disagg.simulated import (
    DecodeSide,
    DelayDistribution,
    PeerConfig,
    copy_send,
    decode_pool_like,
    read_kv,
    write_kv,
)

L, H, D = 2, 2, 4


def make_side(
    page_size: int = 1, size: int = 64, keep: bool = True, send_log_size: int | None = None, **cfg
) -> DecodeSide:
    src = MHATokenToKVPool(64, page_size, torch.float32, H, D, L, "cpu")
    src.kv_buffer.copy_(torch.randn_like(src.kv_buffer))
    return DecodeSide(
        src, VirtualClock(), PeerConfig(**cfg), size=size, keep_received=keep,
        send_log_size=send_log_size,
    )  # fmt: skip


def test_kvpoll_values_match_upstream():
    assert [(p.name, int(p)) for p in KVPoll] == [
        ("Failed", 0),
        ("Bootstrapping", 1),
        ("WaitingForInput", 2),
        ("Transferring", 3),
        ("Success", 4),
    ]


def test_clocks():
    c = VirtualClock()
    c.advance(1.5)
    c.wait_until(1.0)
    assert c.now() == 1.5
    c.wait_until(3.0)
    assert c.now() == 3.0
    with pytest.raises(ValueError, match="dt"):
        c.advance(-1)
    w = WallClock()
    t0 = w.now()
    w.wait_until(t0 + 0.002)
    assert w.now() >= t0


def test_delay_distributions():
    rng = random.Random(0)
    assert DelayDistribution.parse(0.5).sample(rng) == 0.5
    u = DelayDistribution.parse("uniform:1,2")
    assert all(1 <= u.sample(rng) <= 2 for _ in range(100))
    e = DelayDistribution.parse("exponential:0.1")
    mean = sum(e.sample(rng) for _ in range(4000)) / 4000
    assert math.isclose(mean, 0.1, rel_tol=0.1)
    with pytest.raises(ValueError, match="spec"):
        DelayDistribution.parse("gamma:1")
    with pytest.raises(ValueError, match="uniform"):
        DelayDistribution("uniform", 2, 1)


def test_bootstrap_ready_after_delay_then_send_and_ack():
    side = make_side(transfer_latency_s=0.5, bootstrap_delay=DelayDistribution("fixed", 1.0))
    peer = side.create_peer("r", 6)
    assert peer.poll() == KVPoll.Bootstrapping
    assert side.next_event_time() == 1.0
    side.clock.advance(1.0)
    assert peer.poll() == KVPoll.WaitingForInput
    with pytest.raises(RuntimeError, match="finalized"):
        peer.send(0, 0, 6, torch.arange(1, 7), last=True)
    peer.init(attempt=1)
    src = torch.tensor([9, 3, 4, 10, 11, 2])
    peer.send(1, 0, 4, src[:4], last=False)
    peer.send(1, 4, 6, src[4:], last=True)
    assert peer.poll() == KVPoll.Transferring and peer.inflight_reads() == 2
    # The source is read at ack time: overwrite it now, decode must see the new values.
    side.src_pool.kv_buffer[:, :, 9] = 7.0
    side.clock.advance(0.5)
    assert peer.poll() == KVPoll.Success and peer.inflight_reads() == 0
    dpl, k, v = side.received_kv("r")
    assert dpl == 0
    for layer in range(L):
        assert torch.equal(k[layer], side.src_pool.k_buffer[layer][src])
        assert torch.equal(v[layer], side.src_pool.v_buffer[layer][src])
    assert [(s.attempt, s.start, s.end, s.last) for s in side.send_log] == [
        (1, 0, 4, False),
        (1, 4, 6, True),
    ]
    side.release("r")
    assert side.allocator.available_size() == side.allocator.size


@pytest.mark.parametrize("kind", ["mla", "mha_k192_v128"])
def test_decode_side_of_an_mla_or_asymmetric_pool_receives_every_buffer(kind):
    """The decode pool takes the prefill pool's kind and geometry (``simulated``); a send lands
    every layer of every buffer: MLA's latent, or K and V of different widths."""
    if kind == "mla":
        src = MLATokenToKVPool(64, 2, torch.float32, 12, 4, L, "cpu")
        src.kv_buffer_all.copy_(torch.randn_like(src.kv_buffer_all))
    else:
        src = MHATokenToKVPool(64, 2, torch.float32, H, 6, L, "cpu", v_head_dim=4)
        for t in (src.k_buffer_all, src.v_buffer_all):
            t.copy_(torch.randn_like(t))
    side = DecodeSide(src, VirtualClock(), PeerConfig(), size=32)
    assert type(side.pool) is type(src) and side.pool.get_size_per_token() == \
        src.get_size_per_token()  # fmt: skip
    peer = side.create_peer("r", 5)
    peer.poll()
    peer.init(attempt=1)
    rows = torch.tensor([7, 3, 4, 20, 9])
    peer.send(1, 0, 5, rows, last=True)
    assert peer.poll() == KVPoll.Success
    dpl, *got = side.received_kv("r")
    want = read_kv(src, rows)
    assert dpl == 0 and len(got) == len(want) == (1 if kind == "mla" else 2)
    for g, w in zip(got, want, strict=True):
        assert torch.equal(g, w)
    wrong = (MHATokenToKVPool(32, 2, torch.float32, H, D, L, "cpu") if kind == "mla"
             else MLATokenToKVPool(32, 2, torch.float32, 4, 4, L, "cpu"))  # fmt: skip
    with pytest.raises(ValueError, match="dst_pool"):
        copy_send(src, wrong, rows, rows, block_quota=2)
    assert not any(t.any() for kind_ in read_kv(wrong, torch.arange(32)) for t in kind_)


@pytest.mark.parametrize("kind", ["mla", "mha"])
def test_write_kv_is_read_kvs_inverse_and_refuses_a_wrong_shape(kind):
    """What ``read_kv`` returns, written into a fresh pool of the kind at other slots, reads back
    bit for bit there and nowhere else; a tuple of the wrong kinds leaves the pool zero."""
    src = (MLATokenToKVPool(32, 2, torch.float32, 12, 4, L, "cpu") if kind == "mla"
           else MHATokenToKVPool(32, 2, torch.float32, H, D, L, "cpu"))  # fmt: skip
    for t in read_kv(src, torch.arange(32)):
        assert t.abs().sum() == 0
    buffers = [src.kv_buffer_all] if kind == "mla" else [src.k_buffer_all, src.v_buffer_all]
    for t in buffers:
        t.copy_(torch.randn_like(t))
    kv = read_kv(src, torch.tensor([3, 4, 9]))
    dst = decode_pool_like(src, 16)
    at = torch.tensor([10, 2, 5])
    write_kv(dst, at, kv)
    for got, want in zip(read_kv(dst, at), kv, strict=True):
        assert torch.equal(got, want)
    rest = torch.tensor([i for i in range(16) if i not in (10, 2, 5)])
    assert not any(t.any() for t in read_kv(dst, rest))
    other = decode_pool_like(src, 16)
    with pytest.raises(ValueError, match="kv"):
        write_kv(other, at, (*kv, kv[0]))
    with pytest.raises(ValueError, match="kv"):
        write_kv(other, at[:2], kv)
    assert not any(t.any() for t in read_kv(other, torch.arange(16)))


def test_decode_prefix_len_is_page_aligned_and_skips_the_prefix():
    side = make_side(page_size=4, decode_prefix_len=9)
    peer = side.create_peer("r", 14)
    assert peer.decode_prefix_len == 8
    short = side.create_peer("s", 8)
    assert short.decode_prefix_len == 4  # at least one token left to send
    peer.poll()
    peer.init(0)
    with pytest.raises(ValueError, match="expected start 8"):
        peer.send(0, 0, 14, torch.arange(4, 18), last=True)
    peer.send(0, 8, 14, torch.arange(4, 10), last=True)
    assert peer.poll() == KVPoll.Success
    dpl, k, _ = side.received_kv("r")
    assert dpl == 8 and k.shape == (L, 6, H, D)


def test_bootstrap_failure_is_deterministic_per_rid():
    delay = DelayDistribution("uniform", 0, 1)
    cfg = dict(bootstrap_failure_prob=0.5, seed=3, bootstrap_delay=delay)
    a, b = make_side(**cfg), make_side(**cfg)
    rids = [f"req-{i}" for i in range(40)]
    peers = {}
    for side in (a, b):
        peers[side] = [side.create_peer(rid, 4) for rid in rids]
        side.clock.advance(1.0)
    states_a = [p.poll() for p in peers[a]]
    states_b = [p.poll() for p in peers[b]]
    assert states_a == states_b
    assert KVPoll.Failed in states_a and KVPoll.WaitingForInput in states_a
    assert [p.ready_at for p in peers[a]] == [p.ready_at for p in peers[b]]
    # A failed peer is forgotten by its side at once; the others stay.
    assert sorted(a.peers) == sorted(
        r for r, st in zip(rids, states_a, strict=True) if st != KVPoll.Failed
    )


def test_transfer_failure_turns_failed_and_skips_the_copy():
    side = make_side(transfer_failure_prob=1.0, transfer_latency_s=1.0)
    peer = side.create_peer("r", 3)
    peer.poll()
    peer.init(0)
    peer.send(0, 0, 3, torch.tensor([1, 2, 3]), last=True)
    assert peer.poll() == KVPoll.Transferring
    side.clock.advance(1.0)
    assert peer.poll() == KVPoll.Failed and peer.inflight_reads() == 0
    assert side.allocator.available_size() == side.allocator.size  # decode slots released


def test_fail_while_transferring_never_reads_the_sends_in_flight():
    side = make_side(transfer_latency_s=1.0)
    peer = side.create_peer("r", 3)
    peer.poll()
    peer.init(0)
    before = side.pool.k_buffer[0].clone()
    peer.send(0, 0, 3, torch.tensor([1, 2, 3]), last=True)
    peer.fail()
    assert peer.poll() == KVPoll.Failed
    # The prefill side may free the source at once: nothing will read it.
    assert peer.inflight_reads() == 0 and peer.transfers[0].src is None
    assert side.next_event_time() is None and "r" not in side.peers
    side.clock.advance(1.0)
    assert peer.poll() == KVPoll.Failed and peer.received_end == 0
    assert torch.equal(side.pool.k_buffer[0], before)


def test_send_before_ready_or_after_fail_raises():
    side = make_side(bootstrap_delay=DelayDistribution("fixed", 5.0))
    peer = side.create_peer("r", 3)
    with pytest.raises(RuntimeError, match="init in state Bootstrapping"):
        peer.init(0)
    peer.set_ready()
    peer.init(0)
    peer.fail()
    # A send to a failed peer is dropped (a transport error), not a protocol violation.
    assert peer.send(0, 0, 3, torch.tensor([1, 2, 3]), last=True) is False
    assert list(side.send_log) == [] and peer.transfers == []


def test_full_decode_pool_keeps_bootstrapping():
    side = make_side(size=4)
    a, b = side.create_peer("a", 4), side.create_peer("b", 4)
    assert a.poll() == KVPoll.WaitingForInput
    assert b.poll() == KVPoll.Bootstrapping
    a.fail()
    assert b.poll() == KVPoll.WaitingForInput


def test_full_decode_pool_reports_the_timeout_not_a_past_time():
    side = make_side(size=4, bootstrap_delay=DelayDistribution("fixed", 0.1),
                     bootstrap_timeout_s=300.0)  # fmt: skip
    a, b = side.create_peer("a", 4), side.create_peer("b", 4)
    assert side.next_event_time() == pytest.approx(0.1)
    side.clock.advance(0.1)
    assert a.poll() == KVPoll.WaitingForInput and b.poll() == KVPoll.Bootstrapping
    # b's delay is over but it cannot preallocate: its next event is its timeout, never 0.1.
    assert b.next_event_time() == pytest.approx(300.0)
    assert side.next_event_time() == pytest.approx(300.0)  # a has nothing pending
    side.clock.wait_until(side.next_event_time())
    assert b.poll() == KVPoll.Failed and b.timed_out
    assert "timed out after 300.0s in KVPoll.Bootstrapping" in b.failure
    assert "SGLANG_DISAGGREGATION_BOOTSTRAP_TIMEOUT=300" in b.failure
    assert a.poll() == KVPoll.WaitingForInput  # a preallocated: no timeout for it


def test_bootstrap_timeout_counts_from_creation_and_spares_a_ready_peer():
    side = make_side(bootstrap_delay=DelayDistribution("fixed", 10.0), bootstrap_timeout_s=5.0)
    late = side.create_peer("late", 2)
    side.clock.advance(2.0)
    young = side.create_peer("young", 2)
    assert side.next_event_time() == pytest.approx(5.0)
    side.clock.wait_until(5.0)
    assert late.poll() == KVPoll.Failed and young.poll() == KVPoll.Bootstrapping
    young.set_ready()  # ready before its own deadline at 7.0
    side.clock.wait_until(8.0)
    assert young.poll() == KVPoll.WaitingForInput and young.next_event_time() is None


def test_bootstrap_timeout_env_var(monkeypatch):
    from hicache_prefill.prefill.disagg.protocol import BOOTSTRAP_TIMEOUT_ENV

    class Args:
        pass

    assert BOOTSTRAP_TIMEOUT_ENV == "SGLANG_DISAGGREGATION_BOOTSTRAP_TIMEOUT"
    monkeypatch.delenv(BOOTSTRAP_TIMEOUT_ENV, raising=False)
    assert PeerConfig.from_server_args(Args()).bootstrap_timeout_s == 300.0
    monkeypatch.setenv(BOOTSTRAP_TIMEOUT_ENV, "600")
    assert PeerConfig.from_server_args(Args()).bootstrap_timeout_s == 600.0
    for bad in ("0", "-3", "soon", "1.5"):
        monkeypatch.setenv(BOOTSTRAP_TIMEOUT_ENV, bad)
        with pytest.raises(ValueError, match=BOOTSTRAP_TIMEOUT_ENV):
            PeerConfig.from_server_args(Args())
    with pytest.raises(ValueError, match="bootstrap_timeout_s"):
        PeerConfig(bootstrap_timeout_s=0)


def test_finished_peers_are_forgotten_and_a_rid_can_come_back():
    side = make_side(keep=False, send_log_size=3)
    for _ in range(5):
        peer = side.create_peer("r", 2)  # the same rid, again and again
        peer.poll()
        peer.init(0)
        peer.send(0, 0, 2, torch.tensor([1, 2]), last=True)
        assert peer.poll() == KVPoll.Success
        assert peer.transfers[0].src is None  # the acked send dropped its copy of the slots
    assert side.peers == {} and side._live == {} and side.next_event_time() is None
    assert len(side.send_log) == 3  # the latest sends only
    assert side.allocator.available_size() == side.allocator.size


def test_kept_peer_is_released_by_a_new_peer_of_its_rid_but_a_live_one_is_not():
    side = make_side(keep=True)
    peer = side.create_peer("r", 2, token_ids=[5, 6])
    peer.poll()
    peer.init(0)
    peer.send(0, 0, 2, torch.tensor([1, 2]), last=True)
    assert peer.poll() == KVPoll.Success and peer.token_ids == [5, 6]
    assert side.received_kv("r")[1].shape == (L, 2, H, D)
    again = side.create_peer("r", 2)
    assert side.peers["r"] is again and peer.decode_slots is None
    with pytest.raises(ValueError, match="already has a live decode peer"):
        side.create_peer("r", 2)
    with pytest.raises(ValueError, match="no received KV"):
        side.received_kv("r")
    old_fails_late = peer
    old_fails_late.fail()  # a stale peer never touches its successor
    assert side.peers["r"] is again


def test_keep_received_false_frees_at_success():
    side = make_side(keep=False)
    peer = side.create_peer("r", 2)
    peer.poll()
    peer.init(0)
    peer.send(0, 0, 2, torch.tensor([1, 2]), last=True)
    assert peer.poll() == KVPoll.Success
    assert side.allocator.available_size() == side.allocator.size


def test_force_not_ready_is_a_deterministic_rid_hash():
    rids = [f"r{i}" for i in range(2000)]
    hits = [force_not_ready(r, 0.3) for r in rids]
    assert hits == [force_not_ready(r, 0.3) for r in rids]
    assert 0.25 < sum(hits) / len(hits) < 0.35
    assert not any(force_not_ready(r, 0.0) for r in rids)
    assert all(force_not_ready(r, 1.0) for r in rids)


def test_peer_config_validation_and_server_args():
    with pytest.raises(ValueError, match="bootstrap_failure_prob"):
        PeerConfig(bootstrap_failure_prob=1.5)

    class Args:
        random_seed = 7
        disaggregation_bootstrap_failure_prob = 0.1
        disaggregation_bootstrap_delay = "uniform:0.1,0.2"
        disaggregation_transfer_bandwidth_gbps = 50.0

    cfg = PeerConfig.from_server_args(Args())
    assert cfg.seed == 7 and cfg.bootstrap_failure_prob == 0.1
    assert cfg.bootstrap_delay == DelayDistribution("uniform", 0.1, 0.2)
    assert cfg.transfer_bandwidth == 50e9 and cfg.transfer_failure_prob == 0.0


def test_upstream_env_var_overrides_force_probability(monkeypatch):
    from hicache_prefill.prefill.disagg.protocol import FORCE_RETRY_ENV

    class Args:
        disaggregation_force_not_ready_prob = 0.0

    monkeypatch.setenv(FORCE_RETRY_ENV, "0.25")
    assert PeerConfig.from_server_args(Args()).force_not_ready_prob == 0.25


def test_positive_env_is_the_one_parser_of_sglangs_timeouts(monkeypatch):
    """Every timeout and count read from SGLang's variables (bootstrap, decode waiting /
    release / heartbeat, the failed-session probe) goes through ``positive_env``."""
    from hicache_prefill.prefill.disagg.protocol import positive_env

    monkeypatch.delenv("HICACHE_TEST_ENV", raising=False)
    assert positive_env("HICACHE_TEST_ENV", 30) == 30.0
    monkeypatch.setenv("HICACHE_TEST_ENV", "2.5")
    assert positive_env("HICACHE_TEST_ENV", 30) == 2.5
    with pytest.raises(ValueError, match=r"HICACHE_TEST_ENV='2.5' must be a positive integer"):
        positive_env("HICACHE_TEST_ENV", 30, int)
    for bad in ("0", "-1", "never"):
        monkeypatch.setenv("HICACHE_TEST_ENV", bad)
        with pytest.raises(ValueError, match="HICACHE_TEST_ENV"):
            positive_env("HICACHE_TEST_ENV", 30)
