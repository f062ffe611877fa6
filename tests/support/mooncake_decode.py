"""Decode worker processes for tests and benchmarks, and the router that hands each request to
one of them: the ``decode`` object of an executor built with
``--disaggregation-transfer-backend mooncake`` (``harness.make_executor``).

``DecodeWorker``: one ``python -m hicache_prefill.prefill.disagg.mooncake.decode_worker``
process, started under
the loopback shim (``tests.support.loopback.preload_env``) with
``PR_SET_PDEATHSIG`` (it dies with its parent), its pid recorded, commanded over its
stdin/stdout, and stopped by that pid (``stop``, also after a kill or freeze). Test hooks:
``kill()`` (SIGKILL), ``freeze()`` / ``resume()`` (SIGSTOP / SIGCONT).

``MooncakeDecode``: a ``DecodeBackend`` over a ``MooncakeBackend`` (the prefill side) and a list
of workers. ``create_peer`` creates the link (its room), then sends the request with its room and
the prefill's bootstrap address to a worker (round robin over the workers not killed, or
``route(rid)``), as SGLang's router does. What tests used on the simulation works the same:
``received_kv(rid)`` (``(decode_prefix_len, k, v)`` read from the worker), ``release(rid)``,
``peers`` (the links, which keep the prompt); plus ``worker_pids``, ``stats()``,
``set_transfer_hook(hook)`` (called on the prefill's transfer thread before each engine call:
kill or freeze a worker "before chunk k" or "before the metadata row"), ``hold`` (a request
held in ``Bootstrapping`` on its worker until ``unhold``: kill or freeze "while bootstrapping"),
and ``close()``.
"""

from __future__ import annotations

import itertools
import logging
import os
import queue
import signal
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Sequence
from multiprocessing.connection import Connection
from pathlib import Path
from typing import Any

import numpy as np
import torch

from hicache_prefill.prefill.disagg.mooncake.decode_worker import recv_message, send_message
from hicache_prefill.prefill.disagg.mooncake.layout import KVGeometry
from hicache_prefill.prefill.disagg.mooncake.link import MooncakeBackend, MooncakeLink
from hicache_prefill.prefill.disagg.mooncake.session_worker import TransferHook
from tests.support.loopback import die_with_parent, preload_env

logger = logging.getLogger(__name__)

_REPO = Path(__file__).resolve().parents[2]
_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16,
           "uint8": torch.uint8, "float8_e4m3fn": torch.float8_e4m3fn}  # fmt: skip


class DecodeWorkerError(RuntimeError):
    """A decode worker did not answer, answered an error, or is gone."""


class DecodeWorker:
    """One decode worker process (module docstring). ``start`` returns at once;
    ``wait_ready`` blocks until the worker answered its first message.

    Args:
        geometry: the KV geometry of the worker's pool (its model's; ``--kv-geometry``).
        pool_tokens: the worker's KV pool (``--max-total-tokens``).
        max_running_requests: the worker's metadata rows are twice this.
        check_free_pages: run the late-write detector.
        env: extra environment variables (SGLang's and Mooncake's timeouts).
        log_dir: where its stderr goes (``decode-<pid>.log``); a temporary folder by default.
    """

    def __init__(
        self,
        geometry: KVGeometry,
        pool_tokens: int = 4096,
        max_running_requests: int = 64,
        check_free_pages: bool = True,
        env: dict[str, str] | None = None,
        log_dir: str | None = None,
        host: str = "127.0.0.1",
    ) -> None:
        cmd = [
            *(sys.executable, "-m", "hicache_prefill.prefill.disagg.mooncake.decode_worker"),
            *("--host", host, "--max-total-tokens", str(pool_tokens)),
            *("--max-running-requests", str(max_running_requests)),
            *("--kv-geometry", geometry.to_json()),
        ]
        if check_free_pages:
            cmd.append("--check-free-pages")
        full_env = preload_env({**os.environ, **(env or {})})
        full_env["PYTHONPATH"] = os.pathsep.join(
            [str(_REPO), *filter(None, [full_env.get("PYTHONPATH")])]
        )
        self.log_dir = Path(log_dir or tempfile.mkdtemp(prefix="decode-worker-"))
        self.log_dir.mkdir(parents=True, exist_ok=True)
        self._log = tempfile.NamedTemporaryFile(dir=self.log_dir, prefix="decode-", suffix=".log",
                                                delete=False)  # fmt: skip
        self.proc = subprocess.Popen(
            cmd, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=self._log, cwd=_REPO,
            env=full_env, preexec_fn=die_with_parent,
        )  # fmt: skip
        self.pid = self.proc.pid
        self.geometry = geometry
        assert self.proc.stdin is not None and self.proc.stdout is not None
        self._out = Connection(os.dup(self.proc.stdin.fileno()), readable=False)
        self._in = Connection(os.dup(self.proc.stdout.fileno()), writable=False)
        self.log_path = Path(self._log.name)
        self.info: dict[str, Any] = {}
        self.frozen = False
        self.killed = False
        self._seq = itertools.count(1)
        self._lock = threading.Lock()
        self._replies: queue.Queue[tuple[dict[str, Any], list[bytes]] | None] = queue.Queue()
        self._reader = threading.Thread(target=self._read, name=f"decode-{self.pid}", daemon=True)
        self._reader.start()

    def _read(self) -> None:
        while True:
            try:
                message = recv_message(self._in)
            except (EOFError, OSError, ValueError):
                self._replies.put(None)
                return
            self._replies.put(message)

    def wait_ready(self, timeout_s: float = 180.0) -> DecodeWorker:
        """Block until the worker is up; ``DecodeWorkerError`` (with its log's tail) if it
        exits or refuses to start."""
        try:
            message = self._replies.get(timeout=timeout_s)
        except queue.Empty:
            raise DecodeWorkerError(f"decode worker {self.pid} not ready after {timeout_s}s"
                                    f"{self.log_tail()}") from None  # fmt: skip
        if message is None:
            raise DecodeWorkerError(f"decode worker {self.pid} exited{self.log_tail()}")
        self.info = message[0]
        if not self.info.get("ready"):
            raise DecodeWorkerError(f"decode worker {self.pid}: {self.info.get('error')}")
        return self

    def log_tail(self, lines: int = 20) -> str:
        try:
            text = self.log_path.read_text(errors="replace").splitlines()[-lines:]
        except OSError:
            return ""
        return "\n  log: " + "\n  log: ".join(text) if text else ""

    @property
    def alive(self) -> bool:
        return self.proc.poll() is None

    def send(self, op: str, **kw: Any) -> int:
        """Write a command without waiting for its answer (a frozen worker never blocks the
        caller); returns its sequence number."""
        seq = next(self._seq)
        try:
            send_message(self._out, {"op": op, "seq": seq, **kw})
        except (OSError, ValueError) as e:
            raise DecodeWorkerError(f"decode worker {self.pid} is gone ({e})") from None
        return seq

    def call(
        self, op: str, timeout_s: float = 30.0, **kw: Any
    ) -> tuple[dict[str, Any], list[bytes]]:
        """Run a command and wait for its answer: ``(header, payload frames)``. Raises
        ``DecodeWorkerError`` for an error answer, a timeout or a dead worker."""
        with self._lock:
            seq = self.send(op, **kw)
            deadline = time.monotonic() + timeout_s
            while True:
                left = deadline - time.monotonic()
                try:
                    message = self._replies.get(timeout=max(left, 0.001))
                except queue.Empty:
                    raise DecodeWorkerError(f"decode worker {self.pid}: no answer to {op} "
                                            f"within {timeout_s}s") from None  # fmt: skip
                if message is None:
                    self._replies.put(None)
                    raise DecodeWorkerError(f"decode worker {self.pid} exited{self.log_tail()}")
                head, payload = message
                if head.get("seq") != seq:
                    if head.get("error"):
                        logger.warning("decode worker %d: %s", self.pid, head["error"])
                    continue  # the answer to an earlier, unwaited command
                if "error" in head:
                    raise DecodeWorkerError(f"decode worker {self.pid}: {op}: {head['error']}")
                return head, payload

    # ------------------------------------------------------------------ test hooks
    def kill(self) -> None:
        """SIGKILL by pid (also while frozen)."""
        if self.alive:
            os.kill(self.pid, signal.SIGKILL)
            self.proc.wait(timeout=30)
        self.killed = True

    def freeze(self, timeout_s: float = 10.0) -> None:
        """SIGSTOP by pid, returning once every thread of the worker is stopped (a signal is
        delivered asynchronously: without the wait a call could still complete)."""
        os.kill(self.pid, signal.SIGSTOP)
        self.frozen = True
        deadline = time.monotonic() + timeout_s
        while not self._all_stopped():
            if time.monotonic() > deadline:
                raise DecodeWorkerError(f"decode worker {self.pid} did not stop")
            time.sleep(0.001)

    def _all_stopped(self) -> bool:
        try:
            tasks = os.listdir(f"/proc/{self.pid}/task")
            stats = [Path(f"/proc/{self.pid}/task/{t}/stat").read_text() for t in tasks]
            states = [st.rsplit(")", 1)[1].split()[0] for st in stats]
        except (OSError, IndexError):
            return not self.alive
        return all(st in ("T", "t") for st in states)

    def resume(self) -> None:
        os.kill(self.pid, signal.SIGCONT)
        self.frozen = False

    def stop(self, timeout_s: float = 10.0) -> int | None:
        """Stop the process by its pid: resume it, ``quit``, then SIGTERM and SIGKILL."""
        if self.alive:
            try:
                os.kill(self.pid, signal.SIGCONT)
                self.call("quit", timeout_s=min(timeout_s, 5.0))
                self.proc.wait(timeout=timeout_s)
            except (DecodeWorkerError, subprocess.TimeoutExpired, ProcessLookupError):
                if self.alive:
                    os.kill(self.pid, signal.SIGKILL)
                self.proc.wait(timeout=timeout_s)
        for c in (self._out, self._in):
            c.close()
        for f in (self.proc.stdin, self.proc.stdout):
            if f is not None:
                f.close()
        self._log.close()
        return self.proc.returncode


def start_workers(n: int, **kw: Any) -> list[DecodeWorker]:
    """``n`` workers started at once (their start-ups overlap), each ready."""
    workers = [DecodeWorker(**kw) for _ in range(n)]
    try:
        return [w.wait_ready() for w in workers]
    except DecodeWorkerError:
        for w in workers:
            w.stop()
        raise


class PrefillBackendFront:
    """What a router in front of the prefill side's ``MooncakeBackend`` (``backend``) passes
    through of the executor's ``DecodeBackend``: the clock, peers, send log and next event."""

    backend: MooncakeBackend

    @property
    def clock(self) -> Any:
        return self.backend.clock

    @property
    def force_not_ready_prob(self) -> float:
        return self.backend.force_not_ready_prob

    @property
    def peers(self) -> dict[str, MooncakeLink]:
        return self.backend.peers

    @property
    def send_log(self) -> Any:
        return self.backend.send_log

    def next_event_time(self) -> float | None:
        return self.backend.next_event_time()


class MooncakeDecode(PrefillBackendFront):
    """The decode side of an executor on the Mooncake backend (module docstring).

    Args:
        backend: the prefill side (``MooncakeBackend``), owned: closed by ``close``.
        workers: the decode workers; the ones in ``owned`` are stopped by ``close``.
        keep_received: workers keep a successful request's pages until ``release(rid)``.
        decode_prefix_len: tokens each decode worker claims to hold already (page-aligned, capped
            to leave one token to send), as the simulation's ``PeerConfig.decode_prefix_len``.
        delay_s: seconds a worker waits before preallocating request ``rid`` (a busy decode).
    """

    def __init__(
        self,
        backend: MooncakeBackend,
        workers: Sequence[DecodeWorker],
        keep_received: bool = True,
        decode_prefix_len: int = 0,
        owned: Sequence[DecodeWorker] | None = None,
        delay_s: Callable[[str], float] | None = None,
    ) -> None:
        self.backend = backend
        self.workers = list(workers)
        self.owned = list(workers if owned is None else owned)
        self.keep_received = keep_received
        self.decode_prefix_len = decode_prefix_len
        self.route: Callable[[str], DecodeWorker] | None = None
        self.hold: Callable[[str], bool] = lambda rid: False
        self.delay_s: Callable[[str], float] = delay_s or (lambda rid: 0.0)
        self.worker_of: dict[str, DecodeWorker] = {}
        self.first_tokens: dict[str, int | None] = {}
        self._next = 0

    # ------------------------------------------------------------------ DecodeBackend
    def create_peer(
        self, rid: str, num_tokens: int, token_ids: Sequence[int] | None = None
    ) -> MooncakeLink:
        link = self.backend.create_peer(rid, num_tokens, token_ids)
        worker = self._pick(rid)
        self.worker_of[rid] = worker
        try:
            worker.send("add", rid=rid, room=link.room, bootstrap_addr=self.backend.bootstrap_addr,
                        num_tokens=num_tokens, decode_prefix_len=self.decode_prefix_len,
                        keep=self.keep_received, hold=bool(self.hold(rid)),
                        delay_s=float(self.delay_s(rid)))  # fmt: skip
        except DecodeWorkerError as e:
            link.fail(f"the router could not reach decode worker {worker.pid}: {e}")
        return link

    def release(self, rid: str) -> None:
        worker = self.worker_of.pop(rid, None)
        if worker is not None and worker.alive and not worker.killed:
            try:
                worker.send("release", rid=rid)
            except DecodeWorkerError:
                pass
        self.first_tokens.pop(rid, None)
        self.backend.release(rid)

    # ------------------------------------------------------------------ what tests read
    def _pick(self, rid: str) -> DecodeWorker:
        if self.route is not None:
            return self.route(rid)
        live = [w for w in self.workers if not w.killed and w.alive]
        if not live:
            raise DecodeWorkerError("no live decode worker")
        worker = live[self._next % len(live)]
        self._next += 1
        return worker

    def pages_kv(self, rid: str) -> tuple[Any, ...]:
        """``(decode_prefix_len, *kv)`` of whatever ``rid``'s decode pages hold now, in any state
        (a failed request's held pages: the late bytes of a call that reported failure)."""
        head, payload = self.worker_of[rid].call("received_kv", rid=rid, any_state=True)
        return (head["decode_prefix_len"], *_tensors(head, payload))

    def received_kv(self, rid: str) -> tuple[Any, ...]:
        """``(decode_prefix_len, *kv)``: what rid's worker holds for the tokens prefill sent,
        one ``[L, n - decode_prefix_len, ...]`` tensor per pool buffer (MHA ``k, v``). Also
        records the first token its metadata row carried (``first_tokens[rid]``). Waits (up to
        30 s) while the worker has not seen the STATUS that follows the prefill side's
        Success."""
        worker = self.worker_of.get(rid)
        if worker is None:
            raise ValueError(f"rid {rid!r} has no received KV (released or unknown)")
        try:  # the prefill side's Success comes first; decode commits at its STATUS
            wait_for(lambda: worker.call("state", rid=rid)[0]["state"] != "WaitingForInput", 30)
            head, payload = worker.call("received_kv", rid=rid)
        except DecodeWorkerError as e:
            raise ValueError(f"rid {rid!r} has no received KV ({e})") from None
        self.first_tokens[rid] = head["first_token"]
        return (head["decode_prefix_len"], *_tensors(head, payload))

    def state(self, rid: str) -> dict[str, Any]:
        """The worker's view of ``rid`` (``state``, ``failure``, ``held``, ``first_token``)."""
        worker = self.worker_of.get(rid)
        if worker is None:
            raise ValueError(f"rid {rid!r} was released or never routed")
        return worker.call("state", rid=rid)[0]

    def unhold(self, rid: str) -> None:
        self.worker_of[rid].send("unhold", rid=rid)

    @property
    def worker_pids(self) -> list[int]:
        return [w.pid for w in self.workers if w.alive]

    def stats(self) -> list[dict[str, Any]]:
        """Every live, unfrozen worker's counters (``free_tokens``, ``held``, ``late_writes``,
        ...)."""
        return [w.call("stats")[0] for w in self.workers if w.alive and not w.frozen]

    def add_worker(self, worker: DecodeWorker, owned: bool = True) -> None:
        self.workers.append(worker)
        if owned:
            self.owned.append(worker)

    def set_transfer_hook(self, hook: TransferHook | None) -> None:
        self.backend.set_hook(hook)

    def close(self) -> None:
        """Stop the owned workers (by pid) and the prefill side's transport."""
        for w in self.owned:
            w.stop()
        stuck = self.backend.close()
        if stuck:
            logger.warning("transfer workers still blocked in a call: %s", stuck)


def _tensors(head: dict[str, Any], payload: list[bytes]) -> list[torch.Tensor]:
    out = []
    for spec, raw in zip(head["tensors"], payload, strict=True):
        arr = np.frombuffer(raw, dtype=np.uint8).copy()
        out.append(torch.from_numpy(arr).view(_DTYPES[spec["dtype"]]).view(spec["shape"]))
    return out


def wait_for(pred: Callable[[], bool], timeout_s: float, step_s: float = 0.01) -> bool:
    """Poll ``pred`` until it holds or ``timeout_s`` passed; returns its last value."""
    deadline = time.monotonic() + timeout_s
    while True:
        if pred():
            return True
        if time.monotonic() >= deadline:
            return False
        time.sleep(step_s)
