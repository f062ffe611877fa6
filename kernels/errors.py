"""The one error a bad slot index raises, whichever path finds it (the host validator, the torch
reference, the direct ops, or the kernel's device-side record, :mod:`kernels.triton.index_record`).
A negative index is not an error for the kernel-backend ops (the pair is skipped, as upstream).
"""

from __future__ import annotations

__all__ = ["KVIndexError", "slot_out_of_range"]


class KVIndexError(ValueError):
    """A slot index out of range for the buffer it addresses. ``op``: the op's SGLang name;
    ``argument``: ``src_indices`` or ``dst_indices``; ``slot``: an offending index (one of them
    when several are bad); ``n_slots``: the side's number of slots."""

    def __init__(self, op: str, argument: str, slot: int, n_slots: int, where: str = "") -> None:
        self.op, self.argument, self.slot, self.n_slots = op, argument, slot, n_slots
        prefix = f"{op}: " if op else ""
        suffix = f" ({where})" if where else ""
        super().__init__(
            f"{prefix}{argument} holds slot {slot}, out of range for {n_slots} slots{suffix}"
        )


def slot_out_of_range(op: str, argument: str, slot: int, n_slots: int, where: str = "") -> None:
    """Raise the :class:`KVIndexError` for ``slot`` (``where``: how it was found, when not on
    the host at the call)."""
    raise KVIndexError(op, argument, slot, n_slots, where)
