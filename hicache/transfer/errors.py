"""What a failed copy between the device and host pools raises or reports.

A copy fails in one of two places, and both end in one of these errors, naming the pool call
that failed and its argument:

- at its launch (CUDA streams, and CPU streams in ``"inline"`` mode, run ``submit`` on the
  caller's thread): a validation ``ValueError`` of the op, a Triton compile or launch error, an
  out-of-memory. The controller rolls the call back (nothing allocated, queued or locked
  remains) and raises;
- while it runs on a thread-backed CPU stream: the stream hands the exception to the copy's
  event, and the copy's ack reports it (``HiCacheController.take_failure``); nothing sticks to
  the stream.

On CUDA a fault while a kernel runs is a sticky CUDA error of the whole context, not one of
these: the process cannot recover from it.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable

logger = logging.getLogger(__name__)

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
