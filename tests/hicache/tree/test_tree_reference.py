"""The device-only tree against a plain reference radix tree, step by step (hypothesis).

The reference (``RefTree`` below) is the textbook algorithm written for clarity, not speed: keys
are lists, edges are compared token by token, a child is found by scanning its parent's
children, and eviction scans every leaf for the least recently used one (access time, then
creation order). It follows SGLang's rules: keys cut to whole pages, a node refreshed before it is
split and both halves keeping its time and counts, one clock tick per match or insert that
reaches a node, hit counts only on inserts that are not chunked, locks as path counts.

A state machine plays matches, inserts (keys given as lists, ``array('q')`` and tensors, short
and long, so the tree's list, buffer and tensor paths and its partial conversion of list keys are
all exercised), locks, unlocks and evictions on both, on small alphabets so that edges split and
branch often, and after every step compares every result (device indices, matched nodes, insert
return, tokens freed) and the whole tree: each node's path, edge, slots, access time, lock and hit
counts, in the same shape. ``check_integrity`` runs after every step too.
"""

from __future__ import annotations

import itertools
from array import array

import pytest
import torch
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import (
    RuleBasedStateMachine,
    initialize,
    invariant,
    precondition,
    rule,
    run_state_machine_as_test,
)

from hicache_prefill.hicache.memory.allocator import TokenToKVPoolAllocator
from hicache_prefill.hicache.tree.radix_cache import RadixCache

POOL_PAGES = 24


class RefNode:
    def __init__(self, key: list[int], value: list[int], parent: RefNode | None, t: int) -> None:
        self.key, self.value, self.parent = key, value, parent
        self.children: list[RefNode] = []
        self.time, self.lock, self.hits = t, 0, 0
        self.order = next(RefTree.order)


class RefTree:
    """See the module docstring."""

    order = itertools.count()

    def __init__(self, page_size: int) -> None:
        self.ps = page_size
        self.root = RefNode([], [], None, 0)
        self.clock = 0

    def _split(self, node: RefNode, n: int) -> RefNode:
        upper = RefNode(node.key[:n], node.value[:n], node.parent, node.time)
        upper.lock, upper.hits = node.lock, node.hits
        node.parent.children[node.parent.children.index(node)] = upper
        node.key, node.value, node.parent = node.key[n:], node.value[n:], upper
        upper.children = [node]
        return upper

    def _walk(self, key: list[int]) -> tuple[list[tuple[RefNode, int]], int]:
        """Nodes matched (with the offset of each), refreshing and splitting; tokens matched."""
        end = len(key) - len(key) % self.ps
        first = key[: self.ps]
        if end == 0 or not any(c.key[: self.ps] == first for c in self.root.children):
            return [], 0
        self.clock += 1
        self.root.time = self.clock
        node, i, path = self.root, 0, []
        while i < end:
            child = next(
                (c for c in node.children if c.key[: self.ps] == key[i : i + self.ps]), None
            )
            if child is None:
                break
            n = 0
            while n < len(child.key) and i + n < end and child.key[n] == key[i + n]:
                n += 1
            n -= n % self.ps
            child.time = self.clock
            if n < len(child.key):
                child = self._split(child, n)
            path.append((child, i))
            node, i = child, i + n
        return path, i

    def match(self, key: list[int]) -> tuple[list[int], RefNode]:
        path, _ = self._walk(key)
        out = [s for node, _ in path for s in node.value]
        return out, path[-1][0] if path else self.root

    def insert(self, key: list[int], value: list[int], chunked: bool) -> int:
        end = len(key) - len(key) % self.ps
        key, value = key[:end], value[:end]
        if not key:
            return 0
        self.clock += 1
        self.root.time = self.clock
        node, i = self.root, 0
        while i < end:
            child = next(
                (c for c in node.children if c.key[: self.ps] == key[i : i + self.ps]), None
            )
            if child is None:
                break
            n = 0
            while n < len(child.key) and i + n < end and child.key[n] == key[i + n]:
                n += 1
            n -= n % self.ps
            child.time = self.clock
            if n < len(child.key):
                child = self._split(child, n)
            if not chunked:
                child.hits += 1
            node, i = child, i + n
        if i < end:
            leaf = RefNode(key[i:], value[i:], node, self.clock)
            leaf.hits = 0 if chunked else 1
            node.children.append(leaf)
        return i

    def lock(self, node: RefNode, delta: int) -> None:
        while node is not self.root:
            node.lock += delta
            node = node.parent

    def evict(self, num_tokens: int) -> tuple[int, list[list[int]]]:
        freed, slots = 0, []
        while freed < num_tokens:
            leaves = [x for x in self.nodes() if not x.children and x.lock == 0]
            if not leaves:
                break
            x = min(leaves, key=lambda x: (x.time, x.order))
            x.parent.children.remove(x)
            freed += len(x.key)
            slots.append(x.value)
        return freed, slots

    def nodes(self) -> list[RefNode]:
        out, stack = [], list(self.root.children)
        while stack:
            x = stack.pop()
            out.append(x)
            stack.extend(x.children)
        return out


def shape(root, children, key, value, t, lock, hits) -> list:
    """Every node as (path tokens, edge, slots, time, lock, hits), sorted by path."""
    out, stack = [], [(c, []) for c in children(root)]
    while stack:
        x, path = stack.pop()
        full = path + key(x)
        out.append((tuple(full), tuple(key(x)), tuple(value(x)), t(x), lock(x), hits(x)))
        stack.extend((c, full) for c in children(x))
    return sorted(out)


def _machine(page_size: int) -> type[RuleBasedStateMachine]:
    alphabet = 3
    tokens = st.lists(st.integers(0, alphabet - 1), min_size=0, max_size=6 * page_size)

    class TreeVsReference(RuleBasedStateMachine):
        @initialize()
        def build(self) -> None:
            self.alloc = TokenToKVPoolAllocator(POOL_PAGES * page_size, page_size, "cpu")
            self.tree = RadixCache(self.alloc, page_size)
            self.ref = RefTree(page_size)
            self.locked: list[tuple[object, RefNode]] = []

        def _as(self, key: list[int], kind: int):
            if kind == 0:
                return list(key)
            if kind == 1:
                return array("q", key)
            return torch.tensor(key, dtype=torch.int64)

        @rule(key=tokens, kind=st.integers(0, 2))
        def match(self, key: list[int], kind: int) -> None:
            m = self.tree.match_prefix(self._as(key, kind))
            want, ref_node = self.ref.match(key)
            assert m.device_indices.tolist() == want
            assert m.host_hit_length == 0 and m.last_host_node is m.last_device_node
            assert m.last_device_node.key == ref_node.key

        @rule(key=tokens, kind=st.integers(0, 2), chunked=st.booleans())
        def insert(self, key: list[int], kind: int, chunked: bool) -> None:
            m = self.tree.match_prefix(self._as(key, kind))
            want, _ = self.ref.match(key)
            matched = m.device_indices.numel()
            assert matched == len(want)
            aligned = len(key) - len(key) % page_size
            need = aligned - matched
            if need > self.alloc.available_size():
                return
            new = self.alloc.alloc(need) if need else torch.empty(0, dtype=torch.int64)
            tail = torch.full((len(key) - aligned,), 0, dtype=torch.int64)  # not inserted
            value = torch.cat([m.device_indices, new, tail])
            present = self.tree.insert(self._as(key, kind), value, chunked=chunked)
            assert present == self.ref.insert(key, value.tolist(), chunked)
            assert present == matched  # nothing else changed the tree in between
            self.alloc.free(value[matched:present])

        @rule(key=tokens)
        def lock(self, key: list[int]) -> None:
            node = self.tree.match_prefix(key).last_device_node
            _, ref_node = self.ref.match(key)
            if node is self.tree.root_node:
                return
            self.tree.inc_lock_ref(node)
            self.ref.lock(ref_node, 1)
            self.locked.append((node, ref_node))

        @precondition(lambda self: self.locked)
        @rule(i=st.integers(0, 100))
        def unlock(self, i: int) -> None:
            node, ref_node = self.locked.pop(i % len(self.locked))
            self.tree.dec_lock_ref(node)
            self.ref.lock(ref_node, -1)

        @rule(pages=st.integers(0, 4))
        def evict(self, pages: int) -> None:
            freed, _ = self.ref.evict(pages * page_size)
            assert self.tree.evict(pages * page_size) == freed

        @invariant()
        def same_tree(self) -> None:
            mine = shape(
                self.tree.root_node,
                lambda x: x.children.values(),
                lambda x: x.key,
                lambda x: x.value.tolist(),
                lambda x: x.last_access_time,
                lambda x: x.lock_ref,
                lambda x: x.hit_count,
            )
            ref = shape(
                self.ref.root,
                lambda x: x.children,
                lambda x: x.key,
                lambda x: x.value,
                lambda x: x.time,
                lambda x: x.lock,
                lambda x: x.hits,
            )
            assert mine == ref
            self.tree.check_integrity(request_owned=0)

    return TreeVsReference


@pytest.mark.parametrize("page_size", [1, 2])
def test_tree_matches_the_reference(page_size: int) -> None:
    run_state_machine_as_test(
        _machine(page_size),
        settings=settings(
            max_examples=60,
            stateful_step_count=40,
            deadline=None,
            suppress_health_check=[HealthCheck.too_slow],
        ),
    )
