"""A stable digest of plain values and tensors, equal across processes and ranks, and
``tree_state(tree)``: what of a radix tree must be identical on every rank.
"""

from __future__ import annotations

import hashlib
import struct
from typing import Any

import torch

_MASK = (1 << 62) - 1  # digests stay positive and far from int64's edges, so -d never overflows


def digest(value: Any) -> int:
    """A stable 62-bit digest of plain values, tensors and containers of them; ``ValueError``
    for anything else (an object's ``repr`` may hold an address)."""
    h = hashlib.blake2b(digest_size=8)
    _feed(h, value)
    return int.from_bytes(h.digest(), "little") & _MASK


def _feed(h: Any, v: Any) -> None:
    if v is None or isinstance(v, (bool, int, float)):
        h.update(f"{type(v).__name__}:{v!r};".encode())
    elif isinstance(v, str):
        h.update(b"s" + struct.pack("<q", len(v)) + v.encode())
    elif isinstance(v, (bytes, bytearray)):
        h.update(b"b" + struct.pack("<q", len(v)) + bytes(v))
    elif isinstance(v, torch.Tensor):
        t = v.detach().to("cpu").contiguous()
        h.update(f"T{t.dtype}{tuple(t.shape)};".encode())
        if t.numel():
            h.update(t.reshape(-1).view(torch.uint8).numpy().tobytes())
    elif isinstance(v, (list, tuple)):
        h.update(b"l" + struct.pack("<q", len(v)))
        for x in v:
            _feed(h, x)
    elif isinstance(v, dict):
        h.update(b"d" + struct.pack("<q", len(v)))
        for d, x in sorted((digest(k), x) for k, x in v.items()):
            h.update(struct.pack("<q", d))
            _feed(h, x)
    elif isinstance(v, (set, frozenset)):
        h.update(b"S" + struct.pack("<q", len(v)))
        for d in sorted(digest(x) for x in v):
            h.update(struct.pack("<q", d))
    else:
        raise ValueError(f"value of type {type(v).__name__} has no stable digest")


def tree_state(tree: Any) -> list[Any]:
    """What must be identical on every rank of a ``RadixCache`` / ``HiRadixCache``: its nodes
    depth-first (without their per-process ids), sizes, free slots and controller queues."""
    writing = getattr(tree, "ongoing_write_through", {})
    loading = getattr(tree, "ongoing_load_back", {})
    nodes: list[Any] = []
    stack = [tree.root_node]
    while stack:
        x = stack.pop()
        nodes.append(
            (
                x.key,
                x.value,
                x.host_value,
                x.lock_ref,
                x.host_ref,
                x.hit_count,
                x.last_access_time,
                x.device_children,
                x.id in writing,
                x.id in loading,
            )
        )
        stack.extend(x.children[k] for k in sorted(x.children, reverse=True))
    out: list[Any] = [nodes, tree.evictable_size_, tree.protected_size_]
    if tree.allocator is not None:
        out.append(tree.allocator.available_size())
    controller = getattr(tree, "controller", None)
    if controller is not None:
        out += [
            controller.host_allocator.available_size(),
            len(controller.ack_write_queue),
            len(controller.ack_load_queue),
            len(controller.load_queue),
            controller.device_in_flight(),
            controller.host_in_flight(),
        ]
    return out
