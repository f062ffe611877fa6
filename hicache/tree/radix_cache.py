"""Device-only radix tree over token ids (SGLang ``RadixCache``), page-aligned: the walk, the
locks, the device accounting and the device queue of eviction candidates. Each node owns the
device slots of its edge; a request owns its slots until it ``insert``s them, then frees its
duplicates of the prefix already present."""

from __future__ import annotations

import itertools
from collections.abc import Sequence
from typing import TYPE_CHECKING

import torch

from hicache_prefill.hicache.tree.integrity import check_tree
from hicache_prefill.hicache.tree.keys import TOKEN_BYTES, key_bytes, list_bytes, match_bytes
from hicache_prefill.hicache.tree.lru_queues import DEVICE, LRUQueue, is_device_candidate
from hicache_prefill.hicache.tree.node import MatchResult, TreeNode, check_insert_args, descend
from hicache_prefill.kernels.ops.checks import content_checks

if TYPE_CHECKING:
    from hicache_prefill.hicache.memory.allocator import TokenToKVPoolAllocator


class RadixCache:
    """Device-only prefix cache with LRU eviction of unlocked leaves. ``allocator=None`` makes
    a simulated tree (SGLang's ``create_simulated``): ``insert`` may omit ``value`` (token ids
    stand in for slots) and eviction frees nothing."""

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
        self.owned_pages = (
            None if pages is None else torch.zeros(pages, dtype=torch.bool, device=self.device)
        )

    def _empty(self) -> torch.Tensor:
        return torch.empty((0,), dtype=torch.int64, device=self.device)

    def eviction_queues(self) -> tuple[LRUQueue, ...]:
        return (self._device_queue,)

    def _tick(self) -> int:
        return next(self._clock)

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
        """Whether ``insert`` may start a host backup of the pages it is given. Never here."""
        return False

    def match_prefix(self, key: Sequence[int] | torch.Tensor) -> MatchResult:
        """Longest cached prefix of ``key`` in whole pages; splits the node the match ends inside.
        A miss returns one shared (read-only) result; else ``device_indices`` is a fresh tensor."""
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
        host_hit_length = off = 0
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
        device_indices = torch.cat(values) if values else self._empty_indices
        return MatchResult(device_indices, last_device, node, host_hit_length)

    def insert(
        self,
        key: Sequence[int] | torch.Tensor,
        value: torch.Tensor | None = None,
        chunked: bool = False,
        counted_from: int | None = None,
    ) -> int:
        """Insert ``key`` with device slots ``value``, both cut to whole pages; returns the length
        already device-resident (``value[:returned]`` stays the caller's to free; the tree clones
        the rest). ``ValueError``, state unchanged, for bad arguments or slots it could not own.
        ``counted_from`` (SGLang 0.5.23's ``inserted_len``): count a hit on the nodes ending past
        it, chunked or not; ``None``: on every node, unless ``chunked``."""
        kb, value = check_insert_args(
            key, value, self.device, self.page_size, self.allocator is None
        )
        if not kb:
            return 0
        if self.allocator is not None:
            self._set_owned(value[self._check_slots(kb, value) :], True)
        pb = self.page_bytes
        end = len(kb)
        now = self._tick()
        node = self.root_node
        node.last_access_time = now
        present = off = 0
        child = node.children.get(kb[:pb])
        # Each node is acted on before its children are looked up (a backup started here may
        # evict host-only leaves below it).
        while child is not None:
            node = descend(child, kb, off, end, now, pb)
            start = off // TOKEN_BYTES
            off += len(node.tokens)
            if node.value is None:
                self._revive(node, value.narrow_copy(0, start, off // TOKEN_BYTES - start))
            else:
                present += off // TOKEN_BYTES - start
                self._count_hit(node, chunked, counted_from, off // TOKEN_BYTES)
            if node is not child or off == end:  # split (the match ends inside) or key done
                break
            child = node.children.get(kb[off : off + pb])
        if off < end:
            start, n = off // TOKEN_BYTES, (end - off) // TOKEN_BYTES
            # narrow_copy: one torch call (a slice and a clone are two)
            new = TreeNode(kb[off:] if off else kb, node, value.narrow_copy(0, start, n), now)
            node.children[kb[off : off + pb]] = new
            node.device_children += 1
            self._add_device_tokens(new, n)
            self._count_hit(new, chunked, counted_from, end // TOKEN_BYTES)  # may lock it
            if new.lock_ref == 0:
                self._device_queue.push(new)
        return present

    def _check_slots(self, kb: bytes, value: torch.Tensor) -> int:
        """Where the slots the tree would take begin; ``ValueError`` unless every slot is allocated
        and those it would take are free-able pages no node owns (where ``content_checks``)."""
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
        owned = self.owned_pages
        if owned is not None and bool(owned[self._pages(value[present:])].any()):
            raise ValueError(
                f"value[{present}:] holds slots owned by the tree (another node's); only the "
                "prefix already cached may repeat the tree's slots"
            )
        return present

    def _pages(self, slots: torch.Tensor) -> torch.Tensor:
        return slots[:: self.page_size] // self.page_size

    def _set_owned(self, slots: torch.Tensor, owned: bool) -> None:
        """These device slots (whole pages) entered (``owned``) or left the tree."""
        if self.owned_pages is not None and slots.numel():
            self.owned_pages[self._pages(slots)] = owned

    def _add_device_tokens(self, node: TreeNode, n: int) -> None:
        """Count ``n`` device tokens of ``node`` (negative: uncount) as protected or evictable."""
        if node.lock_ref > 0:
            self.protected_size_ += n
        else:
            self.evictable_size_ += n

    def _revive(self, node: TreeNode, value: torch.Tensor) -> None:
        raise AssertionError("device-only tree has no evicted nodes")  # pragma: no cover

    def _count_hit(
        self, node: TreeNode, chunked: bool, counted_from: int | None, node_end: int
    ) -> None:
        """An insert passed or created ``node`` ending at token ``node_end``: count it as
        ``counted_from`` says (``insert``)."""
        if counted_from is None:
            self._inc_hit_count(node, chunked)
        elif node_end > counted_from:
            self._inc_hit_count(node, False)
        else:
            self._skip_hit_count(node)

    def _skip_hit_count(self, node: TreeNode) -> None:
        """An insert passed ``node`` without counting it (counted by the same request before)."""

    def _inc_hit_count(self, node: TreeNode, chunked: bool) -> None:
        """An insert created or passed a device-resident ``node`` (SGLang skips chunked ones)."""
        if not chunked:
            node.hit_count += 1

    def _check_attached(self, node: TreeNode, arg: str = "node") -> None:
        """``ValueError`` unless ``node`` is in this tree (a deleted one's walk ends at None)."""
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
        self._check_attached(node)
        root = self.root_node
        x = node
        while x is not root:
            if x.lock_ref <= 0:
                raise ValueError(f"dec_lock_ref({node!r}): lock_ref of {x!r} would go below 0")
            x = x.parent
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

    def _delete_leaf(self, node: TreeNode) -> None:
        """Unlink ``node`` from its parent; ``parent is None`` marks it deleted."""
        del node.parent.children[node.tokens[: self.page_bytes]]
        node.parent = None
        if node.queued:
            self._note_stale()

    def _note_stale(self) -> None:
        """A deleted node kept a queue entry; compact the queues when those could be half."""
        self._stale_entries += 1
        queues = self.eviction_queues()
        if self._stale_entries > 256 and 2 * self._stale_entries > sum(len(q) for q in queues):
            for q in queues:
                q.compact()
            self._stale_entries = 0

    def _pop_leaves(
        self, queue: LRUQueue, num_tokens: int, device: bool
    ) -> list[tuple[TreeNode, TreeNode]]:
        """Delete ``queue``'s LRU leaves until they held ``num_tokens`` tokens of their tier (or
        none is left); their parents may become leaves. Returns ``(leaf, parent)`` in order."""
        freed = 0
        taken: list[tuple[TreeNode, TreeNode]] = []
        while freed < num_tokens:
            x = queue.pop()
            if x is None:
                break
            parent = x.parent
            freed += len(x.value if device else x.host_value)
            taken.append((x, parent))
            self._delete_leaf(x)
            if device:
                self._drop_device_child(parent)
            elif parent is not self.root_node:
                queue.push_if_candidate(parent)
        return taken

    def _drop_device_child(self, parent: TreeNode) -> None:
        """A child of ``parent`` left the device; ``parent`` may be a device leaf now."""
        parent.device_children -= 1
        if parent is not self.root_node:
            self._device_queue.push_if_candidate(parent)

    def evict(self, num_tokens: int) -> int:
        """Free at least ``num_tokens`` device tokens (LRU unlocked leaves, in one free), or all
        evictable; returns the tokens freed. A refused free raises with the tree unchanged."""
        if num_tokens < 0:
            raise ValueError(f"num_tokens must be >= 0, got {num_tokens}")
        taken = self._pop_leaves(self._device_queue, num_tokens, device=True)
        freed = sum(len(x.value) for x, _ in taken)
        if taken and self.allocator is not None:
            slots = taken[0][0].value if len(taken) == 1 else torch.cat([x.value for x, _ in taken])
            try:
                self.allocator.free(slots)
            except ValueError:
                self._relink(taken)
                raise
            self._set_owned(slots, False)
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

    def check_integrity(self, request_owned: int = 0) -> None:
        """``AssertionError`` on an inconsistent tree; ``request_owned``: slots requests hold."""
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
