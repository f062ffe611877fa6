"""The executor's side of the optimistic-prefill gate: which attempts it may use, and a refusal
at build time of any optimism the gate would not keep for the cache it is given.

``ServerArgs`` resolves ``optimistic_prefill_attempts`` once, from flags. The executor asks again
when it is built, with the write policy the cache's tree declares (``tree.write_policy``, and
``tree.backs_up_on_insert`` in the message) and the flags as they are now, so attempts set back
after resolution, or a cache built from other flags, cannot run optimism the gate turned off.
"""

from __future__ import annotations

import logging
from typing import Any

logger = logging.getLogger(__name__)


def resolved_attempts(args: Any) -> int:
    """Optimistic attempts the executor may use: the gate's resolved value, and only in
    ``--disaggregation-mode prefill`` (upstream reads the flag nowhere else, and the gate only
    checks that mode, so any other mode runs without optimism)."""
    attempts = int(args.optimistic_prefill_attempts)
    if attempts > 0 and args.disaggregation_mode != "prefill":
        logger.warning(
            "optimistic prefill ignored: --optimistic-prefill-attempts=%d applies only with "
            "--disaggregation-mode prefill (got %s)", attempts, args.disaggregation_mode,
        )  # fmt: skip
        return 0
    return attempts


def check_gate(args: Any, cache: Any, attempts: int) -> None:
    """Raise ``ValueError`` naming the flags when ``attempts > 0`` but the gate would resolve
    them to 0 for what the cache declares: its tree's write policy (``None`` without an L2
    tier), whether it has an L3 tier and its host memory mode, reading ``args`` as they are now.
    A plain namespace without ``optimistic_gate_allows`` gets the earlier gate (L2 only under
    write_back, no storage)."""
    if attempts <= 0:
        return
    tree = cache.tree
    policy = getattr(tree, "write_policy", None) if cache.hierarchical else None
    storage = getattr(cache, "storage", None)
    mode = storage.settings.host_memory_mode if storage is not None else "cache"
    allows = getattr(args, "optimistic_gate_allows", None)
    if allows is not None:
        ok = allows(policy, storage=storage is not None, host_memory_mode=mode)
    else:
        ok = policy in (None, "write_back") and storage is None
    if ok:
        return
    raise ValueError(
        f"--optimistic-prefill-attempts={attempts} is not allowed with this cache: its tree "
        f"declares --hicache-write-policy={policy} (backs up at insert: "
        f"{tree.backs_up_on_insert}) with --optimistic-prefill-write-through="
        f"{getattr(args, 'optimistic_prefill_write_through', False)}, "
        f"a storage tier: {storage is not None} (--hicache-host-memory-mode={mode}), "
        f"--pp-size={getattr(args, 'pp_size', 1)}, --uses-mamba-radix-cache="
        f"{getattr(args, 'uses_mamba_radix_cache', False)}; the gate resolves this to 0 "
        "attempts (were ServerArgs changed after they were resolved?)"
    )


def log_gate_once(args: Any) -> None:
    """One warning when the gate turned optimism off, so an operator sees why requests wait."""
    for r in getattr(args, "resolutions", []):
        if getattr(r, "field", None) == "optimistic_prefill_attempts" and r.new == 0:
            logger.warning(
                "optimistic prefill disabled: %s (requested %s attempts); requests wait for "
                "their decode peer before prefill", r.reason, r.old,
            )  # fmt: skip
            return
