"""Agreement between tensor-parallel ranks on cache decisions (SGLang's ``tp_cache_group``), over
a CPU (gloo) group: rank-local values become one value every rank applies.

THE INVARIANT: every rank enters every primitive, in the same order, exactly once per call site,
whatever its local state: compute the local value unconditionally, agree, then act on the agreed
value. Call from one thread. Each primitive opens with one all_reduce (MIN) of ``[h, -h, a, b]``,
``h`` a hash of the call site, so ranks at different sites raise ``CollectiveMismatchError``.
"""

from __future__ import annotations

import datetime
import logging
import operator
import os
import pickle
import threading
from collections.abc import Sequence
from typing import Any

import torch

from hicache_prefill.hicache.tp.digest import digest

logger = logging.getLogger(__name__)

_LIMIT = (1 << 62) - 1  # payload ints stay far from int64's edges, so -v never overflows

TP_TIMEOUT_ENV = "SGLANG_HICACHE_TP_TIMEOUT"
DEFAULT_TP_TIMEOUT_S = 120.0  # gloo's own default, 30 minutes, would hold every other rank


def tp_timeout_s() -> float:
    """Seconds a collective may block before it raises (``SGLANG_HICACHE_TP_TIMEOUT``)."""
    raw = os.environ.get(TP_TIMEOUT_ENV, "").strip()
    if not raw:
        return DEFAULT_TP_TIMEOUT_S
    try:
        value = float(raw)
    except ValueError:
        value = -1.0
    if not value > 0 or value == float("inf"):
        raise ValueError(f"{TP_TIMEOUT_ENV} must be a positive number of seconds, got {raw!r}")
    return value


class RankDivergenceError(RuntimeError):
    """Ranks disagree on a value that must be identical (``assert_same``). Raised on every rank.
    ``differing``: ranks whose digest differs from the most common one (rank 0's on a tie)."""

    def __init__(self, tag: str, digests: list[int], detail: str = "") -> None:
        self.tag = tag
        self.digests = digests
        counts: dict[int, int] = {}
        for d in digests:
            counts[d] = counts.get(d, 0) + 1
        ref = max(counts, key=lambda d: counts[d])
        self.differing = [r for r, d in enumerate(digests) if d != ref]
        table = ", ".join(f"rank {r}: {d:016x}" for r, d in enumerate(digests))
        self.detail = detail
        super().__init__(
            f"ranks diverged at {tag!r}: ranks {self.differing} differ from the others ({table})"
            + (f"; {detail}" if detail else "")
        )


class CollectiveMismatchError(RuntimeError):
    """Ranks entered different collectives at the same point. Raised on every rank.
    ``sites``: one ``(sequence number, kind, tag)`` per rank."""

    def __init__(self, sites: list[tuple[int, str, str]]) -> None:
        self.sites = sites
        lines = "; ".join(
            f"rank {r}: #{seq} {kind}({tag!r})" for r, (seq, kind, tag) in enumerate(sites)
        )
        super().__init__(f"ranks entered different collectives: {lines}")


def _site_hash(kind: str, tag: str, extra: str = "") -> int:
    return digest(f"{kind}\x00{tag}\x00{extra}")


def _check_int(name: str, value: Any) -> int:
    """``value`` as an int (ints and integer scalars; not bools), within +-2**62."""
    if isinstance(value, bool):
        raise ValueError(f"{name} must be an int, got bool")
    try:
        v = operator.index(value)
    except TypeError:
        raise ValueError(f"{name} must be an int, got {type(value).__name__}") from None
    if not -_LIMIT <= v <= _LIMIT:
        raise ValueError(f"{name}={v} is outside +-2**62")
    return v


class TPGroup:
    """The agreement primitives. ``tag`` names the call site (checked across ranks); every
    method blocks until every rank entered. Here, for one rank, each returns its own input."""

    rank: int = 0
    size: int = 1

    def agree_min(self, value: int, tag: str = "agree_min") -> int:
        return _check_int("value", value)

    def agree_max(self, value: int, tag: str = "agree_max") -> int:
        return _check_int("value", value)

    def agree_all(self, flag: bool, tag: str = "agree_all") -> bool:
        """``True`` when ``flag`` is true on every rank."""
        return bool(flag)

    def agree_any(self, flag: bool, tag: str = "agree_any") -> bool:
        """``True`` when ``flag`` is true on at least one rank."""
        return bool(flag)

    def agree_min_many(self, values: Sequence[int], tag: str = "agree_min_many") -> list[int]:
        """Element-wise minimum over ranks; up to two values cost one collective."""
        return [_check_int(f"values[{i}]", v) for i, v in enumerate(values)]

    def broadcast_object(self, obj: Any, src: int = 0, tag: str = "broadcast") -> Any:
        """Rank ``src``'s ``obj`` (picklable) on every rank; other ranks' ``obj`` is ignored."""
        if src != 0:
            raise ValueError(f"src must be 0 in a single-rank group, got {src}")
        return obj

    def all_gather_object(self, obj: Any, tag: str = "all_gather") -> list[Any]:
        """Every rank's ``obj`` (picklable), in rank order, on every rank."""
        return [obj]

    def assert_same(self, tag: str, value: Any) -> None:
        """``RankDivergenceError`` on every rank unless ``digest(value)`` is the same on all."""

    def barrier(self, tag: str = "barrier") -> None:
        return None

    @property
    def is_first_rank(self) -> bool:
        return self.rank == 0


class SingleRankGroup(TPGroup):
    """``tp_size == 1``: every primitive returns its own input; nothing is communicated."""


class DistTPGroup(TPGroup):
    """The primitives over a gloo process group (``None``: the default group)."""

    def __init__(self, group: Any = None) -> None:
        import torch.distributed as dist

        if not dist.is_initialized():
            raise ValueError("group: torch.distributed is not initialized")
        self._dist = dist
        self.group = group
        self.rank = dist.get_rank(group)
        self.size = dist.get_world_size(group)
        self.seq = 0  # collectives entered through this object
        self._thread: int | None = None

    def agree_min(self, value: int, tag: str = "agree_min") -> int:
        v = _check_int("value", value)
        return self._header("agree_min", tag, v, 0)[0]

    def agree_max(self, value: int, tag: str = "agree_max") -> int:
        v = _check_int("value", value)
        return -self._header("agree_max", tag, -v, 0)[0]

    def agree_all(self, flag: bool, tag: str = "agree_all") -> bool:
        return self._header("agree_all", tag, int(bool(flag)), 0)[0] == 1

    def agree_any(self, flag: bool, tag: str = "agree_any") -> bool:
        return self._header("agree_any", tag, -int(bool(flag)), 0)[0] == -1

    def agree_min_many(self, values: Sequence[int], tag: str = "agree_min_many") -> list[int]:
        vals = [_check_int(f"values[{i}]", v) for i, v in enumerate(values)]
        # The count is part of the call site: ranks passing different counts get
        # CollectiveMismatchError. The first two values ride in the header.
        head = (vals + [0, 0])[:2]
        a, b = self._header(f"agree_min_many[{len(vals)}]", tag, head[0], head[1])
        out = [a, b][: len(vals)]
        if len(vals) > 2:
            t = torch.tensor(vals[2:], dtype=torch.int64)
            self._dist.all_reduce(t, op=self._dist.ReduceOp.MIN, group=self.group)
            out += [int(x) for x in t.tolist()]
        return out

    def broadcast_object(self, obj: Any, src: int = 0, tag: str = "broadcast") -> Any:
        if not 0 <= src < self.size:
            raise ValueError(f"src must be in [0, {self.size}), got {src}")
        payload, error = b"", None
        if self.rank == src:
            try:
                payload = pickle.dumps(obj)
            except Exception as exc:  # still enter the header, so that every rank raises
                error = exc
        neg_size, failed = self._header(
            "broadcast_object", tag, -len(payload), -int(error is not None), extra=str(src)
        )
        if failed:
            raise ValueError(f"obj: rank {src} could not pickle it at {tag!r}") from error
        size = -neg_size
        buf = (
            torch.frombuffer(bytearray(payload), dtype=torch.uint8)
            if self.rank == src
            else torch.empty(size, dtype=torch.uint8)
        )
        self._dist.broadcast(buf, src=self._global_rank(src), group=self.group)
        return obj if self.rank == src else pickle.loads(buf.numpy().tobytes())

    def all_gather_object(self, obj: Any, tag: str = "all_gather") -> list[Any]:
        self._header("all_gather_object", tag, 0, 0)
        out: list[Any] = [None] * self.size
        self._dist.all_gather_object(out, obj, group=self.group)
        return out

    def assert_same(self, tag: str, value: Any) -> None:
        d = digest(value)
        lo, neg_hi = self._header("assert_same", tag, d, -d)
        if lo != -neg_hi:
            raise RankDivergenceError(tag, self._gather_ints(d))

    def barrier(self, tag: str = "barrier") -> None:
        self._header("barrier", tag, 0, 0)

    def _header(self, kind: str, tag: str, a: int, b: int, extra: str = "") -> tuple[int, int]:
        """The opening all_reduce; checks the call site, returns the reduced ``(a, b)``."""
        self._check_thread()
        self.seq += 1
        h = _site_hash(kind, tag, extra)
        t = torch.tensor([h, -h, a, b], dtype=torch.int64)
        try:
            self._dist.all_reduce(t, op=self._dist.ReduceOp.MIN, group=self.group)
        except RuntimeError as exc:  # gloo timeout, or a peer that exited
            raise RuntimeError(
                f"cache group rank {self.rank}: collective #{self.seq} {kind}({tag!r}) failed: "
                f"{exc}"
            ) from exc
        lo, neg_hi, ra, rb = (int(x) for x in t.tolist())
        if lo != -neg_hi:
            sites: list[Any] = [None] * self.size
            self._dist.all_gather_object(sites, (self.seq, kind, tag), group=self.group)
            raise CollectiveMismatchError([tuple(s) for s in sites])
        return ra, rb

    def _gather_ints(self, value: int) -> list[int]:
        out = [torch.zeros(1, dtype=torch.int64) for _ in range(self.size)]
        self._dist.all_gather(out, torch.tensor([value], dtype=torch.int64), group=self.group)
        return [int(x) for x in out]

    def _global_rank(self, group_rank: int) -> int:
        if self.group is None:
            return group_rank
        return self._dist.get_global_rank(self.group, group_rank)

    def _check_thread(self) -> None:
        me = threading.get_ident()
        if self._thread is None:
            self._thread = me
        elif self._thread != me:
            raise RuntimeError(
                "TPGroup collectives must be called from one thread (the scheduler's); "
                "another thread would interleave with the other ranks' order"
            )


def new_cache_group(timeout_s: float | None = None) -> TPGroup:
    """A new gloo group over every rank of the default group, or ``SingleRankGroup`` for one
    rank. A collective blocked ``timeout_s`` (``None``: :func:`tp_timeout_s`) raises."""
    import torch.distributed as dist

    if not dist.is_available() or not dist.is_initialized() or dist.get_world_size() == 1:
        return SingleRankGroup()
    if timeout_s is None:
        timeout_s = tp_timeout_s()
    if timeout_s <= 0:
        raise ValueError(f"timeout_s must be > 0, got {timeout_s}")
    kw: dict[str, Any] = {"backend": "gloo", "timeout": datetime.timedelta(seconds=timeout_s)}
    group = dist.new_group(**kw)
    logger.info("cache group: %d ranks (gloo), rank %d", dist.get_world_size(), dist.get_rank())
    return DistTPGroup(group)
