"""The hierarchical cache across real tensor-parallel ranks (gloo, 2 and 4 processes): every rank
plays the same seeded sequence of cache operations on its own shard of the KV heads while its
copies finish at its own pace and its host pool refuses room on its own, and every decision
stays the group's.

After every operation: all ranks' ``tree_state`` digests are equal (``assert_same``), each rank's
``check_integrity`` passes, and every readable device slot and acked host copy holds exactly its
tokens' KV for this rank's KV heads (``tests/support/kv_content.py`` with the shard's head offset).
The watchdog of ``run_ranks`` fails a hang with every rank's stack.

Then the same machinery with a rank-local decision injected on purpose: rank 1 applying its own
ack count, rank 1 committing a backup from its own host room, rank 1 skipping the ack agreement
when its queues are empty. Each is caught, by the digest check or by the call-site check.
"""

from __future__ import annotations

import collections
import random
import threading
import time
from typing import Any, NamedTuple

import pytest
import torch

from hicache_prefill.hicache.builder import build_kv_cache
from hicache_prefill.hicache.tp.digest import tree_state
from hicache_prefill.hicache.tp.group import (
    CollectiveMismatchError,
    RankDivergenceError,
    SingleRankGroup,
    new_cache_group,
)
from hicache_prefill.prefill.model.paged import ModelConfig
from hicache_prefill.prefill.model.tp import TPShard
from hicache_prefill.server_args import ServerArgs
from tests.support.kv_content import check_device, check_tree_content, write_device
from tests.support.tp_harness import run_ranks

DEVICE_PAGES = 8
MAX_KEY_PAGES = 4
PAGE_PATTERNS = 3  # a small alphabet of pages: keys share prefixes, nodes split


class Story(NamedTuple):
    """One seeded operation sequence. Per-rank tuples are indexed by rank (cycled)."""

    policy: str
    page_size: int
    layout: str
    io: str
    steps: int
    seed: int
    host_ratios: tuple[float, ...] = (2.0,)  # each rank asks for its own; the smallest is agreed
    max_delay_ms: tuple[float, ...] = (8.0, 0.0)  # copy delay per copy, up to this, per rank
    refuse_host: float = 0.0  # probability that a rank's own host room check says no


STORIES_2 = [
    Story("write_through", 1, "layer_first", "direct", 100, 1, (2.0, 1.5), refuse_host=0.2),
    Story("write_through_selective", 16, "page_first_direct", "direct", 100, 2, (1.5, 2.0)),
    Story("write_back", 16, "layer_first", "direct", 100, 3, (1.0, 2.0), refuse_host=0.2),
    Story("write_back", 1, "page_first", "kernel", 60, 4, (2.0,), (0.0, 8.0)),
]
STORIES_4 = [
    Story(
        "write_through",
        16,
        "layer_first",
        "direct",
        50,
        5,
        (2.0, 1.5),
        (8.0, 0.0, 4.0, 0.0),
        refuse_host=0.2,
    ),  # fmt: skip
    Story(
        "write_back", 1, "page_first_direct", "direct", 50, 6, (1.5, 1.0), (0.0, 4.0, 0.0, 8.0)
    ),  # fmt: skip
]


def _key(pages: list[int], page_size: int) -> list[int]:
    return [1000 * p + i for p in pages for i in range(page_size)]


def _nodes(tree: Any) -> list[Any]:
    """Every node but the root, depth first, children by first page: the same order on every
    rank (node ids are per process)."""
    out, stack = [], [tree.root_node]
    while stack:
        x = stack.pop()
        if x is not tree.root_node:
            out.append(x)
        stack.extend(x.children[k] for k in sorted(x.children, reverse=True))
    return out


def _args(story: Story, rank: int, world: int) -> ServerArgs:
    return ServerArgs(
        device="cpu", num_layers=2, num_attention_heads=4, head_num=2, head_dim=4,
        tp_size=world, page_size=story.page_size,
        max_total_tokens=DEVICE_PAGES * story.page_size, enable_hierarchical_cache=True,
        hicache_ratio=story.host_ratios[rank % len(story.host_ratios)],
        hicache_write_policy=story.policy, hicache_mem_layout=story.layout,
        hicache_io_backend=story.io, load_back_threshold=story.page_size,
    )  # fmt: skip


class Rank:
    """One rank's cache, its shard's head offset and what its operations reached."""

    def __init__(self, story: Story, rank: int, world: int, group: Any) -> None:
        args = _args(story, rank, world)
        self.story, self.rank, self.group = story, rank, group
        self.head0 = TPShard.plan(ModelConfig.from_server_args(args), rank, world).kv_heads[0]
        delay_rng = random.Random(f"delay:{story.seed}:{rank}")
        max_delay = story.max_delay_ms[rank % len(story.max_delay_ms)] / 1e3
        self.gate = threading.Event()  # a copy waits here while the probe holds it closed
        self.gate.set()
        self.probing = False

        def copy_delay() -> float:
            self.gate.wait()
            return delay_rng.random() * max_delay

        self.kv = build_kv_cache(args, group=group, copy_delay=copy_delay)
        self.tree = self.kv.tree
        self.counts: collections.Counter[str] = collections.Counter()
        self.held: list[Any] = []
        self.history: list[list[int]] = []
        if story.refuse_host:  # this rank's host pool says "no room" on its own, now and then
            allocator, refuse = self.kv.controller.host_allocator, random.Random(f"r{rank}")
            can_alloc = allocator.can_alloc

            def flaky(n: int) -> bool:
                if not self.probing and refuse.random() < story.refuse_host:
                    self.counts["host_refused_here"] += 1
                    return False
                return can_alloc(n)

            allocator.can_alloc = flaky
        agree = group.agree_min_many

        def recorded(values: list[int], tag: str = "agree_min_many") -> list[int]:
            out = agree(values, tag=tag)
            if tag == "hicache_acks" and out != list(values):
                self.counts["acks_held_back"] += 1  # this rank had finished more than all had
            return out

        group.agree_min_many = recorded

    # ------------------------------------------------------------------ operations
    def request(self, rng: random.Random) -> None:
        """Match, maybe load back, read the prefix, compute the rest, insert, unlock."""
        tree, kv, ps = self.tree, self.kv, self.story.page_size
        if self.history and rng.random() < 0.5:  # a later turn of an earlier conversation
            pages = self.history[rng.randrange(len(self.history))]
        else:
            pages = [rng.randrange(PAGE_PATTERNS) for _ in range(rng.randint(1, MAX_KEY_PAGES))]
        key = _key(pages, ps)
        m = tree.match_prefix(key)
        prefix, last = m.device_indices, m.last_device_node
        if m.host_hit_length and rng.random() < 0.8:
            dev, last = tree.init_load_back(m.last_host_node, m.host_hit_length)
            tree.ready_to_load_host_cache()
            prefix = torch.cat([prefix, dev])
            self.counts["load_back" if dev.numel() else "load_back_refused"] += 1
        tree.inc_lock_ref(last)
        for layer in range(kv.device_pool.layer_num):
            tree.layer_wait(layer)
        check_device(kv.device_pool, prefix, key[: len(prefix)], range(len(prefix)), self.head0)
        new = kv.alloc_device(len(key) - len(prefix))
        if new is None:
            self.counts["no_device_room"] += 1
            tree.dec_lock_ref(last)
            return
        write_device(kv.device_pool, new, key[len(prefix) :], range(len(prefix), len(key)),
                     self.head0)  # fmt: skip
        present = tree.insert(key, torch.cat([prefix, new]), chunked=rng.random() < 0.2)
        assert present == len(prefix), (present, len(prefix))
        tree.dec_lock_ref(last)
        self.history.append(pages)
        self.counts["request"] += 1

    def step(self, rng: random.Random) -> str:
        tree, ps = self.tree, self.story.page_size
        ops = ["request", "request", "request", "request", "tick", "evict", "evict",
               "evict_host", "lock", "unlock", "backup", "drain"]  # fmt: skip
        op = rng.choice(ops)
        tree.check_hicache_events()  # every scheduler step polls the acks first
        if op == "request":
            self.request(rng)
        elif op == "tick":
            time.sleep(rng.random() * 0.002)
            tree.check_hicache_events()
        elif op == "evict":
            self.counts["evicted"] += tree.evict(rng.randint(1, DEVICE_PAGES) * ps)
        elif op == "evict_host":
            self.counts["evicted_host"] += tree.evict_host(rng.randint(1, DEVICE_PAGES) * ps)
        elif op == "lock":
            resident = [x for x in _nodes(tree) if not x.evicted]
            if resident:
                x = resident[rng.randrange(len(resident))]
                tree.inc_lock_ref(x)
                self.held.append(x)
        elif op == "unlock":
            if self.held:
                tree.dec_lock_ref(self.held.pop(rng.randrange(len(self.held))))
        elif op == "backup" and self.story.policy != "write_back":
            todo = [x for x in _nodes(tree) if not x.evicted and not x.backuped]
            if todo:
                done = tree.write_backup(todo[rng.randrange(len(todo))])
                self.counts["backup" if done else "backup_refused"] += 1
        elif op == "drain":
            self.drain()
        return op

    def drain(self) -> None:
        """Tick until every backup and load is acked (the loop's exit is the same on every
        rank: it reads the tree, which changes only by agreed acks)."""
        tree = self.tree
        while tree.ongoing_write_through or tree.ongoing_load_back:
            tree.check_hicache_events()
            time.sleep(0.0005)

    def probe(self) -> None:
        """What every story must reach, made certain whatever the copy timing, on one fresh key
        (the same steps on every rank): a backup, a device eviction and a load back; under
        write_through also one ack the group must hold back (rank 1's copy waits at its gate
        while every other rank waits, locally and without a collective, for its own copy to
        finish; then all agree, and rank 1 has finished none)."""
        tree, kv, ps, policy = self.tree, self.kv, self.story.page_size, self.story.policy
        self.drain()
        self.counts["evicted"] += tree.evict(DEVICE_PAGES * ps)
        self.probing = True  # no host refusals of this rank's own
        hold = policy == "write_through"
        if hold and self.rank == 1:
            self.gate.clear()
        key = _key([PAGE_PATTERNS + 7], ps)  # a page no story uses
        new = kv.alloc_device(ps)
        assert new is not None
        write_device(kv.device_pool, new, key, range(ps), self.head0)
        assert tree.insert(key, new) == 0
        node = tree.match_prefix(key).last_device_node
        if hold:
            assert tree.ongoing_write_through, "write_through backs up at insert"
            if self.rank != 1:
                while kv.controller.count_finished_writes() == 0:
                    time.sleep(0.0005)
            tree.check_hicache_events()
            self.gate.set()
        elif policy == "write_through_selective":
            assert tree.write_backup(node) == ps
        self.drain()
        self.counts["evicted"] += tree.evict(DEVICE_PAGES * ps)  # write_back backs up here
        m = tree.match_prefix(key)
        assert m.host_hit_length == ps, m
        dev, _ = tree.init_load_back(m.last_host_node, m.host_hit_length)
        tree.ready_to_load_host_cache()
        assert dev.numel() == ps
        self.counts["load_back"] += 1
        for layer in range(kv.device_pool.layer_num):
            tree.layer_wait(layer)
        check_device(kv.device_pool, dev, key, range(ps), self.head0)
        self.probing = False
        self.drain()

    def check(self) -> None:
        self.group.assert_same("tree", tree_state(self.tree))
        self.kv.check_integrity()
        check_tree_content(self.kv, self.head0)


def _play(rank: int, world: int, stories: list[Story]) -> list[dict[str, Any]]:
    """Every story on this rank; returns what each reached (plus the agreed host capacity)."""
    group = new_cache_group()
    out = []
    for story in stories:
        r = Rank(story, rank, world, group)
        rng = random.Random(story.seed)  # the same operations on every rank
        ops = []
        for _ in range(story.steps):
            ops.append(r.step(rng))
            r.check()
        while r.held:
            r.tree.dec_lock_ref(r.held.pop())
        r.probe()
        r.drain()
        r.check()
        assert all(x.lock_ref == 0 for x in _nodes(r.tree))
        stats = r.kv.stats.as_dict()
        out.append({"counts": dict(r.counts), "ops": ops, "host_size": r.kv.host_pool.size,
                    "backed_up": stats["backed_up_tokens"], "loaded": stats["loaded_tokens"],
                    "head0": r.head0})  # fmt: skip
        r.kv.close()
    return out


RANK_LOCAL = ("acks_held_back", "host_refused_here")  # may differ between ranks


def _check_runs(runs: list[list[dict[str, Any]]], stories: list[Story]) -> None:
    world = len(runs)
    for i, story in enumerate(stories):
        per_rank = [run[i] for run in runs]
        shared = [{k: v for k, v in p["counts"].items() if k not in RANK_LOCAL} for p in per_rank]
        assert all(s == shared[0] for s in shared), (story, shared)
        assert all(p["ops"] == per_rank[0]["ops"] for p in per_rank)
        hosts = {p["host_size"] for p in per_rank}
        smallest = min(story.host_ratios) * DEVICE_PAGES * story.page_size
        assert hosts == {smallest}, (story, hosts)  # the agreed capacity: the smallest asked
        assert per_rank[0]["backed_up"] > 0 and per_rank[0]["loaded"] > 0, (story, per_rank[0])
        assert shared[0].get("evicted", 0) > 0 and shared[0].get("load_back", 0) > 0, story
        if story.refuse_host:  # a refusal on one rank was a refusal on every rank
            assert sum(p["counts"].get("host_refused_here", 0) for p in per_rank) > 0
        kv_heads = sorted({p["head0"] for p in per_rank})
        assert kv_heads == [0, 1], kv_heads  # both KV heads held (split at 2, replicated at 4)
    held_back = sum(run[i]["counts"].get("acks_held_back", 0) for run in runs
                    for i in range(len(stories)))  # fmt: skip
    # (the write_through stories end with Rank.probe, so at least one ack is held back)
    assert held_back > 0, "no rank ever had more finished acks than the group: a vacuous run"
    assert world in (2, 4)


def test_two_ranks_agree_on_every_cache_decision():
    """All three write policies, page 1 and 16, direct and kernel io, per-rank copy delays, host
    sizes and host refusals."""
    _check_runs(run_ranks(_play, 2, STORIES_2), STORIES_2)


def test_four_ranks_agree_on_every_cache_decision():
    """Four ranks over two KV heads: each head replicated on two ranks."""
    _check_runs(run_ranks(_play, 4, STORIES_4), STORIES_4)


# ---------------------------------------------------------------- injected rank-local decisions
class _LocalRoom:
    """Rank 1's controller group in the injected run: every collective as the real group's,
    except that a backup's host room is this rank's own answer (it still enters the
    collective, with ``True``, so every rank stays at the same call sites)."""

    def __init__(self, group: Any) -> None:
        self._group = group
        self.rank, self.size = group.rank, group.size

    def agree_all(self, flag: bool, tag: str = "agree_all") -> bool:
        if tag == "hicache_write_room":
            self._group.agree_all(True, tag=tag)
            return bool(flag)
        return self._group.agree_all(flag, tag=tag)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._group, name)


def _inject(r: Rank, how: str) -> None:
    tree, group = r.tree, r.group
    if how == "local_ack_count":  # rank 1 enters the agreement but pops its own count
        c = tree.controller

        def local_acks() -> None:
            # Every copy launched here has finished (rank 0's are held at its gate): rank 1's
            # own count is ahead of the group's from the first backup on, whatever the timing.
            for a in list(c.ack_write_queue) + list(c.ack_load_queue):
                a.finish_event.synchronize()
            mine = [c.count_finished_writes(), c.count_finished_loads()]
            group.agree_min_many(mine, tag="hicache_acks")
            tree.writing_check(mine[0])
            tree.loading_check(mine[1])

        tree.check_hicache_events = local_acks
    elif how == "local_host_room":  # rank 1 backs up from its own host room
        r.kv.controller.group = _LocalRoom(group)
    elif how == "early_return":  # SGLang #26921: nothing finished here, so no agreement
        c, agreed = tree.controller, tree.check_hicache_events

        def early() -> None:
            if c.count_finished_writes() == 0 and c.count_finished_loads() == 0:
                return
            agreed()

        tree.check_hicache_events = early


INJECTIONS = {
    # rank 0's copies are held at its gate for the whole run, rank 1's finish before it counts:
    # rank 1 pops acks the group has not
    "local_ack_count": Story(
        "write_through", 1, "layer_first", "direct", 120, 7, (2.0,), (4.0, 0.0)
    ),  # fmt: skip
    # rank 1's host pool refuses on its own; the others back up
    "local_host_room": Story(
        "write_through", 1, "layer_first", "direct", 120, 8, (2.0,), (0.0, 0.0), refuse_host=0.3
    ),  # fmt: skip
    "early_return": Story(
        "write_through", 1, "layer_first", "direct", 120, 9, (2.0,), (4.0, 0.0)
    ),  # fmt: skip
}


def _injected(rank: int, world: int) -> dict[str, tuple[str, str, int]]:
    """Each injection on a fresh cache over the same group; returns, per injection, the error
    class this rank raised, its message and the step it was raised at. Rank 1 only refuses
    host room in the ``local_host_room`` run; rank 0 never does."""
    group = new_cache_group()
    out = {}
    for how, story in INJECTIONS.items():
        if rank == 0:
            story = story._replace(refuse_host=0.0)
        r = Rank(story, rank, world, group)
        if rank == 1:
            _inject(r, how)
        elif how == "local_ack_count":
            r.gate.clear()
        rng = random.Random(story.seed)
        step = -1
        try:
            for step in range(story.steps):  # noqa: B007 (read after the loop)
                r.step(rng)
                r.check()
            out[how] = ("none", "", step)
        except (RankDivergenceError, CollectiveMismatchError) as exc:
            out[how] = (type(exc).__name__, str(exc), step)
        r.gate.set()
        r.tree.controller.close()
        group.barrier(tag=f"after {how}")  # every rank is in step again
    return out


def test_injected_rank_local_decisions_are_caught():
    """Rank 1 decides from its own state, three ways; every rank raises, at the same step. A
    rank that skips the ack agreement meets the others at another call site (the call-site
    check); a rank that applies its own ack count or its own host room keeps entering the same
    collectives with a different tree (the digest check), unless its tree already makes it
    take another path (a drain loop that ends sooner, a backup retried after host eviction),
    which the call-site check catches first."""
    outs = run_ranks(_injected, 2)
    for how in INJECTIONS:
        caught = [o[how] for o in outs]
        assert len({(c[0], c[2]) for c in caught}) == 1, (how, caught)  # same error, same step
        kind, msg, _ = caught[0]
        if how == "early_return":
            assert kind == "CollectiveMismatchError", (how, caught)
            assert "agree_min_many[2]('hicache_acks')" in msg
        elif kind == "RankDivergenceError":
            assert "at 'tree'" in msg and "ranks [1]" in msg, msg
        else:
            assert kind == "CollectiveMismatchError", (how, caught)


def test_tp_model_needs_the_process_group():
    from hicache_prefill.prefill.model.factory import build_model

    with pytest.raises(ValueError, match="tp_size: --tp-size=2 needs an initialized default"):
        build_model(ServerArgs(device="cpu", tp_size=2))


def test_single_rank_cache_needs_no_group_and_tp_needs_one():
    args = ServerArgs(device="cpu", num_layers=2, head_dim=4, max_total_tokens=64,
                      enable_hierarchical_cache=True)  # fmt: skip
    kv = build_kv_cache(args)
    assert isinstance(kv.group, SingleRankGroup) and kv.tree.group is kv.group
    kv.close()
    with pytest.raises(ValueError, match="group: --tp-size=2 needs the cache group"):
        build_kv_cache(ServerArgs(device="cpu", num_layers=2, head_dim=4, tp_size=2))
    with pytest.raises(ValueError, match="group has 1 ranks, --tp-size=2"):
        build_kv_cache(ServerArgs(device="cpu", tp_size=2), group=SingleRankGroup())
