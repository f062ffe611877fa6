"""KV transfer kernels between the device pool and the host pool: the whole ``sgl_kernel.kvcacheio``
surface with SGLang's names, argument order and meaning (:data:`KVCACHEIO_OPS`). A bad slot index
raises :class:`KVIndexError`, at the call or when the copy is checked (:func:`watch_copies`).
"""

from __future__ import annotations

from hicache_prefill.kernels._env import ensure_triton_interpret

# Must run before anything imports triton (the kernels below do).
TRITON_INTERPRETED = ensure_triton_interpret()

from hicache_prefill.kernels.errors import KVIndexError  # noqa: E402
from hicache_prefill.kernels.layout.ptr_tables import (  # noqa: E402
    data_ptr_table,
    get_device_accessible_ptr,
    table_bound,
    verified_alignment,
    verify_ptr_table,
)
from hicache_prefill.kernels.ops.checks import debug_checks_enabled, set_debug_checks  # noqa: E402
from hicache_prefill.kernels.ops.direct import (  # noqa: E402
    transfer_embedding_ranges_direct,
    transfer_kv_all_layer_direct_lf_pf,
    transfer_kv_direct,
    transfer_kv_per_layer_direct_pf_lf,
)
from hicache_prefill.kernels.ops.kvcacheio import (  # noqa: E402
    transfer_kv_all_layer,
    transfer_kv_all_layer_lf_pf,
    transfer_kv_all_layer_lf_ph,
    transfer_kv_all_layer_mla,
    transfer_kv_all_layer_mla_lf_pf,
    transfer_kv_per_layer,
    transfer_kv_per_layer_mla,
    transfer_kv_per_layer_mla_lf_pf,
    transfer_kv_per_layer_mla_pf_lf,
    transfer_kv_per_layer_pf_lf,
    transfer_kv_per_layer_ph_lf,
)
from hicache_prefill.kernels.ops.plans import clear_plans  # noqa: E402
from hicache_prefill.kernels.triton.index_record import (  # noqa: E402
    CopyWatch,
    check_unwatched_index_errors,
    watch_copies,
)

__all__ = [
    "KVCACHEIO_OPS",
    "TRITON_INTERPRETED",
    "CopyWatch",
    "KVIndexError",
    "check_unwatched_index_errors",
    "clear_plans",
    "data_ptr_table",
    "debug_checks_enabled",
    "get_device_accessible_ptr",
    "set_debug_checks",
    "table_bound",
    "transfer_embedding_ranges_direct",
    "transfer_kv_all_layer",
    "transfer_kv_all_layer_direct_lf_pf",
    "transfer_kv_all_layer_lf_pf",
    "transfer_kv_all_layer_lf_ph",
    "transfer_kv_all_layer_mla",
    "transfer_kv_all_layer_mla_lf_pf",
    "transfer_kv_direct",
    "transfer_kv_per_layer",
    "transfer_kv_per_layer_direct_pf_lf",
    "transfer_kv_per_layer_mla",
    "transfer_kv_per_layer_mla_lf_pf",
    "transfer_kv_per_layer_mla_pf_lf",
    "transfer_kv_per_layer_pf_lf",
    "transfer_kv_per_layer_ph_lf",
    "verified_alignment",
    "verify_ptr_table",
    "watch_copies",
]

KVCACHEIO_OPS = tuple(
    name for name in __all__ if name.startswith("transfer_") or name == "get_device_accessible_ptr"
)
