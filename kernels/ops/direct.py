"""Direct-backend KV copies (SGLang ``io_backend="direct"``): plain ``copy_`` calls, no kernel, one
per maximal run of consecutive slots or per (page, layer) block, bytes copied raw. As upstream,
the indices are read on the host (a synchronization on CUDA), then each copy is queued
``non_blocking``. A negative index is a ``ValueError``; one past a side's end a ``KVIndexError``.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from hicache_prefill.kernels.errors import KVIndexError
from hicache_prefill.kernels.layout.byte_views import page_rows, row_bytes, token_rows
from hicache_prefill.kernels.ops import checks


def _host_indices(
    src_indices: torch.Tensor, dst_indices: torch.Tensor, page_size: int
) -> tuple[torch.Tensor, torch.Tensor]:
    checks.index_pair(src_indices, dst_indices)
    checks.positive_int("page_size", page_size)
    if src_indices.numel() % page_size:
        raise ValueError(
            f"len(src_indices)={src_indices.numel()} is not a multiple of page_size={page_size}"
        )
    s, d = src_indices.cpu(), dst_indices.cpu()
    for name, idx in (("src_indices", s), ("dst_indices", d)):
        if idx.numel() and int(idx.min()) < 0:
            raise ValueError(f"{name} holds a negative slot; the direct ops copy every pair")
    return s, d


def _in_range(op: str, name: str, idx: torch.Tensor, n_slots: int) -> None:
    if idx.numel() and int(idx.max()) >= n_slots:
        raise KVIndexError(op, name, int(idx.max()), n_slots)


def _runs(s: torch.Tensor, d: torch.Tensor) -> list[tuple[int, int, int]]:
    """Maximal runs ``(s0, d0, n)`` where both index sequences step by exactly one."""
    if s.numel() == 0:
        return []
    breaks = ((s[1:] - s[:-1]) != 1) | ((d[1:] - d[:-1]) != 1)
    starts = torch.cat([torch.zeros(1, dtype=torch.int64), breaks.nonzero().flatten() + 1])
    ends = torch.cat([starts[1:], torch.tensor([s.numel()])])
    return [
        (int(s[a]), int(d[a]), int(b - a))
        for a, b in zip(starts.tolist(), ends.tolist(), strict=True)
    ]


def _pages(
    name: str, host_side: torch.Tensor, other: torch.Tensor, page_size: int, other_name: str
) -> torch.Tensor:
    """Start slots of each page group: whole, aligned pages of ``host_side``, consecutive slots
    of ``other``."""
    n_pages = host_side.numel() // page_size
    hs = host_side.view(n_pages, page_size)
    os_ = other.view(n_pages, page_size)
    step = torch.arange(page_size, dtype=torch.int64)
    if not torch.equal(hs - hs[:, :1], step.expand_as(hs)) or bool((hs[:, 0] % page_size).any()):
        raise ValueError(f"{name} must name whole pages: page_size aligned, consecutive slots")
    if not torch.equal(os_ - os_[:, :1], step.expand_as(os_)):
        raise ValueError(f"{other_name} must be consecutive within each page of {page_size}")
    return hs[:, 0]


def _page_buffers(name: str, bufs: Sequence[object], page_size: int) -> list[torch.Tensor]:
    out = []
    for i, b in enumerate(bufs):
        if not isinstance(b, torch.Tensor) or b.dim() < 3 or b.shape[2] != page_size:
            shape = tuple(b.shape) if isinstance(b, torch.Tensor) else type(b).__name__
            raise ValueError(
                f"{name}[{i}] must be page_first_direct [P, L, page_size={page_size}, ...], "
                f"got {shape}"
            )
        if not b.is_contiguous():
            raise ValueError(f"{name}[{i}] must be contiguous")
        out.append(b)
    if len(out) == 2:  # K and V: same pages and layers, each its own bytes per token
        checks.same_slots(f"{name}[0]", out[0], f"{name}[1]", out[1], 3)
    return out


def _layer_tensors(
    name: str, layers: Sequence[object], widths: Sequence[int] | None
) -> list[torch.Tensor]:
    """Contiguous tensors ``[T, ...]``, with ``widths[i]`` bytes per slot when given."""
    out = []
    for i, t in enumerate(layers):
        if not isinstance(t, torch.Tensor) or t.dim() == 0 or not t.is_contiguous():
            raise ValueError(f"{name}[{i}] must be a contiguous tensor [T, ...]")
        if widths is not None and row_bytes(t) != widths[i]:
            raise ValueError(
                f"{name}[{i}] holds {row_bytes(t)} bytes per slot, the other side {widths[i]}"
            )
        out.append(t)
    return out


def transfer_kv_direct(
    src_layers: Sequence[torch.Tensor],
    dst_layers: Sequence[torch.Tensor],
    src_indices: torch.Tensor,
    dst_indices: torch.Tensor,
    page_size: int,
) -> None:
    """``dst_layers[j][d] = src_layers[j][s]``, one ``copy_`` per maximal consecutive run. Pairs
    share bytes per slot (K and V pairs may differ); ``len(src_indices)`` a multiple of
    ``page_size``."""
    checks.layer_lists("src_layers", src_layers, "dst_layers", dst_layers)
    if len(src_layers) != len(dst_layers):
        raise ValueError(
            f"src_layers and dst_layers must pair up, got {len(src_layers)} and {len(dst_layers)}"
        )
    srcs = _layer_tensors("src_layers", src_layers, None)
    width = [row_bytes(t) for t in srcs]
    dsts = _layer_tensors("dst_layers", dst_layers, width)
    s, d = _host_indices(src_indices, dst_indices, page_size)
    _in_range("transfer_kv_direct", "src_indices", s, min(t.shape[0] for t in srcs))
    _in_range("transfer_kv_direct", "dst_indices", d, min(t.shape[0] for t in dsts))
    rows = [(token_rows(a, w), token_rows(b, w)) for a, b, w in zip(srcs, dsts, width, strict=True)]
    for s0, d0, n in _runs(s, d):
        for src, dst in rows:
            dst[d0 : d0 + n].copy_(src[s0 : s0 + n], non_blocking=True)


def _split(n_bufs: int, n_layer_tensors: int, name: str) -> int:
    if n_bufs not in (1, 2) or n_layer_tensors % n_bufs:
        raise ValueError(
            f"{name} must hold L layer tensors per page_first_direct buffer (1 for MLA, "
            f"2 for K and V), got {n_layer_tensors} for {n_bufs} buffers"
        )
    return n_layer_tensors // n_bufs


def _page_copies(
    src_ptrs: Sequence[torch.Tensor],
    dst_ptrs: Sequence[torch.Tensor],
    src_indices: torch.Tensor,
    dst_indices: torch.Tensor,
    page_size: int,
    layer_id: int,
    to_host: bool,
) -> None:
    """Both page_first_direct ops, one ``copy_`` per (page, layer): host buffers ``src_ptrs`` ->
    device layers ``layer_id, ...`` (H2D), or (``to_host``) all device layers -> ``dst_ptrs``."""
    host, dev = ("dst", "src") if to_host else ("src", "dst")  # which argument is which
    ptrs = {"src": src_ptrs, "dst": dst_ptrs}
    checks.layer_lists("src_ptrs", src_ptrs, "dst_ptrs", dst_ptrs)
    hosts = _page_buffers(f"{host}_ptrs", ptrs[host], page_size)
    n_layers = _split(len(hosts), len(ptrs[dev]), f"{dev}_ptrs")
    host_layers = hosts[0].shape[1]
    if to_host and n_layers != host_layers:
        raise ValueError(f"src_ptrs holds {n_layers} layers per buffer, dst_ptrs {host_layers}")
    widths = [row_bytes(h) // (host_layers * page_size) for h in hosts]
    devs = _layer_tensors(
        f"{dev}_ptrs", ptrs[dev], [widths[i // n_layers] for i in range(len(ptrs[dev]))]
    )
    if not to_host:
        checks.layer_id_in_range(layer_id, host_layers - n_layers + 1)
    s, d = _host_indices(src_indices, dst_indices, page_size)
    idx = {"src": s, "dst": d}
    n_slots = {host: hosts[0].shape[0] * page_size, dev: min(t.shape[0] for t in devs)}
    op = "transfer_kv_all_layer_direct_lf_pf" if to_host else "transfer_kv_per_layer_direct_pf_lf"
    for side in ("src", "dst"):
        _in_range(op, f"{side}_indices", idx[side], n_slots[side])
    starts = _pages(f"{host}_indices", idx[host], idx[dev], page_size, f"{dev}_indices")
    host_pages = (starts // page_size).tolist()
    dev_starts = (idx[dev].view(-1, page_size)[:, 0] if idx[dev].numel() else idx[dev]).tolist()
    for kv, buf in enumerate(hosts):
        pages = page_rows(buf, page_size)
        for j in range(n_layers):
            rows = token_rows(devs[kv * n_layers + j], widths[kv])
            for p, t0 in zip(host_pages, dev_starts, strict=True):
                page, run = pages[p, layer_id + j], rows[t0 : t0 + page_size]
                if to_host:
                    page.copy_(run, non_blocking=True)
                else:
                    run.copy_(page, non_blocking=True)


def transfer_kv_per_layer_direct_pf_lf(
    src_ptrs: Sequence[torch.Tensor],
    dst_ptrs: Sequence[torch.Tensor],
    src_indices: torch.Tensor,
    dst_indices: torch.Tensor,
    layer_id: int,
    page_size: int,
) -> None:
    """page_first_direct host buffers ``[P, L, page_size, ...]`` (K, V or the MLA one) -> device
    layer tensors (K layers then V, from ``layer_id``), one ``copy_`` per (page, layer).
    ``src_indices``: whole host pages; ``dst_indices``: consecutive slots within each page."""
    _page_copies(src_ptrs, dst_ptrs, src_indices, dst_indices, page_size, layer_id, to_host=False)


def transfer_kv_all_layer_direct_lf_pf(
    src_ptrs: Sequence[torch.Tensor],
    dst_ptrs: Sequence[torch.Tensor],
    src_indices: torch.Tensor,
    dst_indices: torch.Tensor,
    page_size: int,
) -> None:
    """All device layer tensors (K layers then V) -> page_first_direct host buffers, one
    ``copy_`` per (page, layer). ``dst_indices``: whole host pages; ``src_indices``: consecutive
    slots within each page."""
    _page_copies(src_ptrs, dst_ptrs, src_indices, dst_indices, page_size, 0, to_host=True)


def transfer_embedding_ranges_direct(
    src: torch.Tensor,
    dst: torch.Tensor,
    src_starts: Sequence[int],
    dst_starts: Sequence[int],
    lengths: Sequence[int],
) -> None:
    """``dst[dst_starts[i] : + lengths[i]] = src[src_starts[i] : + lengths[i]]`` per range, for
    contiguous ``[rows, dim]`` tensors, one on CUDA when CUDA exists. Every range is checked
    before the first copy (a bad one raises ``ValueError`` and writes nothing)."""
    for name, t in (("src", src), ("dst", dst)):
        if not isinstance(t, torch.Tensor) or t.dim() != 2 or not t.is_contiguous():
            raise ValueError(f"{name} must be a contiguous 2-D tensor [rows, dim]")
    if src.dtype != dst.dtype or src.shape[1] != dst.shape[1]:
        raise ValueError(
            f"src and dst must share dtype and dim, got {src.dtype}/{src.shape[1]} and "
            f"{dst.dtype}/{dst.shape[1]}"
        )
    if torch.cuda.is_available() and src.is_cuda == dst.is_cuda:
        raise ValueError("exactly one of src and dst must be a CUDA tensor")
    if not len(src_starts) == len(dst_starts) == len(lengths):
        raise ValueError("src_starts, dst_starts and lengths must have the same length")
    plan = []
    for i, (s0, d0, n) in enumerate(zip(src_starts, dst_starts, lengths, strict=True)):
        if n < 0:
            raise ValueError(f"lengths[{i}]={n} is negative")
        if n == 0:
            continue
        if s0 < 0 or s0 + n > src.shape[0]:
            raise ValueError(f"src_starts[{i}]={s0} + {n} rows is out of range [0, {src.shape[0]}]")
        if d0 < 0 or d0 + n > dst.shape[0]:
            raise ValueError(f"dst_starts[{i}]={d0} + {n} rows is out of range [0, {dst.shape[0]}]")
        plan.append((s0, d0, n))
    for s0, d0, n in plan:
        dst[d0 : d0 + n].copy_(src[s0 : s0 + n], non_blocking=True)
