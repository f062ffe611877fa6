"""HiRadixCache stories, one per write policy, plus the chunked-insert flaw and bad calls.

Copies run on CPU stream threads. Stories that must see a copy *before* its ack close a gate
that every copy waits on, so what is acked when is decided by the test, not by timing.
"""

from __future__ import annotations

import threading

import pytest
import torch

from hicache_prefill.hicache.builder import KVCache, build_kv_cache
from hicache_prefill.server_args import ServerArgs
from tests.support.kv_content import check_device, check_tree_content, write_device

PAGE = 4


class Gate:
    """A copy delay that blocks every copy until ``open()``."""

    def __init__(self, is_open: bool = True) -> None:
        self._event = threading.Event()
        if is_open:
            self._event.set()

    def __call__(self) -> float:
        self._event.wait()
        return 0.0

    def open(self) -> None:
        self._event.set()

    def close(self) -> None:
        self._event.clear()


def make_cache(
    policy: str,
    *,
    gate: Gate | None = None,
    device_tokens: int = 32,
    ratio: float = 2.0,
    threshold: int = 1,
    upstream_chunked: bool = False,
    use_mla: bool = False,
    device: str = "cpu",
    layout: str = "layer_first",
    io: str = "direct",
    streams: str = "thread",
) -> KVCache:
    geometry = (
        dict(use_mla=True, kv_lora_rank=4, qk_rope_head_dim=2) if use_mla else dict(head_num=1)
    )
    args = ServerArgs(
        device=device,
        dtype="float32",
        num_layers=2,
        head_dim=4,
        max_total_tokens=device_tokens,
        page_size=PAGE,
        enable_hierarchical_cache=True,
        hicache_ratio=ratio,
        hicache_write_policy=policy,
        hicache_mem_layout=layout,
        hicache_io_backend=io,
        load_back_threshold=threshold,
        hicache_upstream_chunked_insert=upstream_chunked,
        **geometry,
    )
    streams_arg = None if device == "cuda" else streams  # CUDA streams launch inline already
    if gate is None:
        return build_kv_cache(args, streams=streams_arg)
    return build_kv_cache(args, copy_delay=gate, streams=streams_arg)


@pytest.fixture
def caches():
    made: list[KVCache] = []
    yield made
    for kv in made:
        kv.close()


def drain(kv: KVCache) -> None:
    """Let every launched copy finish, then let the tree take the acks."""
    kv.controller.write_stream.synchronize()
    kv.controller.load_stream.synchronize()
    kv.tree.check_hicache_events()


def compute(kv: KVCache, key: list[int], chunked: bool = False) -> int:
    """A request: match, compute the missing suffix (deterministic KV), insert, release.
    Returns the device-hit length it started from."""
    tree = kv.tree
    m = tree.match_prefix(key)
    tree.inc_lock_ref(m.last_device_node)
    hit = len(m.device_indices)
    new = kv.allocator.alloc(len(key) - hit)
    if new is None:
        tree.evict(len(key) - hit)
        new = kv.allocator.alloc(len(key) - hit)
    assert new is not None
    write_device(kv.device_pool, new, key[hit:], list(range(hit, len(key))))
    present = tree.insert(key, torch.cat([m.device_indices, new]), chunked=chunked)
    kv.allocator.free(torch.cat([m.device_indices, new])[hit:present])
    tree.dec_lock_ref(m.last_device_node)
    kv.check_integrity()
    return hit


A = list(range(100, 108))  # two pages
B = A + list(range(200, 208))  # A plus two pages


def load_back(kv: KVCache, key: list[int]) -> torch.Tensor:
    tree = kv.tree
    m = tree.match_prefix(key)
    dev, last = tree.init_load_back(m.last_host_node, m.host_hit_length)
    tree.ready_to_load_host_cache()
    for layer in range(kv.device_pool.layer_num):
        tree.layer_wait(layer)
    check_device(
        kv.device_pool, dev, key[len(m.device_indices) :], range(len(m.device_indices), len(key))
    )
    return dev


@pytest.mark.parametrize("use_mla", [False, True], ids=["mha", "mla"])
def test_write_through_story(caches, use_mla) -> None:
    gate = Gate(is_open=False)
    kv = make_cache("write_through", gate=gate, use_mla=use_mla)
    caches.append(kv)
    tree = kv.tree

    compute(kv, A)
    node = tree.match_prefix(A).last_device_node
    assert node.backuped and node.hit_count == 1  # backed up at the first insert
    assert node.lock_ref == 1  # ... and locked until the ack
    assert tree.evict(100) == 0  # the copy has not finished: nothing is evictable
    kv.check_integrity()

    gate.open()
    drain(kv)
    assert node.lock_ref == 0 and tree.evictable_size() == 8
    check_tree_content(kv)

    # device eviction keeps the node host-only
    assert tree.evict(8) == 8
    m = tree.match_prefix(A)
    assert len(m.device_indices) == 0 and m.host_hit_length == 8
    assert m.last_host_node is node and m.last_device_node is tree.root_node
    check_tree_content(kv)
    kv.check_integrity()

    # load back, then a re-hit on the device
    dev = load_back(kv, A)
    assert tree.match_prefix(A).device_indices.tolist() == dev.tolist()
    assert node.lock_ref == 1  # held until the load ack
    drain(kv)
    assert node.lock_ref == 0
    kv.check_integrity()
    check_tree_content(kv)

    # a branching request reuses the loaded prefix and backs up its new pages
    assert compute(kv, B) == 8
    drain(kv)
    assert tree.evict(100) == 16
    assert tree.match_prefix(B).host_hit_length == 16

    # host eviction: leaves first, then the freed parent; then everything is gone
    assert tree.evict_host(8) == 8
    assert tree.match_prefix(B).host_hit_length == 8
    assert tree.evict_host(100) == 8
    assert not tree.root_node.children
    assert kv.host_pool.available_size() == kv.host_pool.size
    assert kv.allocator.available_size() == kv.allocator.size
    kv.check_integrity()
    assert kv.stats.backed_up_tokens == 16 and kv.stats.loaded_tokens == 8
    # prefix hits are the admitting executor's to record, not match_prefix's
    s = kv.stats
    assert (s.matched_attempts, s.device_hit_tokens, s.host_hit_tokens) == (0, 0, 0)


def test_write_through_selective_story(caches, stream_mode) -> None:
    kv = make_cache("write_through_selective", streams=stream_mode)
    caches.append(kv)
    tree = kv.tree

    compute(kv, A)
    drain(kv)
    node = tree.match_prefix(A).last_device_node
    assert not node.backuped  # one insert: below the threshold of 2
    assert tree.evict(8) == 8  # not backed up: deleted, KV lost
    assert tree.match_prefix(A).host_hit_length == 0 and not tree.root_node.children

    compute(kv, A)
    compute(kv, A)  # second insert: backed up now
    node = tree.match_prefix(A).last_device_node
    assert node.hit_count == 2 and node.backuped
    drain(kv)
    check_tree_content(kv)
    assert tree.evict(8) == 8
    assert tree.match_prefix(A).host_hit_length == 8
    load_back(kv, A)
    drain(kv)
    assert len(tree.match_prefix(A).device_indices) == 8
    assert tree.evict(8) == 8 and tree.evict_host(8) == 8
    assert not tree.root_node.children
    kv.check_integrity()


def test_write_back_story(caches) -> None:
    gate = Gate(is_open=False)
    kv = make_cache("write_back", gate=gate)
    caches.append(kv)
    tree = kv.tree

    compute(kv, A)
    compute(kv, A)
    compute(kv, B)
    node = tree.match_prefix(A).last_device_node
    assert not node.backuped and node.lock_ref == 0  # never backed up on insert
    assert kv.stats.backed_up_tokens == 0

    # eviction backs up, waits for the copy, then frees: it blocks until the gate opens
    waiting = threading.Event()
    wait_write = kv.controller.wait_write

    def traced_wait_write(node_ids=None):
        waiting.set()
        return wait_write(node_ids)

    kv.controller.wait_write = traced_wait_write
    result: list[int] = []
    worker = threading.Thread(target=lambda: result.append(tree.evict(16)))
    worker.start()
    waiting.wait()  # evict is inside wait_write; its copies cannot run before the gate opens
    assert result == [] and kv.controller.ack_write_queue
    gate.open()
    worker.join()
    assert result == [16]
    assert node.evicted and node.backuped
    m = tree.match_prefix(B)
    assert m.host_hit_length == 16 and not tree.ongoing_write_through
    check_tree_content(kv)
    kv.check_integrity()

    load_back(kv, B)
    drain(kv)
    assert len(tree.match_prefix(B).device_indices) == 16
    check_tree_content(kv)
    # a revived/loaded node keeps its host copy: evicting again needs no new backup
    backed = kv.stats.backed_up_tokens
    assert tree.evict(16) == 16 and kv.stats.backed_up_tokens == backed
    assert tree.evict_host(16) == 16
    assert not tree.root_node.children
    kv.check_integrity()


def test_write_back_keeps_lru_order_when_the_host_is_full(caches, stream_mode) -> None:
    """Host pool 16 tokens, four 8-token keys on the device, evict all: the backups of the
    oldest keys fill the host first, so they are finished and host-evicted to make room for
    the newer ones. The two most recently used keys keep their host copy."""
    kv = make_cache("write_back", device_tokens=32, ratio=0.5, streams=stream_mode)
    caches.append(kv)
    tree = kv.tree
    keys = [list(range(100 * i, 100 * i + 8)) for i in range(4)]
    for k in keys:  # oldest first
        compute(kv, k)
    assert kv.host_pool.size == 16
    assert tree.evict(32) == 32
    hits = [tree.match_prefix(k).host_hit_length for k in keys]
    assert hits == [0, 0, 8, 8]
    check_tree_content(kv)
    kv.check_integrity()


POLICIES = ["write_through", "write_through_selective", "write_back"]
DEVICES = ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)]


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("policy", POLICIES)
def test_policy_round_trip_with_kernels(caches, policy, device, stream_mode) -> None:
    """Cache, evict to host, load back and re-hit through the Triton copy kernels (page_first
    host layout); on CUDA this runs on real streams and pinned host memory."""
    if device == "cuda" and stream_mode == "inline":
        pytest.skip("CUDA streams launch inline already: the thread run covers it")
    kv = make_cache(policy, device=device, layout="page_first", io="kernel", streams=stream_mode)
    caches.append(kv)
    tree = kv.tree
    for _ in range(2):  # twice, so write_through_selective backs up too
        compute(kv, B)
    drain(kv)
    check_tree_content(kv)
    assert tree.evict(100) == 16
    assert tree.match_prefix(B).host_hit_length == 16
    dev = load_back(kv, B)
    drain(kv)
    assert tree.match_prefix(B).device_indices.tolist() == dev.tolist()
    check_tree_content(kv)
    assert tree.evict(100) == 16 and tree.evict_host(100) == 16
    assert kv.allocator.available_size() == kv.allocator.size
    kv.check_integrity()


def test_recompute_revives_host_only_nodes(caches, stream_mode) -> None:
    kv = make_cache("write_through", streams=stream_mode)
    caches.append(kv)
    tree = kv.tree
    compute(kv, B)
    drain(kv)
    tree.evict(16)
    # a request that ignores the host hit recomputes; insert gives the nodes its slots
    m = tree.match_prefix(B)
    slots = kv.allocator.alloc(16)
    write_device(kv.device_pool, slots, B, list(range(16)))
    assert tree.insert(B, slots) == 0  # nothing was device-resident: the tree keeps all 16
    assert tree.match_prefix(B).device_indices.tolist() == slots.tolist()
    assert m.last_host_node.backuped
    kv.check_integrity()
    check_tree_content(kv)


def test_load_back_below_threshold_recomputes(caches, stream_mode) -> None:
    kv = make_cache("write_through", threshold=10, streams=stream_mode)
    caches.append(kv)
    tree = kv.tree
    compute(kv, A)
    drain(kv)
    tree.evict(8)
    m = tree.match_prefix(A)
    dev, last = tree.init_load_back(m.last_host_node, m.host_hit_length)
    assert dev.numel() == 0 and last is tree.root_node  # 8 < 10 tokens: recompute
    assert m.last_host_node.evicted
    kv.check_integrity()


def test_load_back_evicts_to_make_room(caches, stream_mode) -> None:
    kv = make_cache("write_through", device_tokens=16, streams=stream_mode)
    caches.append(kv)
    tree = kv.tree
    compute(kv, A)
    drain(kv)
    tree.evict(8)
    other = list(range(300, 308))
    compute(kv, other)
    filler = kv.allocator.alloc(kv.allocator.available_size())  # a request holds the rest
    drain(kv)
    dev = load_back(kv, A)  # evicts `other` (backed up) to make room
    assert dev.numel() == 8
    assert tree.match_prefix(other).host_hit_length == 8
    drain(kv)
    kv.check_integrity(request_owned=filler.numel())
    kv.allocator.free(filler)


def test_load_back_without_device_room_recomputes_and_is_counted(caches, stream_mode) -> None:
    kv = make_cache("write_through", device_tokens=16, streams=stream_mode)
    caches.append(kv)
    tree = kv.tree
    compute(kv, A)
    drain(kv)
    tree.evict(8)
    filler = kv.allocator.alloc(kv.allocator.available_size())  # requests in flight hold it all
    m = tree.match_prefix(A)
    assert m.host_hit_length == 8
    dev, last = tree.init_load_back(m.last_host_node, m.host_hit_length)
    assert dev.numel() == 0 and last is tree.root_node and m.last_host_node.evicted
    assert kv.stats.load_back_no_room_tokens == 8 and kv.stats.loaded_tokens == 0
    kv.check_integrity(request_owned=filler.numel())
    kv.allocator.free(filler)
    assert load_back(kv, A).numel() == 8  # room again: the same hit loads, nothing more counted
    assert kv.stats.load_back_no_room_tokens == 8
    drain(kv)
    kv.check_integrity()


@pytest.mark.parametrize("upstream", [True, False], ids=["upstream_flaw", "fixed"])
def test_chunked_insert_backup(caches, upstream, stream_mode) -> None:
    """A long prompt prefilled in chunks: every insert of the unfinished request is chunked."""
    kv = make_cache("write_through", upstream_chunked=upstream, streams=stream_mode)
    caches.append(kv)
    tree = kv.tree
    prompt = list(range(500, 524))  # six pages, three chunks of two pages
    for end in (8, 16, 24):
        compute(kv, prompt[:end], chunked=True)
    drain(kv)
    nodes = [x for x in tree.all_nodes()]
    assert sum(len(x.key) for x in nodes) == 24
    tree.evict(24)
    m = tree.match_prefix(prompt)
    if upstream:
        # SGLang: chunked inserts never count, so nothing was backed up and eviction lost it all
        assert all(x.hit_count == 0 for x in nodes)
        assert m.host_hit_length == 0 and not tree.root_node.children
        assert kv.stats.backed_up_tokens == 0
    else:
        # fixed: every complete page was backed up as it was inserted, without counting hits
        assert all(x.hit_count == 0 for x in nodes)
        assert m.host_hit_length == 24 and kv.stats.backed_up_tokens == 24
        check_tree_content(kv)
    kv.check_integrity()


def test_host_copy_not_matchable_before_ack(caches) -> None:
    gate = Gate(is_open=False)
    kv = make_cache("write_through", gate=gate)
    caches.append(kv)
    tree = kv.tree
    compute(kv, A)
    assert tree.unacked_write_host_slots().numel() == 8
    assert tree.evict(8) == 0  # locked until the ack: it stays a device hit
    assert len(tree.match_prefix(A).device_indices) == 8
    tree.check_hicache_events()  # not finished: nothing changes
    assert tree.match_prefix(A).last_device_node.lock_ref == 1
    kv.check_integrity()
    gate.open()
    drain(kv)
    assert tree.unacked_write_host_slots().numel() == 0
    assert tree.evict(8) == 8
    kv.check_integrity()


def test_evict_host_never_frees_a_device_mirror(caches, stream_mode) -> None:
    kv = make_cache("write_through", streams=stream_mode)
    caches.append(kv)
    tree = kv.tree
    compute(kv, A)
    drain(kv)
    assert tree.evict_host(100) == 0
    assert tree.match_prefix(A).last_device_node.backuped
    kv.check_integrity()


def test_dropping_an_unbacked_parent_frees_its_host_only_children(caches, stream_mode) -> None:
    """A parent whose backup failed (host full) under a child that was backed up: evicting the
    parent loses its KV, and the child's host copy (unreachable without it) goes too."""
    kv = make_cache("write_through", ratio=0.25, streams=stream_mode)  # host: 8 tokens
    caches.append(kv)
    tree = kv.tree
    x = list(range(900, 904))
    p = list(range(600, 608))
    compute(kv, x)  # backed up: 4 of 8 host slots used, a mirror (not host-evictable)
    compute(kv, p)  # needs 8 host slots, 4 free: backup fails
    compute(kv, p + list(range(700, 704)))  # P retried (fails), the new child fits
    drain(kv)
    parent = tree.match_prefix(p).last_device_node
    child = tree.match_prefix(p + list(range(700, 704))).last_device_node
    assert not parent.backuped and child.backuped
    assert kv.host_pool.available_size() == 0
    assert tree.evict(100) == 16
    assert tree.match_prefix(p).host_hit_length == 0 and parent.parent is None
    assert tree.match_prefix(x).host_hit_length == 4
    assert kv.host_pool.available_size() == 4 and kv.stats.evicted_host_tokens == 4
    kv.check_integrity()


def test_bad_calls_raise_and_change_nothing(caches, stream_mode) -> None:
    kv = make_cache("write_through", streams=stream_mode)
    caches.append(kv)
    tree = kv.tree
    compute(kv, A)
    drain(kv)
    node = tree.match_prefix(A).last_device_node
    before = (len(tree.all_nodes()), tree.evictable_size(), kv.allocator.available_size())

    with pytest.raises(ValueError, match="8 tokens but value has 4"):
        tree.insert(B[:8], torch.arange(4, dtype=torch.int64))
    with pytest.raises(ValueError, match="value is required"):
        tree.insert(B)  # token ids are not slots: only a simulated tree takes keys alone
    with pytest.raises(ValueError, match="below 0"):
        tree.dec_lock_ref(node)
    with pytest.raises(ValueError, match="num_tokens"):
        tree.evict(-1)
    with pytest.raises(ValueError, match="num_tokens"):
        tree.evict_host(-1)
    assert (len(tree.all_nodes()), tree.evictable_size(), kv.allocator.available_size()) == before

    tree.evict(8)
    with pytest.raises(ValueError, match="evicted"):
        tree.inc_lock_ref(node)  # host-only nodes are not lockable
    with pytest.raises(ValueError, match="host_hit_length"):
        tree.init_load_back(node, -1)
    tree.evict_host(8)
    with pytest.raises(ValueError, match="not in this tree"):
        tree.init_load_back(node, 8)  # a stale match result of a deleted node
    kv.check_integrity()


def test_device_only_when_off() -> None:
    args = ServerArgs(
        device="cpu", num_layers=2, head_num=1, head_dim=4, max_total_tokens=32, page_size=PAGE
    )
    kv = build_kv_cache(args)
    assert type(kv.tree).__name__ == "RadixCache"
    assert kv.host_pool is None and kv.controller is None and not kv.hierarchical
    compute(kv, A)
    assert kv.tree.evict(8) == 8
    kv.check_integrity()
    kv.close()


@pytest.mark.parametrize(
    "extra, match",
    [
        (dict(hicache_storage_backend="nosuch"), "--hicache-storage-backend=nosuch"),
        (dict(pp_size=2), "pp-size"),
    ],
)
def test_unsupported_configurations_are_refused(extra, match) -> None:
    args = ServerArgs(
        device="cpu",
        num_layers=2,
        head_num=1,
        head_dim=4,
        max_total_tokens=32,
        enable_hierarchical_cache=True,
        **extra,
    )
    with pytest.raises(ValueError, match=match):
        build_kv_cache(args)


@pytest.mark.parametrize("policy", ["write_through", "write_back"])
def test_both_queues_evict_what_a_full_scan_would(caches, policy, stream_mode) -> None:
    """Random requests, device and host evictions: each single-leaf eviction of either tier
    takes the leaf a scan of the whole tree by (access time, id) would pick."""
    import random

    rng = random.Random(1)
    kv = make_cache(policy, device_tokens=64, ratio=2.0, streams=stream_mode)
    caches.append(kv)
    tree = kv.tree
    for _ in range(150):
        op = rng.random()
        key = [
            p * 10 + i
            for p in [rng.randrange(3) for _ in range(rng.randrange(1, 4))]
            for i in range(PAGE)
        ]
        if op < 0.5:
            m = tree.match_prefix(key)
            if kv.allocator.available_size() + tree.evictable_size() >= len(key):
                compute(kv, key)
            elif m.host_hit_length:
                tree.init_load_back(m.last_host_node, m.host_hit_length)
                tree.ready_to_load_host_cache()
        elif op < 0.6:
            tree.match_prefix(key)
        elif op < 0.8:
            drain(kv)
            leaves = [
                x
                for x in tree.all_nodes()
                if not x.evicted and x.lock_ref == 0 and x.device_children == 0
            ]
            if leaves:
                oldest = min(leaves, key=lambda x: (x.last_access_time, x.id))
                tree.evict(1)
                assert oldest.evicted or oldest.parent is None
        else:
            drain(kv)
            leaves = [
                x for x in tree.all_nodes() if x.evicted and not x.children and x.host_ref == 0
            ]
            if leaves:
                oldest = min(leaves, key=lambda x: (x.last_access_time, x.id))
                assert tree.evict_host(1) == len(oldest.key)
                assert oldest.parent is None
        drain(kv)
        kv.check_integrity()
