"""Run one function on N tensor-parallel ranks in real processes on this machine (the CPU runs of
the tests and of ``bench_multiturn --tp``), with a watchdog that turns a hang into a failure
that shows every rank's stack. On GPUs, launch with ``torchrun`` instead (one process per GPU).

``run_ranks(fn, world_size, *args)`` spawns ``world_size`` processes (torch.multiprocessing,
``spawn``), initializes a gloo default group on a free localhost port in each, calls
``fn(rank, world_size, *args)`` and returns the ``world_size`` results in rank order. ``fn`` must
be importable (a module-level function) and its result picklable.

- A rank that raises: the others get ``RuntimeError`` from their next collective with it (gloo
  sees the closed connection, or the collective's timeout passes: ``collective_timeout_s``,
  120 s by default) or finish; ``RanksFailed`` lists every rank's outcome.
- A rank that has not finished ``timeout_s`` after every rank joined the group (a hang: ranks
  in different collectives, or one waiting for a collective another skipped): every live rank
  dumps all its threads' Python stacks (``faulthandler`` on ``SIGUSR1``, to a per-rank file),
  the ranks are killed, and ``RanksHung`` carries the stacks in its message. The limit catches
  hangs only; nothing here measures or asserts time.
"""

from __future__ import annotations

import datetime
import faulthandler
import logging
import os
import pickle
import queue
import signal
import tempfile
import time
import traceback
from collections.abc import Callable
from typing import Any

import torch
import torch.multiprocessing as mp

from hicache_prefill.hicache.tp.group import tp_timeout_s
from tests.support.loopback import free_port

__all__ = ["DEFAULT_TIMEOUT_S", "RanksFailed", "RanksHung", "run_ranks"]

logger = logging.getLogger(__name__)

DEFAULT_TIMEOUT_S = 120.0
"""Generous: a 4-rank run of the tiny model takes seconds; only a hang gets near it."""

_STARTUP_LIMIT_S = 120.0  # spawning and importing torch, before the watchdog's limit starts
_ERROR_GRACE_S = 20.0  # after one rank failed, how long the others get to finish or fail
_STACK_WAIT_S = 5.0  # how long the parent waits for the dumped stacks after the signal


class RanksFailed(AssertionError):
    """A rank raised. ``outcomes``: rank -> its traceback text or ``"ok"``."""

    def __init__(self, outcomes: dict[int, str]) -> None:
        self.outcomes = outcomes
        body = "\n".join(f"--- rank {r}:\n{o}" for r, o in sorted(outcomes.items()))
        super().__init__(
            f"ranks failed: {sorted(r for r, o in outcomes.items() if o != 'ok')}\n{body}"
        )


class RanksHung(AssertionError):
    """Some ranks did not finish within the watchdog's limit. ``hung``: their ranks;
    ``stacks``: rank -> the Python stacks it dumped (every live rank); ``outcomes``: ranks that
    did finish -> ``"ok"`` or their traceback."""

    def __init__(
        self, timeout_s: float, hung: list[int], stacks: dict[int, str], outcomes: dict[int, str]
    ) -> None:
        self.hung = hung
        self.stacks = stacks
        self.outcomes = outcomes
        parts = [f"ranks {hung} did not finish within {timeout_s:g} s (watchdog)"]
        for r, o in sorted(outcomes.items()):
            parts.append(f"--- rank {r} finished: {o}")
        for r, s in sorted(stacks.items()):
            parts.append(f"--- rank {r} stacks:\n{s or '(no stack dumped)'}")
        super().__init__("\n".join(parts))


def _rank_entry(
    rank: int,
    world_size: int,
    init_method: str,
    fn: Callable[..., Any],
    args: tuple[Any, ...],
    results: Any,
    stack_path: str,
    collective_timeout_s: float,
) -> None:
    """One rank: stack dump on SIGUSR1, gloo default group, ``fn``, result to the parent."""
    import torch.distributed as dist

    stack_file = open(stack_path, "w")  # noqa: SIM115 (kept open for the signal handler)
    faulthandler.register(signal.SIGUSR1, file=stack_file, all_threads=True)
    torch.set_num_threads(1)
    try:
        dist.init_process_group(
            "gloo",
            init_method=init_method,
            rank=rank,
            world_size=world_size,
            # a collective another rank never enters raises here instead of waiting 30 minutes
            timeout=datetime.timedelta(seconds=collective_timeout_s),
        )
        results.put((rank, "started", None))
        out = ("ok", pickle.dumps(fn(rank, world_size, *args)))
    except BaseException:
        out = ("error", traceback.format_exc())
    results.put((rank, *out))
    if dist.is_initialized():
        dist.destroy_process_group()


def run_ranks(
    fn: Callable[..., Any],
    world_size: int,
    *args: Any,
    timeout_s: float = DEFAULT_TIMEOUT_S,
    collective_timeout_s: float | None = None,
) -> list[Any]:
    """``[fn(0, world_size, *args), ..., fn(world_size - 1, world_size, *args)]``, each run in
    its own spawned process on one gloo group. Raises ``RanksFailed`` when a rank raised,
    ``RanksHung`` (with every live rank's stacks) when one has not finished ``timeout_s`` after
    all joined the group. ``collective_timeout_s``: how long a collective of the default group
    may block before it raises in that rank (``None``: ``hicache.tp.group.tp_timeout_s()``,
    ``SGLANG_HICACHE_TP_TIMEOUT`` or 120 s). Every process started here is gone when this
    returns or raises."""
    if collective_timeout_s is None:
        collective_timeout_s = tp_timeout_s()
    if collective_timeout_s <= 0:
        raise ValueError(f"collective_timeout_s must be > 0, got {collective_timeout_s}")
    if world_size < 1:
        raise ValueError(f"world_size must be >= 1, got {world_size}")
    if timeout_s <= 0:
        raise ValueError(f"timeout_s must be > 0, got {timeout_s}")
    ctx = mp.get_context("spawn")
    results = ctx.Queue()
    init_method = f"tcp://127.0.0.1:{free_port()}"
    with tempfile.TemporaryDirectory(prefix="tp_ranks_") as tmp:
        paths = [os.path.join(tmp, f"rank{r}.stack") for r in range(world_size)]
        procs = [
            ctx.Process(
                target=_rank_entry,
                args=(
                    r,
                    world_size,
                    init_method,
                    fn,
                    args,
                    results,
                    paths[r],
                    collective_timeout_s,
                ),  # fmt: skip
                daemon=True,
            )
            for r in range(world_size)
        ]
        hung: list[int] = []
        try:
            for p in procs:
                p.start()
            outcomes = _collect(procs, results, timeout_s)
            hung = [r for r in range(world_size) if r not in outcomes]
            if hung:
                stacks = _dump_stacks(procs, paths)
                raise RanksHung(timeout_s, hung, stacks, {r: _text(o) for r, o in outcomes.items()})
        finally:  # ranks that reported exit by themselves; hung or stray ones are killed
            deadline = time.monotonic() + (0 if hung else 10)
            for p in procs:
                p.join(timeout=max(0.0, deadline - time.monotonic()))
            for p in procs:
                if p.is_alive():
                    p.kill()
                    p.join(timeout=10)
            results.close()
    if any(status != "ok" for status, _ in outcomes.values()):
        raise RanksFailed({r: _text(o) for r, o in outcomes.items()})
    return [pickle.loads(outcomes[r][1]) for r in range(world_size)]


def _text(outcome: tuple[str, Any]) -> str:
    return "ok" if outcome[0] == "ok" else str(outcome[1])


def _collect(procs: list[Any], results: Any, timeout_s: float) -> dict[int, tuple[str, Any]]:
    """Outcomes reported in time: ``timeout_s`` from the moment every rank has joined the group
    (startup, slow on a loaded machine, gets ``_STARTUP_LIMIT_S`` on top), moved closer once a
    rank failed. A process that died without reporting counts as an error (its exit code)."""
    outcomes: dict[int, tuple[str, Any]] = {}
    started: set[int] = set()
    deadline = time.monotonic() + _STARTUP_LIMIT_S + timeout_s
    while len(outcomes) < len(procs):
        left = deadline - time.monotonic()
        if left <= 0:
            break
        try:
            rank, status, payload = results.get(timeout=min(left, 0.5))
            if status == "started":
                started.add(rank)
                if len(started) == len(procs):
                    deadline = time.monotonic() + timeout_s
            else:
                outcomes[rank] = (status, payload)
        except queue.Empty:
            for r, p in enumerate(procs):
                if r not in outcomes and not p.is_alive() and p.exitcode not in (None, 0):
                    outcomes[r] = ("error", f"process exited with code {p.exitcode}")
        if any(status != "ok" for status, _ in outcomes.values()):
            # The others fail at their next collective with the dead rank, or finish; one
            # blocked before any (e.g. in init) is a hang after this grace.
            deadline = min(deadline, time.monotonic() + _ERROR_GRACE_S)
    return outcomes


def _dump_stacks(procs: list[Any], paths: list[str]) -> dict[int, str]:
    """Signal every live rank to dump its stacks, wait for the files, read them."""
    live = [r for r, p in enumerate(procs) if p.is_alive()]
    for r in live:
        try:
            os.kill(procs[r].pid, signal.SIGUSR1)
        except ProcessLookupError:
            pass
    deadline = time.monotonic() + _STACK_WAIT_S
    while time.monotonic() < deadline and not all(os.path.getsize(paths[r]) for r in live):
        time.sleep(0.05)
    time.sleep(0.1)  # let a dump in progress complete
    stacks = {}
    for r in live:
        with open(paths[r]) as f:
            stacks[r] = f.read()
    return stacks
