"""The one error a bad slot index raises, whichever path finds it (host check, torch reference,
direct ops, or the kernel's device-side record). A negative index is not an error for the
kernel-backend ops: the pair is skipped, as upstream.
"""

from __future__ import annotations


class KVIndexError(ValueError):
    """A slot index out of range for the buffer it addresses. ``argument``: ``src_indices`` or
    ``dst_indices``; ``slot``: one offending index; ``n_slots``: that side's slot count."""

    def __init__(self, op: str, argument: str, slot: int, n_slots: int, where: str = "") -> None:
        self.op, self.argument, self.slot, self.n_slots = op, argument, slot, n_slots
        prefix = f"{op}: " if op else ""
        suffix = f" ({where})" if where else ""
        super().__init__(
            f"{prefix}{argument} holds slot {slot}, out of range for {n_slots} slots{suffix}"
        )
