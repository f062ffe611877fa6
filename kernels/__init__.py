"""KV transfer kernels between the device pool and the host pool (SGLang ``kvcacheio`` ops).

``transfer_kv_*`` (kernel backend): Triton gather/scatter kernels, see :mod:`kernels.kvcacheio`.
``transfer_kv_direct`` and the ``*_direct_*`` ops (direct backend): plain copies, see
:mod:`kernels.direct`. :mod:`kernels.reference` holds the torch reference of every op, and
:mod:`kernels.addressing` the one description of how the kernel-backend ops address memory.
"""

from __future__ import annotations

from kernels._env import ensure_triton_interpret

# Must run before anything imports triton (the kernels below do).
TRITON_INTERPRETED = ensure_triton_interpret()

from kernels._checks import debug_checks_enabled, set_debug_checks  # noqa: E402
from kernels.direct import (  # noqa: E402
    transfer_kv_all_layer_direct_lf_pf,
    transfer_kv_direct,
    transfer_kv_per_layer_direct_pf_lf,
)
from kernels.kvcacheio import (  # noqa: E402
    data_ptr_table,
    transfer_kv_all_layer,
    transfer_kv_all_layer_lf_pf,
    transfer_kv_all_layer_mla,
    transfer_kv_all_layer_mla_lf_pf,
    transfer_kv_per_layer,
    transfer_kv_per_layer_mla,
    transfer_kv_per_layer_mla_pf_lf,
    transfer_kv_per_layer_pf_lf,
)

__all__ = [
    "TRITON_INTERPRETED",
    "data_ptr_table",
    "debug_checks_enabled",
    "set_debug_checks",
    "transfer_kv_all_layer",
    "transfer_kv_all_layer_direct_lf_pf",
    "transfer_kv_all_layer_lf_pf",
    "transfer_kv_all_layer_mla",
    "transfer_kv_all_layer_mla_lf_pf",
    "transfer_kv_direct",
    "transfer_kv_per_layer",
    "transfer_kv_per_layer_direct_pf_lf",
    "transfer_kv_per_layer_mla",
    "transfer_kv_per_layer_mla_pf_lf",
    "transfer_kv_per_layer_pf_lf",
]
