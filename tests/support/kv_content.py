"""Deterministic KV content, so any device or host slot can be checked bit for bit.

The value of element ``(head, dim)`` of K (part 0) or V (part 1; MLA has only part 0) of layer
``layer`` for a token with id ``token`` at sequence position ``position`` is a hash of
``(token, position, layer, head, dim, part)`` mapped to a multiple of 1/16 in ``[-8, 8)``, which is
exact in float32, bfloat16 and float16. Different (token, position) pairs give different rows with
overwhelming probability, so a slot mix-up, a layer mix-up or a K/V swap is caught.

API (all tensors 1-D int64 of equal length ``n``; ``tokens`` / ``positions`` may be lists):

- ``expected_kv(pool, layer, tokens, positions) -> tuple[Tensor, ...]``: ``(k, v)`` each
  ``[n, H, D]`` (MHA) or ``(kv,)`` ``[n, 1, C]`` (MLA), in the pool's dtype, on the CPU.
  ``pool`` is a device pool or a host pool (only its geometry is read).
- ``write_device(pool, slots, tokens, positions)``: writes every layer of device ``slots``
  (blocking; what the model's attention would have written).
- ``check_device(pool, slots, tokens, positions)`` / ``check_host(host_pool, host_slots, tokens,
  positions)``: raise ``AssertionError`` naming the first bad slot, layer and part.
- ``write_host(host_pool, host_slots, tokens, positions)``: the same content into host slots.

Empty slot lists are fine everywhere: writes do nothing and checks pass.

Tensor parallelism: every function takes ``head_offset`` (default 0), the global index of the
pool's first KV head, so a rank's pool of heads ``[h0, h0 + H)`` holds exactly that slice of
what a pool of every head would hold (``TPShard.kv_heads[0]``).
"""

from __future__ import annotations

from typing import Any

import torch

from hicache_prefill.hicache.memory.device_pool import MHATokenToKVPool, MLATokenToKVPool
from hicache_prefill.hicache.memory.host_pool import MHATokenToKVPoolHost, MLATokenToKVPoolHost

AnyPool = MHATokenToKVPool | MLATokenToKVPool | MHATokenToKVPoolHost | MLATokenToKVPoolHost

_MUL = 6364136223846793005  # PCG multiplier (< 2**63)


def _as_i64(x: torch.Tensor | list[int]) -> torch.Tensor:
    t = torch.as_tensor(x, dtype=torch.int64).cpu()
    if t.dim() != 1:
        raise ValueError("tokens, positions and slots must be 1-D")
    return t


def _geometry(pool: AnyPool) -> tuple[int, int, int, torch.dtype, bool]:
    """(parts, heads, dim, dtype, is_mla)."""
    if isinstance(pool, MHATokenToKVPool | MHATokenToKVPoolHost):
        return 2, pool.head_num, pool.head_dim, pool.dtype, False
    return 1, 1, pool.kv_cache_dim, pool.dtype, True


def _hash(x: torch.Tensor) -> torch.Tensor:
    x = x * _MUL
    x = x ^ (x >> 29)
    x = x * _MUL
    return x ^ (x >> 32)


def expected_kv(
    pool: AnyPool,
    layer: int,
    tokens: torch.Tensor | list[int],
    positions: torch.Tensor | list[int],
    head_offset: int = 0,
) -> tuple[torch.Tensor, ...]:
    """The content every slot holding (token, position) must have in ``layer`` (CPU tensors);
    heads counted from ``head_offset``."""
    tok, pos = _as_i64(tokens), _as_i64(positions)
    if tok.numel() != pos.numel():
        raise ValueError(f"tokens ({tok.numel()}) and positions ({pos.numel()}) differ in length")
    parts, heads, dim, dtype, _ = _geometry(pool)
    base = _hash(tok * 1_000_003 + pos * 7_919 + layer * 104_729)[:, None, None]
    head_ids = torch.arange(head_offset, head_offset + heads)
    hd = (head_ids[:, None] * 4099 + torch.arange(dim)[None, :] * 131)[None]
    out = []
    for part in range(parts):
        h = _hash(base + hd + part * 15_485_863)
        out.append((((h & 255) - 128).to(torch.float32) / 16).to(dtype))
    return tuple(out)


def _check_lengths(slots: torch.Tensor, tokens: torch.Tensor) -> None:
    if slots.numel() != tokens.numel():
        raise ValueError(f"slots ({slots.numel()}) and tokens ({tokens.numel()}) differ in length")


def write_device(
    pool: MHATokenToKVPool | MLATokenToKVPool,
    slots: torch.Tensor | list[int],
    tokens: torch.Tensor | list[int],
    positions: torch.Tensor | list[int],
    head_offset: int = 0,
) -> None:
    """Write the expected content of every layer into device ``slots`` (blocking)."""
    s = _as_i64(slots)
    _check_lengths(s, _as_i64(tokens))
    s_dev = s.to(pool.device)
    for layer in range(pool.layer_num):
        parts = expected_kv(pool, layer, tokens, positions, head_offset)
        if isinstance(pool, MHATokenToKVPool):
            pool.set_kv_buffer(layer, s_dev, parts[0].to(pool.device), parts[1].to(pool.device))
        else:
            pool.set_mla_kv_buffer(layer, s_dev, parts[0].to(pool.device))


def write_host(
    host_pool: MHATokenToKVPoolHost | MLATokenToKVPoolHost,
    host_slots: torch.Tensor | list[int],
    tokens: torch.Tensor | list[int],
    positions: torch.Tensor | list[int],
    head_offset: int = 0,
) -> None:
    """Write the expected content of every layer into ``host_slots`` (blocking)."""
    s = _as_i64(host_slots)
    _check_lengths(s, _as_i64(tokens))
    for layer in range(host_pool.layer_num):
        host_pool.set_kv_slots(
            layer, s, *expected_kv(host_pool, layer, tokens, positions, head_offset)
        )


def _compare(
    where: str,
    slots: torch.Tensor,
    layer: int,
    got: tuple[torch.Tensor, ...],
    want: tuple[torch.Tensor, ...],
) -> None:
    for part, (g, w) in enumerate(zip(got, want, strict=True)):
        g = g.cpu()
        # flatten(1), not reshape(n, -1): with no slots (n == 0) the -1 would be ambiguous
        bad = (g.view(torch.uint8).flatten(1) != w.view(torch.uint8).flatten(1)).any(dim=1)
        if bool(bad.any()):
            i = int(torch.nonzero(bad)[0])
            name = ("k", "v")[part] if len(got) == 2 else "kv"
            raise AssertionError(
                f"{where} slot {int(slots[i])} (item {i}) layer {layer} {name}: content differs "
                f"({int(bad.sum())} of {bad.numel()} slots bad)"
            )


def check_device(
    pool: MHATokenToKVPool | MLATokenToKVPool,
    slots: torch.Tensor | list[int],
    tokens: torch.Tensor | list[int],
    positions: torch.Tensor | list[int],
    head_offset: int = 0,
) -> None:
    """Assert device ``slots`` hold (tokens, positions) in every layer, bit for bit."""
    s = _as_i64(slots)
    _check_lengths(s, _as_i64(tokens))
    s_dev = s.to(pool.device)
    for layer in range(pool.layer_num):
        if isinstance(pool, MHATokenToKVPool):
            got = (pool.k_buffer[layer][s_dev], pool.v_buffer[layer][s_dev])
        else:
            got = (pool.kv_buffer[layer][s_dev],)
        _compare("device", s, layer, got, expected_kv(pool, layer, tokens, positions, head_offset))


def check_host(
    host_pool: MHATokenToKVPoolHost | MLATokenToKVPoolHost,
    host_slots: torch.Tensor | list[int],
    tokens: torch.Tensor | list[int],
    positions: torch.Tensor | list[int],
    head_offset: int = 0,
) -> None:
    """Assert ``host_slots`` hold (tokens, positions) in every layer, bit for bit."""
    s = _as_i64(host_slots)
    _check_lengths(s, _as_i64(tokens))
    for layer in range(host_pool.layer_num):
        got = host_pool.get_kv_slots(layer, s)
        want = expected_kv(host_pool, layer, tokens, positions, head_offset)
        _compare("host", s, layer, got, want)


def check_tree_content(kv: Any, head_offset: int = 0) -> None:
    """Every readable slot of a ``HiRadixCache`` holds its tokens' KV: the device slots of every
    resident node not being loaded, and the host copy of every backed-up node whose write has
    been acked. ``kv`` is a ``hicache.builder.KVCache`` whose KV was written with ``write_device``
    at positions counted from the root."""
    tree = kv.tree
    loading = {id(x) for x in tree.loading_nodes()}
    pending = tree.unacked_write_host_slots()
    stack = [(c, 0) for c in tree.root_node.children.values()]
    while stack:
        x, depth = stack.pop()
        pos = list(range(depth, depth + len(x.key)))
        if not x.evicted and id(x) not in loading:
            check_device(kv.device_pool, x.value, x.key, pos, head_offset)
        if x.backuped and not bool(torch.isin(x.host_value, pending).any()):
            check_host(kv.host_pool, x.host_value, x.key, pos, head_offset)
        stack.extend((c, depth + len(x.key)) for c in x.children.values())
