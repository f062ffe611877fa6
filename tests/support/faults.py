"""Injected copy failures for the error-path tests.

``CopyFaults`` replaces callables the controller reaches (host pool copies, the kernel ops they
call, direct ops included, the controller's index move) with wrappers that raise
``InjectedFault`` on chosen calls, from whichever thread runs them (the caller's on inline
streams, a worker's on thread streams). Which calls fail is decided by ``plan``: call numbers per
target (deterministic stories) or a rate with a seeded RNG (property tests). ``restore()`` puts
every original back; use it as a context manager.

``stream_caches`` lists the stream modes the suites run in, for parametrized tests.
"""

from __future__ import annotations

import random
import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

from hicache_prefill import kernels
from hicache_prefill.hicache.memory.host_pool import MHATokenToKVPoolHost, MLATokenToKVPoolHost
from hicache_prefill.hicache.transfer.controller import HiCacheController

STREAM_MODES = ("thread", "inline")

# What a controller's copies call, by the name a test uses for it.
BACKUP_OPS = (
    "transfer_kv_all_layer",
    "transfer_kv_all_layer_lf_pf",
    "transfer_kv_all_layer_mla",
    "transfer_kv_all_layer_mla_lf_pf",
    "transfer_kv_all_layer_direct_lf_pf",
)
LOAD_OPS = (
    "transfer_kv_per_layer",
    "transfer_kv_per_layer_pf_lf",
    "transfer_kv_per_layer_mla",
    "transfer_kv_per_layer_mla_pf_lf",
    "transfer_kv_per_layer_direct_pf_lf",
)
BOTH_OPS = ("transfer_kv_direct",)  # the direct op of layer_first serves both directions


class InjectedFault(RuntimeError):
    """The failure a ``CopyFaults`` wrapper raises."""


class CopyFaults:
    """Wrappers that fail chosen calls (see the module docstring).

    ``fail_calls(name, calls)``: the target's calls numbered ``calls`` (0-based, counted per
    target) raise; ``fail_rate(rate, seed)``: every wrapped call raises with probability
    ``rate``. ``targets``: by default every kernel op above, the host pools' two copies and
    the controller's index move."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._saved: list[tuple[Any, str, Any]] = []
        self._calls: dict[str, int] = {}
        self._planned: dict[str, set[int]] = {}
        self._rate = 0.0
        self._rng = random.Random(0)
        self.failures: list[str] = []  # names of the calls that raised, in order

    # ------------------------------------------------------------------ plans
    def fail_calls(self, name: str, calls: set[int] | list[int] | range) -> CopyFaults:
        self._planned[name] = set(calls)
        return self

    def fail_rate(self, rate: float, seed: int = 0) -> CopyFaults:
        self._rate = rate
        self._rng = random.Random(seed)
        return self

    def off(self) -> None:
        """No more failures (wrappers stay; calls pass through)."""
        with self._lock:
            self._planned.clear()
            self._rate = 0.0

    # ------------------------------------------------------------------ install
    def install(self) -> CopyFaults:
        for name in (*BACKUP_OPS, *LOAD_OPS, *BOTH_OPS):
            self._wrap(kernels, name, name)
        for cls in (MHATokenToKVPoolHost, MLATokenToKVPoolHost):
            for method in ("backup_from_device_all_layer", "load_to_device_per_layer"):
                self._wrap(cls, method, method)
        self._wrap(HiCacheController, "_move_indices", "move_indices")
        return self

    def restore(self) -> None:
        for owner, attr, original in reversed(self._saved):
            setattr(owner, attr, original)
        self._saved.clear()

    def __enter__(self) -> CopyFaults:
        return self.install()

    def __exit__(self, *exc: object) -> None:
        self.restore()

    def calls(self, name: str) -> int:
        with self._lock:
            return self._calls.get(name, 0)

    # ------------------------------------------------------------------ internals
    def _should_fail(self, name: str) -> bool:
        with self._lock:
            i = self._calls.get(name, 0)
            self._calls[name] = i + 1
            fail = i in self._planned.get(name, ()) or (
                self._rate > 0 and self._rng.random() < self._rate
            )
            if fail:
                self.failures.append(name)
            return fail

    def _wrap(self, owner: Any, attr: str, name: str) -> None:
        original = getattr(owner, attr)
        self._saved.append((owner, attr, original))
        should_fail = self._should_fail

        def wrapper(*args: Any, **kwargs: Any) -> Any:
            if should_fail(name):
                raise InjectedFault(f"injected failure of {name}")
            return original(*args, **kwargs)

        setattr(owner, attr, wrapper)


@contextmanager
def copy_faults(setup: Callable[[CopyFaults], object] | None = None) -> Iterator[CopyFaults]:
    """``CopyFaults`` installed for a ``with`` block (``setup`` plans its failures)."""
    faults = CopyFaults()
    if setup is not None:
        setup(faults)
    with faults:
        yield faults
