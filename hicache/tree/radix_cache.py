"""Device-only radix tree over token ids (SGLang ``RadixCache``), page-aligned.

Each node owns the device slots (``value``: 1-D int64 tensor on the pool's device) of the
tokens on its edge (``key``). The tree never knows requests: a request owns slots until it
``insert``s them, after which the tree owns every slot of the newly created nodes and the caller
frees its duplicates of the prefix that was already present.

This file owns the tree's walk (match, split, insert), its locks, its device accounting and the
queue of device-eviction candidates it keeps up to date on every change (``lru_queues.LRUQueue``:
evicting k leaves pops k entries, no tree walk). ``TreeNode``, ``MatchResult`` and the key
helpers live in ``node.py``. ``HiRadixCache`` (``hiradix_cache.py``)
extends this with a host tier; the node fields it needs (``host_value``, ``host_ref``) are on
the shared ``TreeNode`` so both trees share one node type and one walk.
"""

from __future__ import annotations

import itertools
import logging
from collections.abc import Sequence
from typing import TYPE_CHECKING

import torch

from hicache.tree.integrity import check_tree
from hicache.tree.keys import TOKEN_BYTES, key_bytes, list_bytes, match_bytes
from hicache.tree.lru_queues import DEVICE, LRUQueue, is_device_candidate
from hicache.tree.node import MatchResult, TreeNode, check_insert_args, descend
from kernels.ops.checks import content_checks

if TYPE_CHECKING:
    from hicache.memory.allocator import TokenToKVPoolAllocator

logger = logging.getLogger(__name__)


class RadixCache:
    """Device-only prefix cache with LRU eviction of unlocked leaves.

    Args:
        allocator: the device slot allocator (``alloc``/``free``/``available_size``); the tree
            frees slots of evicted nodes into it. ``None`` makes a simulated tree (SGLang's
            ``RadixCache.create_simulated``): ``insert`` may omit ``value`` (token ids stand in
            for slots) and eviction frees nothing.
        page_size: tokens per page; every stored key is a whole number of pages. Must be the
            allocator's page size.
        device: device of the slot tensors (defaults to the allocator's, CPU when simulated).

    Nothing here blocks; all calls are host-side bookkeeping on the scheduler thread.
    """

    def __init__(
        self,
        allocator: TokenToKVPoolAllocator | None,
        page_size: int = 1,
        device: torch.device | str | None = None,
    ) -> None:
        if page_size < 1:
            raise ValueError(f"page_size must be >= 1, got {page_size}")
        alloc_page_size = getattr(allocator, "page_size", page_size)
        if allocator is not None and alloc_page_size != page_size:
            raise ValueError(
                f"page_size {page_size} differs from the allocator's page_size {alloc_page_size}"
            )
        self.allocator = allocator
        self.page_size = page_size
        self.page_bytes = page_size * TOKEN_BYTES  # a child's entry: its first page's bytes
        if device is None:
            device = getattr(allocator, "device", "cpu")
        self.device = torch.device(device)
        self._clock = itertools.count(1)
        self.reset()

    # ------------------------------------------------------------------ basics

    def reset(self) -> None:
        """Forget every node (does not free slots: only for a fresh or fully drained pool)."""
        self.root_node = TreeNode()
        self.root_node.value = self._empty()
        self.root_node.lock_ref = 1  # the root is never evicted
        self.evictable_size_ = 0
        self.protected_size_ = 0
        self._device_queue = LRUQueue(DEVICE, is_device_candidate)
        self._stale_entries = 0  # deleted nodes that still hold a queue entry
        self._empty_indices = self._empty()
        # A miss returns this one result: no key copy, no tensor, no tick.
        self._empty_match = MatchResult(self._empty_indices, self.root_node, self.root_node, 0)
        # Pages whose device slots a node owns (insert checks new slots against it in O(slots)).
        pages = getattr(self.allocator, "page_table_size", None)
        self._owned_pages = (
            None if pages is None else torch.zeros(pages, dtype=torch.bool, device=self.device)
        )

    def _empty(self) -> torch.Tensor:
        return torch.empty((0,), dtype=torch.int64, device=self.device)

    def _queues(self) -> tuple[LRUQueue, ...]:
        return (self._device_queue,)

    def _tick(self) -> int:
        return next(self._clock)

    def _child_key(self, tokens: bytes, start: int = 0) -> bytes:
        """The ``children`` entry of the edge that starts ``start`` bytes into ``tokens``: the
        bytes of its first page."""
        return tokens[start : start + self.page_bytes]

    def evictable_size(self) -> int:
        """Device tokens held by the tree in unlocked nodes (free to evict)."""
        return self.evictable_size_

    def protected_size(self) -> int:
        """Device tokens held by the tree in locked nodes."""
        return self.protected_size_

    def total_size(self) -> int:
        """All device tokens held by the tree."""
        return self.evictable_size_ + self.protected_size_

    @property
    def backs_up_on_insert(self) -> bool:
        """Whether ``insert`` may start a host backup of the pages it is given (so KV of a
        request that is not finalized would reach L2). Device-only: never."""
        return False

    # ------------------------------------------------------------------ match

    def match_prefix(self, key: Sequence[int] | torch.Tensor) -> MatchResult:
        """Longest cached prefix of ``key`` (truncated to whole pages; the key is not changed).

        ``key``: token ids as ``array('q')``, a list of ints, or a 1-D integer tensor
        (``keys.key_bytes``). Splits a node when the match ends inside it, so ``last_*_node``
        covers exactly the match; the whole node is refreshed before the split (SGLang's order),
        so both halves carry the access time. Refreshes ``last_access_time`` along the path;
        never changes ``hit_count``. A miss returns one shared empty result (treat it as
        read-only). ``device_indices`` is a fresh tensor (one ``torch.cat`` of the matched
        device nodes' slots), never a view of the tree's.

        Cost: a conversion of the key (a buffer copy for ``array('q')``; one ``struct.pack`` for a
        list, after a check of its first page so that a miss converts one page), then per
        matched node one dict lookup by first page and one ``memcmp``; no Python work per token.
        """
        root = self.root_node
        pb = self.page_bytes
        if type(key) is list and (
            len(key) < self.page_size or list_bytes(key, 0, self.page_size) not in root.children
        ):
            return self._empty_match
        kb = key_bytes(key)
        end = len(kb) - len(kb) % pb
        child = root.children.get(kb[:pb]) if end else None
        if child is None:
            return self._empty_match
        now = self._tick()
        root.last_access_time = now
        values: list[torch.Tensor] = []
        node = last_device = root
        host_hit_length = 0
        off = 0
        while child is not None:
            node = descend(child, kb, off, end, now, pb)
            n = len(node.tokens)
            if node.value is None:
                host_hit_length += n // TOKEN_BYTES
            else:
                values.append(node.value)
                last_device = node
            off += n
            if node is not child or off == end:  # split (the match ends inside) or key done
                break
            child = node.children.get(kb[off : off + pb])
        if not values:
            device_indices = self._empty_indices
        else:
            device_indices = torch.cat(values)
        return MatchResult(device_indices, last_device, node, host_hit_length)

    # ------------------------------------------------------------------ insert

    # Slot ownership during insert(key, value):
    #   value[:returned]            already device-resident in the tree; the caller still owns
    #                               these duplicates and frees them (those it did not get from
    #                               match_prefix in the first place).
    #   value[returned:aligned]     now owned by the tree: either given to evicted nodes along
    #                               the path (HiRadixCache: recomputed KV revives host-only
    #                               nodes) or to the new leaf. The tree stores clones, so the
    #                               caller's tensor may be reused.
    #   value[aligned:]             the part of a last, partial page: not inserted (SGLang cuts
    #                               keys to whole pages); still the caller's.
    # Device-resident nodes form a prefix of every path, so "already present" is one prefix.
    def insert(
        self,
        key: Sequence[int] | torch.Tensor,
        value: torch.Tensor | None = None,
        chunked: bool = False,
    ) -> int:
        """Insert ``key`` with device slots ``value`` (int64 ``[len(key)]``, pool device).

        The key is cut to whole pages first (and ``value`` with it), as SGLang does.
        ``value`` may be omitted only in a simulated tree (``allocator=None``).
        ``chunked`` marks an insert of an unfinished (chunk-prefilled) request.
        Returns the length of the prefix whose KV was already device-resident; the caller frees
        its own slots for that prefix. Raises ``ValueError`` (state unchanged) on mismatched
        lengths, a non-int64 value, a missing value in a tree with an allocator, or slots the
        tree could not own (``_check_slots``).
        """
        kb, value = check_insert_args(
            key, value, self.device, self.page_size, self.allocator is None
        )
        if not kb:
            return 0
        if self.allocator is not None:
            self._own(value[self._check_slots(kb, value) :])
        pb = self.page_bytes
        end = len(kb)
        now = self._tick()
        node = self.root_node
        node.last_access_time = now
        present = off = 0
        child = node.children.get(kb[:pb])
        # The walk of match_prefix; each node is acted on before its children are looked up (a
        # backup started here may evict host-only leaves below it).
        while child is not None:
            node = descend(child, kb, off, end, now, pb)
            start = off // TOKEN_BYTES
            off += len(node.tokens)
            if node.value is None:
                self._revive(node, value.narrow_copy(0, start, off // TOKEN_BYTES - start))
            else:
                present += off // TOKEN_BYTES - start
                self._inc_hit_count(node, chunked)
            if node is not child or off == end:  # split (the match ends inside) or key done
                break
            child = node.children.get(kb[off : off + pb])
        if off < end:
            start, n = off // TOKEN_BYTES, (end - off) // TOKEN_BYTES
            # narrow_copy: the new leaf's slots copied in one torch call (a slice and a clone
            # are two, each costing microseconds when torch's code is cold)
            new = TreeNode(kb[off:] if off else kb, node, value.narrow_copy(0, start, n), now)
            node.children[kb[off : off + pb]] = new
            node.device_children += 1
            self._add_device_tokens(new, n)
            self._inc_hit_count(new, chunked)  # may lock it (a write-through backup)
            if new.lock_ref == 0:
                self._device_queue.push(new)
        return present

    def _check_slots(self, kb: bytes, value: torch.Tensor) -> int:
        """Returns where the slots the tree would take begin (the device-resident prefix of
        ``kb``, found by a walk that changes nothing). ``ValueError`` unless every slot of
        ``value`` is allocated (no negative or padding slot) and the slots the tree would take
        are whole pages the allocator would take back, none already a node's. O(len(value));
        the contents are read where ``content_checks`` allows (on CUDA: debug checks only)."""
        pb = self.page_bytes
        end = len(kb)
        off = 0
        child = self.root_node.children.get(kb[:pb])
        while child is not None and child.value is not None:
            tokens = child.tokens
            if off + len(tokens) > end or not kb.startswith(tokens, off):
                off += match_bytes(tokens, kb, off, end, pb)
                break
            off += len(tokens)
            child = child.children.get(kb[off : off + pb]) if off < end else None
        present = off // TOKEN_BYTES
        if not content_checks(value):
            return present
        slots = value.cpu()
        lo = int(slots.min())
        if lo < 0:
            raise ValueError(f"value holds negative slots (min {lo}); slots come from alloc()")
        if not self.allocator.is_allocated(slots):
            raise ValueError("value holds slots that are not allocated (free, padding or beyond)")
        try:
            self.allocator.check_free(slots[present:])
        except ValueError as e:
            raise ValueError(
                f"value[{present}:], the slots this insert gives the tree, could not be freed "
                f"at eviction: {e}"
            ) from e
        owned = self._owned_pages
        if owned is not None and bool(
            owned[value[present:][:: self.page_size] // self.page_size].any()
        ):
            raise ValueError(
                f"value[{present}:] holds slots owned by the tree (another node's); only the "
                "prefix already cached may repeat the tree's slots"
            )
        return present

    def _own(self, slots: torch.Tensor) -> None:
        """The tree now owns these device slots (whole pages)."""
        if self._owned_pages is not None and slots.numel():
            self._owned_pages[slots[:: self.page_size] // self.page_size] = True

    def _disown(self, slots: torch.Tensor) -> None:
        """These device slots (whole pages) left the tree."""
        if self._owned_pages is not None and slots.numel():
            self._owned_pages[slots[:: self.page_size] // self.page_size] = False

    def _add_device_tokens(self, node: TreeNode, n: int) -> None:
        if node.lock_ref > 0:
            self.protected_size_ += n
        else:
            self.evictable_size_ += n

    def _revive(self, node: TreeNode, value: torch.Tensor) -> None:
        raise AssertionError("device-only tree has no evicted nodes")  # pragma: no cover

    def _inc_hit_count(self, node: TreeNode, chunked: bool) -> None:
        """An insert created ``node`` or passed through it while it was device-resident
        (SGLang skips chunked inserts)."""
        if not chunked:
            node.hit_count += 1

    # ------------------------------------------------------------------ locks

    def _check_attached(self, node: TreeNode, arg: str = "node") -> None:
        """``ValueError`` unless ``node`` is in this tree. Deleted nodes (and every node of a
        deleted subtree) have ``parent is None``, so the walk up ends at this tree's root
        exactly for attached nodes. O(depth)."""
        if not isinstance(node, TreeNode):
            raise ValueError(f"{arg} must be a TreeNode, got {type(node).__name__}")
        root = self.root_node
        x = node
        while x is not root:
            x = x.parent
            if x is None:
                raise ValueError(f"{arg} {node!r} is not in this tree (deleted or foreign)")

    def inc_lock_ref(self, node: TreeNode) -> int:
        """Lock ``node`` and its ancestors against eviction; returns the tokens moved from
        evictable to protected. Raises ``ValueError`` for a host-only (evicted) node."""
        self._check_attached(node)
        if node.value is None:
            raise ValueError(f"node {node!r} is evicted; lock the last device node instead")
        delta = 0
        root = self.root_node
        x = node
        while x is not root:
            if x.lock_ref == 0:
                delta += len(x.value)
            x.lock_ref += 1
            x = x.parent
        self.evictable_size_ -= delta
        self.protected_size_ += delta
        return delta

    def dec_lock_ref(self, node: TreeNode) -> int:
        """Release one lock taken by ``inc_lock_ref(node)``; returns the tokens made evictable.
        Raises ``ValueError`` (state unchanged) when it would drop a count below zero."""
        if not isinstance(node, TreeNode):
            raise ValueError(f"node must be a TreeNode, got {type(node).__name__}")
        root = self.root_node
        x = node
        while x is not root:
            if x.lock_ref <= 0:
                raise ValueError(f"dec_lock_ref({node!r}): lock_ref of {x!r} would go below 0")
            x = x.parent
            if x is None:
                raise ValueError(f"node {node!r} is not in this tree (deleted or foreign)")
        delta = 0
        push = self._device_queue.push
        x = node
        while x is not root:
            x.lock_ref -= 1
            if x.lock_ref == 0:
                delta += len(x.value)
                if x.device_children == 0:
                    push(x)
            x = x.parent
        self.evictable_size_ += delta
        self.protected_size_ -= delta
        return delta

    # ------------------------------------------------------------------ evict

    def _delete_leaf(self, node: TreeNode) -> None:
        """Unlink ``node`` from its parent; ``parent is None`` marks it deleted."""
        del node.parent.children[node.tokens[: self.page_bytes]]
        node.parent = None
        if node.queued:
            self._note_stale()

    def _note_stale(self) -> None:
        """A deleted node kept a queue entry; compact the queues when such entries could be
        half of them (amortized O(1) per deletion)."""
        self._stale_entries += 1
        if self._stale_entries > 256 and 2 * self._stale_entries > sum(
            len(q) for q in self._queues()
        ):
            for q in self._queues():
                q.compact()
            self._stale_entries = 0

    # Slot ownership during evict: every slot of an evicted leaf goes back to the allocator
    # (one free for the whole call); locked nodes (a request, a pending backup or a pending load
    # holds them) are never candidates. A free the allocator refuses relinks every leaf taken.
    def evict(self, num_tokens: int) -> int:
        """Free at least ``num_tokens`` device tokens from unlocked leaves in LRU order, or as
        many as are evictable. Returns the tokens freed. O(k log n) for k leaves evicted.
        When the allocator refuses the free, its ``ValueError`` propagates, tree unchanged."""
        if num_tokens < 0:
            raise ValueError(f"num_tokens must be >= 0, got {num_tokens}")
        queue = self._device_queue
        root = self.root_node
        freed = 0
        taken: list[tuple[TreeNode, TreeNode]] = []
        while freed < num_tokens:
            x = queue.pop()
            if x is None:
                break
            parent = x.parent
            freed += len(x.value)
            taken.append((x, parent))
            self._delete_leaf(x)
            parent.device_children -= 1
            if parent is not root:
                queue.push_if_candidate(parent)
        if taken and self.allocator is not None:
            slots = taken[0][0].value if len(taken) == 1 else torch.cat([x.value for x, _ in taken])
            try:
                self.allocator.free(slots)
            except ValueError:
                self._relink(taken)
                raise
            self._disown(slots)
        self.evictable_size_ -= freed
        return freed

    def _relink(self, taken: list[tuple[TreeNode, TreeNode]]) -> None:
        """Undo ``evict``'s unlinking of ``taken`` (leaves with their parents, in order)."""
        for x, parent in reversed(taken):
            x.parent = parent
            parent.children[x.tokens[: self.page_bytes]] = x
            parent.device_children += 1
            self._device_queue.push(x)

    def evict_host(self, num_tokens: int) -> int:
        """No host tier: frees nothing."""
        if num_tokens < 0:
            raise ValueError(f"num_tokens must be >= 0, got {num_tokens}")
        return 0

    # ------------------------------------------------------------------ hierarchy hooks

    def init_load_back(
        self, last_host_node: TreeNode, host_hit_length: int
    ) -> tuple[torch.Tensor, TreeNode]:
        """No host tier: nothing to load; returns ``(empty, last_host_node)``."""
        return self._empty(), last_host_node

    def ready_to_load_host_cache(self) -> int:
        """No host tier: nothing to start; returns -1."""
        return -1

    def check_hicache_events(self) -> None:
        """No host tier: no acks to poll."""

    def layer_wait(self, layer_id: int) -> None:
        """No host tier: KV of every layer is already on the device."""

    # ------------------------------------------------------------------ integrity

    def check_integrity(self, request_owned: int = 0) -> None:
        """Raise ``AssertionError`` when the tree, its allocators or (HiRadixCache) the controller
        is inconsistent; see ``hicache.tree.integrity`` for the list of invariants.

        ``request_owned``: device slots currently allocated by requests (not in the tree);
        the device ledger must balance: free + in tree + request-owned + in flight == total.
        """
        check_tree(self, request_owned=request_owned)

    def all_nodes(self) -> list[TreeNode]:
        """Every node except the root, parents before children."""
        out = []
        stack = list(self.root_node.children.values())
        while stack:
            x = stack.pop()
            out.append(x)
            stack.extend(x.children.values())
        return out
