"""What a failed copy between the device and host pools raises or reports: one ``CopyError``
naming the pool call and its argument, raised at a failed launch (after rollback) or handed out
at the copy's ack (``HiCacheController.take_failure``). A CUDA fault while a kernel runs is a
sticky context error instead, which nothing recovers from.
"""

from __future__ import annotations

from collections.abc import Iterable

__all__ = ["BackupError", "CopyError", "LoadBackError"]


class CopyError(RuntimeError):
    """A copy failed.

    ``op``: the call that failed with its argument, e.g.
    ``"backup_from_device_all_layer(device_indices=[8 slots])"`` or
    ``"load_to_device_per_layer(layer_id=2)"``; ``node_ids``: the tree nodes the copy was for;
    ``cause``: the original exception (also ``__cause__`` when raised ``from`` it)."""

    def __init__(
        self,
        op: str,
        detail: str,
        node_ids: Iterable[int] = (),
        cause: BaseException | None = None,
    ) -> None:
        self.op = op
        self.node_ids = list(node_ids)
        self.cause = cause
        msg = f"{op} failed: {detail}"
        if cause is not None:
            msg += f" ({type(cause).__name__}: {cause})"
        super().__init__(msg)


class BackupError(CopyError):
    """A D2H backup failed (``HiCacheController.write``)."""


class LoadBackError(CopyError):
    """An H2D load failed: at ``start_loading`` (launch), at a layer's wait (``layer_wait``,
    thread-backed CPU streams) or at its ack."""
