"""One check row's run: errors recorded on the row, cleanups always run, seconds set."""

from __future__ import annotations

import contextlib
import time
import traceback
from collections.abc import Callable, Iterator
from typing import Any


@contextlib.contextmanager
def recorded_row(
    row: dict[str, Any], expected: tuple[type[BaseException], ...] = ()
) -> Iterator[list[Callable[[], Any]]]:
    """Run one check row's body: it appends its cleanups to the yielded list (run last first,
    always); an ``expected`` exception becomes the row's ``error``, any other its ``error`` and
    ``traceback``; the row's ``seconds`` is set. The row's ``ok`` is the body's to set."""
    t0 = time.monotonic()
    stops: list[Callable[[], Any]] = []
    try:
        yield stops
    except expected as e:
        row["error"] = str(e)[-3000:]
    except Exception as e:
        row["error"] = f"{type(e).__name__}: {e}"
        row["traceback"] = traceback.format_exc()
    finally:
        for stop in reversed(stops):
            stop()
        row["seconds"] = round(time.monotonic() - t0, 1)
