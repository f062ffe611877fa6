"""An in-process stand-in for a Mooncake master and its clients, for the ``MooncakeStore`` unit
tests (the real Mooncake runs in ``tests/prefill/test_executor_mooncake.py``).

``FakeCluster`` holds the objects (bytes by name) that every ``FakeDistributedStore`` it makes
(``cluster.factory``, what ``MooncakeStore.store_factory`` is set to) shares. The fake answers
as Mooncake 0.3.13 does (FINDINGS of the colleague's probe): a put of an existing name returns 0
and writes nothing; a missing name reads -704; a buffer smaller than the object -600, a larger
one the object's size; a full store -200; a master that is down -900 (``batch_is_exist`` as one
``[-900]``); ``health_check`` 0 / 1 after close / 2 while the master is down. Tests force codes
per name (``put_codes``, ``get_codes``) and record every call with its thread (``calls``). Any
call after ``close()`` raises (the real one segfaults). The multi-buffer calls (an object from or
into several buffers, back to back) answer as the single-buffer ones; a smaller object reads as
its size (the real 0.3.13.post1 answers -800 there: a miss either way).
"""

from __future__ import annotations

import ctypes
import threading
from typing import Any

HEALTHY, CLOSED, DOWN = 0, 1, 2


class FakeCluster:
    def __init__(self, capacity_bytes: int | None = None) -> None:
        self.objects: dict[str, bytes] = {}
        self.capacity_bytes = capacity_bytes
        self.master_down = False
        self.setup_rc = 0
        self.put_codes: dict[str, int] = {}
        self.get_codes: dict[str, int] = {}
        self.calls: list[tuple[str, str]] = []
        self.put_names: list[str] = []
        self.group_ids: list[list[str]] = []
        self.lock = threading.Lock()
        self.clients: list[FakeDistributedStore] = []

    def factory(self) -> FakeDistributedStore:
        client = FakeDistributedStore(self)
        self.clients.append(client)
        return client

    def used(self) -> int:
        return sum(len(v) for v in self.objects.values())

    def data_calls(self) -> list[tuple[str, str]]:
        """Calls that move or query data (not setup, warm-up or health)."""
        data = {"batch_is_exist", "batch_put_from", "batch_get_into"}
        data |= {"batch_put_from_multi_buffers", "batch_get_into_multi_buffers"}
        return [c for c in self.calls if c[0] in data]


class FakeDistributedStore:
    def __init__(self, cluster: FakeCluster) -> None:
        self.cluster = cluster
        self.closed = False
        self.registered: dict[int, int] = {}

    def _record(self, name: str) -> None:
        if self.closed:
            raise AssertionError(f"{name} called after close (Mooncake would segfault)")
        with self.cluster.lock:
            self.cluster.calls.append((name, threading.current_thread().name))

    def setup(self, *args: Any, **kwargs: Any) -> int:
        self._record("setup")
        self.setup_args = args
        return self.cluster.setup_rc

    def register_buffer(self, ptr: int, size: int) -> int:
        self._record("register_buffer")
        if ptr in self.registered:
            return -600
        self.registered[ptr] = size
        return 0

    def unregister_buffer(self, ptr: int) -> int:
        self._record("unregister_buffer")
        return 0 if self.registered.pop(ptr, None) is not None else -3

    def health_check(self) -> int:
        if self.closed:
            return CLOSED
        return DOWN if self.cluster.master_down else HEALTHY

    def batch_is_exist(self, names: list[str]) -> list[int]:
        self._record("batch_is_exist")
        if self.cluster.master_down:
            return [-900]
        with self.cluster.lock:
            return [1 if n in self.cluster.objects else 0 for n in names]

    def batch_put_from(
        self, names: list[str], ptrs: list[int], sizes: list[int], config: Any = None
    ) -> list[int]:
        self._record("batch_put_from")
        values = [ctypes.string_at(ptr, size) for ptr, size in zip(ptrs, sizes, strict=True)]
        return self._put_values(names, values, config)

    def batch_put_from_multi_buffers(
        self, names: list[str], ptrs: list[list[int]], sizes: list[list[int]], config: Any = None
    ) -> list[int]:
        self._record("batch_put_from_multi_buffers")
        values = [
            b"".join(ctypes.string_at(p, n) for p, n in zip(ps, ns, strict=True))
            for ps, ns in zip(ptrs, sizes, strict=True)
        ]
        return self._put_values(names, values, config)

    def _put_values(self, names: list[str], values: list[bytes], config: Any) -> list[int]:
        if config is not None:
            self.cluster.group_ids.append(list(config.group_ids))
        out = []
        with self.cluster.lock:
            for name, value in zip(names, values, strict=True):
                self.cluster.put_names.append(name)
                if self.cluster.master_down:
                    out.append(-900)
                elif name in self.cluster.put_codes:
                    out.append(self.cluster.put_codes[name])
                elif name in self.cluster.objects:
                    out.append(0)  # no overwrite
                elif not value:
                    out.append(-600)
                elif self.cluster.capacity_bytes is not None and (
                    self.cluster.used() + len(value) > self.cluster.capacity_bytes
                ):
                    out.append(-200)
                else:
                    self.cluster.objects[name] = value
                    out.append(0)
        return out

    def batch_get_into(self, names: list[str], ptrs: list[int], sizes: list[int]) -> list[int]:
        self._record("batch_get_into")
        return self._get_into(names, [[p] for p in ptrs], [[n] for n in sizes])

    def batch_get_into_multi_buffers(
        self, names: list[str], ptrs: list[list[int]], sizes: list[list[int]]
    ) -> list[int]:
        self._record("batch_get_into_multi_buffers")
        return self._get_into(names, ptrs, sizes)

    def _get_into(
        self, names: list[str], ptrs: list[list[int]], sizes: list[list[int]]
    ) -> list[int]:
        out = []
        with self.cluster.lock:
            for name, ptr, size in zip(names, ptrs, sizes, strict=True):
                obj = self.cluster.objects.get(name)
                if self.cluster.master_down:
                    out.append(-900)
                elif name in self.cluster.get_codes:
                    out.append(self.cluster.get_codes[name])
                elif obj is None:
                    out.append(-704)
                elif len(obj) > sum(size):
                    out.append(-600)
                else:
                    at = 0
                    for p, n in zip(ptr, size, strict=True):
                        part = obj[at : at + n]
                        ctypes.memmove(p, part, len(part))
                        at += len(part)
                    out.append(len(obj))
        return out

    def put(self, name: str, value: bytes) -> int:
        self._record("put")
        if self.cluster.capacity_bytes == 0:
            return -200
        with self.cluster.lock:
            self.cluster.objects.setdefault(name, bytes(value))
        return 0

    def is_exist(self, name: str) -> int:
        """1 or 0 (SGLang's ``MooncakeStore.warmup`` asks it of one name)."""
        self._record("is_exist")
        return int(name in self.cluster.objects)

    def get(self, name: str) -> bytes:
        self._record("get")
        return self.cluster.objects.get(name, b"")

    def remove(self, name: str, force: bool = False) -> int:
        self._record("remove")
        return 0 if self.cluster.objects.pop(name, None) is not None else -704

    def remove_all(self, force: bool = False) -> int:
        self._record("remove_all")
        n = len(self.cluster.objects)
        self.cluster.objects.clear()
        return n

    def close(self) -> int:
        self._record("close")
        self.closed = True
        return 0
