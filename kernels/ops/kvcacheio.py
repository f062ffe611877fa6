"""The 11 kernel-backend ``kvcacheio`` ops (SGLang's names and signatures, built from
:data:`kernels.ops.kernel_backend.OP_SPECS`) over the validating Triton launcher. Each name is
bound here so that readers and tools find the public surface."""

from __future__ import annotations

from hicache_prefill.kernels.ops.dispatch import transfer
from hicache_prefill.kernels.ops.kernel_backend import build_ops

_OPS = build_ops(transfer, __name__)
transfer_kv_per_layer = _OPS["transfer_kv_per_layer"]
transfer_kv_per_layer_pf_lf = _OPS["transfer_kv_per_layer_pf_lf"]
transfer_kv_per_layer_ph_lf = _OPS["transfer_kv_per_layer_ph_lf"]
transfer_kv_all_layer = _OPS["transfer_kv_all_layer"]
transfer_kv_all_layer_lf_pf = _OPS["transfer_kv_all_layer_lf_pf"]
transfer_kv_all_layer_lf_ph = _OPS["transfer_kv_all_layer_lf_ph"]
transfer_kv_per_layer_mla = _OPS["transfer_kv_per_layer_mla"]
transfer_kv_per_layer_mla_pf_lf = _OPS["transfer_kv_per_layer_mla_pf_lf"]
transfer_kv_per_layer_mla_lf_pf = _OPS["transfer_kv_per_layer_mla_lf_pf"]
transfer_kv_all_layer_mla = _OPS["transfer_kv_all_layer_mla"]
transfer_kv_all_layer_mla_lf_pf = _OPS["transfer_kv_all_layer_mla_lf_pf"]
