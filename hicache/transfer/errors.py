"""What a failed copy between the device and host pools raises at its launch (after rollback)
or reports at its ack (``HiCacheController.take_failure``).
"""

from __future__ import annotations

from collections.abc import Iterable


class CopyError(RuntimeError):
    """A copy failed. ``op``: the call with its argument, e.g.
    ``"load_to_device_per_layer(layer_id=2)"``; ``node_ids``: the tree nodes it was for."""

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
    """An H2D load failed: at ``start_loading``, at a layer's wait or at its ack."""
