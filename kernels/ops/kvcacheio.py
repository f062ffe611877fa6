"""Kernel-backend KV copy ops with SGLang's ``sgl_kernel.kvcacheio`` names and argument order.

Every op is ``dst[dst_indices[i]] = src[src_indices[i]]`` in its addressing (see
:mod:`kernels.layout.addressing`), for each layer it covers, K and V (MHA) or the one latent buffer
(MLA). Common contract:

- ``src_indices`` / ``dst_indices``: int64, 1-D, equal length, on the device the op runs on
  (CUDA, or CPU under ``TRITON_INTERPRET=1``). A pair with a negative index is skipped, as
  upstream. ``dst_indices`` should not repeat a slot (which source wins is then unspecified).
- ``item_size``: bytes of one token of one layer of K; any positive size (upstream needs a
  multiple of 8). Raw bytes are copied, so the dtype is free (bf16, fp16, fp8, fp32, ...).
- K and V may differ in bytes per token (K head 192, V head 128): V is copied with its own size,
  read from the V tensors (their slot and layer dimensions must match K's); the layout dims scale
  with it. An op whose two sides are tables (``transfer_kv_all_layer``) has no V tensor to read:
  there K and V are one size, as upstream; copy other sizes with the MLA op, once per part.
- Data tensors: contiguous; on the indices' device, or on CUDA, pinned (or
  ``cudaHostRegister``-ed) host memory, which the kernel reads and writes directly.
- ``*_layers`` tables: 1-D int64/uint64 tensors of per-layer ``data_ptr()``s on the indices'
  device; entries may be pinned host addresses on CUDA. An entry must be aligned to the word
  ``item_size`` allows (any buffer of whole ``item_size`` rows is). Tables built by
  :func:`data_ptr_table` (or checked once by :func:`kernels.verify_ptr_table`) carry their
  alignment, which lets the kernel use 16-byte accesses on that side.
- page_head buffers ``[T / page_size, head_num, page_size, L, head_dim]``: the ``*_ph`` ops copy
  head by head (``item_size / head_num`` bytes), as upstream.
- ``block_quota`` caps the number of programs (CTAs); ``num_warps_per_block`` is rounded down to
  a power of two, at most 32 (16 on HIP).
- Only the destination is written. The op is queued on the current stream and never blocks the
  host; bad arguments raise ``ValueError`` naming the op and the argument (index ranges and
  table entries are read on CPU always, on CUDA with :func:`kernels.set_debug_checks`). An index
  at or past its side's end (a table side: the bound recorded with the table) raises
  :class:`kernels.KVIndexError`: at the call where the host reads the indices, else the kernel
  skips the pair, records it on the device without synchronizing, and the copy's check raises
  (:func:`kernels.watch_copies`; the controller checks at each ack).
- Repeated calls over the same buffers reuse a cached launch plan (:mod:`kernels.ops.plans`).

CPU tensors on a machine that compiles Triton for CUDA (no interpreter) run the torch reference.

Each op is a bound method of a :class:`kernels.ops.kernel_backend.KernelBackendOps`, where the
signatures are written once (the torch reference, :mod:`kernels.ops.reference`, shares them): it
names its arguments' roles in a :class:`kernels.layout.addressing.KVCopy`, which
:mod:`kernels.ops.dispatch` validates and launches (:mod:`kernels.triton.launch`, the one kernel in
:mod:`kernels.triton.copy_kernel`) or runs on the reference.
"""

from __future__ import annotations

import logging

from kernels.layout.ptr_tables import data_ptr_table, get_device_accessible_ptr  # noqa: F401 (as upstream's)
from kernels.ops.dispatch import transfer
from kernels.ops.kernel_backend import KernelBackendOps

logger = logging.getLogger(__name__)

_ops = KernelBackendOps(transfer)

transfer_kv_per_layer = _ops.transfer_kv_per_layer
transfer_kv_per_layer_pf_lf = _ops.transfer_kv_per_layer_pf_lf
transfer_kv_per_layer_ph_lf = _ops.transfer_kv_per_layer_ph_lf
transfer_kv_all_layer = _ops.transfer_kv_all_layer
transfer_kv_all_layer_lf_pf = _ops.transfer_kv_all_layer_lf_pf
transfer_kv_all_layer_lf_ph = _ops.transfer_kv_all_layer_lf_ph
transfer_kv_per_layer_mla = _ops.transfer_kv_per_layer_mla
transfer_kv_per_layer_mla_pf_lf = _ops.transfer_kv_per_layer_mla_pf_lf
transfer_kv_per_layer_mla_lf_pf = _ops.transfer_kv_per_layer_mla_lf_pf
transfer_kv_all_layer_mla = _ops.transfer_kv_all_layer_mla
transfer_kv_all_layer_mla_lf_pf = _ops.transfer_kv_all_layer_mla_lf_pf
