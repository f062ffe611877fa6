"""Kernel-backend KV copy ops with SGLang's ``sgl_kernel.kvcacheio`` names and argument order:
each is ``dst[dst_indices[i]] = src[src_indices[i]]`` per layer it covers, queued on the current
stream, never blocking; bad arguments raise ``ValueError`` naming the op and argument, an index
past its side's end :class:`kernels.KVIndexError`. The ops' common contract is in ``docs/DESIGN.md``
("Copy-op contract").
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
