"""``StoreNode``: a prefill server in its own processes (one per TP rank), for the tests and
benchmarks in which several instances share one L3 store.

``StoreNode(world)`` opens a control listener on loopback, starts ``world`` processes of
``python -m tests.support.node_commands`` (``module``: another entry, ``node_stores`` for bare
stores only or the benchmark's) under the loopback shim
(``tests.support.loopback.preload_env``: every Mooncake client binds loopback only)
with ``PR_SET_PDEATHSIG``, records their pids, and waits until each has connected.
``command(cmd, **fields)`` sends one command to every rank and
returns their results in rank order (``NodeError`` with every rank's message when one failed,
or when a rank does not answer within ``timeout_s``: then the node is killed). ``stop()`` asks
the ranks to close their executors and exit, and kills by pid whatever is left after
``stop_timeout_s``; ``kill()`` is SIGKILL by pid at once (a test's crash). Each rank's stderr goes
to a log file whose tail is in every ``NodeError``.
"""

from __future__ import annotations

import json
import logging
import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from tests.support.loopback import preload_env
from tests.support.mooncake_master import free_port

logger = logging.getLogger(__name__)

_REPO = Path(__file__).resolve().parents[2]
STARTUP_TIMEOUT_S = 300.0
"""Generous: importing torch and the model takes seconds on a loaded 2-core machine."""


class NodeError(RuntimeError):
    """A rank failed a command, did not answer, or is gone."""


class StoreNode:
    """A node of ``world`` rank processes (module docstring).

    Args:
        world: TP ranks (processes).
        env: extra environment variables for the ranks (Mooncake's ``MC_*`` timeouts, ...).
        module: the entry module (``tests.support.node_commands``, ``...node_stores``, or
            one with more commands).
        name: for logs.
        connect: wait here until every rank connected; ``False``: the caller calls
            ``connect()`` (several nodes then start in parallel).
    """

    def __init__(
        self,
        world: int = 1,
        env: dict[str, str] | None = None,
        module: str = "tests.support.node_commands",
        name: str = "node",
        connect: bool = True,
    ) -> None:
        self.world = world
        self.name = name
        self.procs: list[subprocess.Popen] = []
        self.logs: list[str] = []
        self._streams: dict[int, Any] = {}
        self._socks: list[socket.socket] = []
        self._listener = listener = socket.socket()
        listener.bind(("127.0.0.1", 0))
        listener.listen(world)
        control = f"127.0.0.1:{listener.getsockname()[1]}"
        init = f"tcp://127.0.0.1:{free_port()}"
        child_env = preload_env({**os.environ, **(env or {})})
        try:
            for rank in range(world):
                fd, log = tempfile.mkstemp(prefix=f"{name}_rank{rank}_", suffix=".log")
                os.close(fd)
                self.logs.append(log)
                cmd = [sys.executable, "-m", module, "--control", control, "--rank", str(rank),
                       "--world", str(world), "--init", init]  # fmt: skip
                with open(log, "ab") as err:
                    self.procs.append(subprocess.Popen(
                        cmd, cwd=_REPO, env=child_env, stdin=subprocess.DEVNULL,
                        stdout=err, stderr=err,
                    ))  # fmt: skip
        except BaseException:
            self.kill()
            raise
        if connect:
            self.connect()

    def connect(self) -> None:
        """Wait until every rank has connected (``NodeError`` when one exits first or after
        ``STARTUP_TIMEOUT_S``; the node is killed then). Idempotent."""
        if len(self._streams) == self.world:
            return
        try:
            self._accept(self._listener)
        except BaseException:
            self.kill()
            raise
        finally:
            self._listener.close()
        logger.info("%s: ranks %s", self.name, self.pids)

    @property
    def pids(self) -> list[int]:
        return [p.pid for p in self.procs]

    def _accept(self, listener: socket.socket) -> None:
        deadline = time.monotonic() + STARTUP_TIMEOUT_S
        while len(self._streams) < self.world:
            dead = [p.pid for p in self.procs if p.poll() is not None]
            if dead:
                raise NodeError(f"{self.name}: ranks {dead} exited at startup: {self.log_tail()}")
            listener.settimeout(max(0.1, min(1.0, deadline - time.monotonic())))
            try:
                sock, _ = listener.accept()
            except TimeoutError:
                if time.monotonic() > deadline:
                    raise NodeError(
                        f"{self.name}: ranks did not connect: {self.log_tail()}"
                    ) from None
                continue
            sock.settimeout(None)
            stream = sock.makefile("rw", encoding="utf-8")
            hello = json.loads(stream.readline())
            self._socks.append(sock)
            self._streams[int(hello["rank"])] = stream

    def command(self, cmd: str, timeout_s: float = 300.0, **fields: Any) -> list[Any]:
        """Every rank's result of ``cmd`` in rank order (module docstring)."""
        if not self.alive():
            raise NodeError(f"{self.name}: ranks {self.pids} are not all running ({cmd})")
        self.connect()
        line = json.dumps({"cmd": cmd, **fields}) + "\n"
        for rank in range(self.world):
            self._streams[rank].write(line)
            self._streams[rank].flush()
        for sock in self._socks:
            sock.settimeout(timeout_s)
        replies, errors = [], []
        try:
            for rank in range(self.world):
                raw = self._streams[rank].readline()
                if not raw:
                    raise NodeError(f"{self.name} rank {rank} is gone ({cmd}): {self.log_tail()}")
                reply = json.loads(raw)
                if not reply["ok"]:
                    errors.append(f"rank {rank}: {reply['error']}")
                replies.append(reply.get("result"))
        except TimeoutError:
            self.kill()
            raise NodeError(f"{self.name}: {cmd} not answered in {timeout_s} s: "
                            f"{self.log_tail()}") from None  # fmt: skip
        if errors:
            raise NodeError(f"{self.name}: {cmd} failed: " + "; ".join(errors))
        return replies

    def first(self, cmd: str, **fields: Any) -> Any:
        """Rank 0's result of ``cmd``."""
        return self.command(cmd, **fields)[0]

    def log_tail(self, n: int = 3000) -> str:
        parts = []
        for rank, path in enumerate(self.logs):
            try:
                text = Path(path).read_text(errors="replace")[-n:]
            except OSError:
                text = ""
            parts.append(f"--- rank {rank} log:\n{text}")
        return "\n".join(parts)

    def alive(self) -> bool:
        return bool(self.procs) and all(p.poll() is None for p in self.procs)

    def kill(self) -> None:
        """SIGKILL every rank by pid (a crash, as a test injects it); waits for them."""
        for p in self.procs:
            if p.poll() is None:
                p.send_signal(signal.SIGKILL)
        for p in self.procs:
            p.wait()
        self._close_streams()
        self._listener.close()

    def stop(self, stop_timeout_s: float = 30.0) -> None:
        """Close every executor and store, exit; kill by pid what is left after the timeout.
        Idempotent."""
        stop_nodes([self], stop_timeout_s)

    def _send_quit(self) -> bool:
        if not (self.alive() and self._streams):
            return False
        try:
            for stream in self._streams.values():
                stream.write(json.dumps({"cmd": "quit"}) + "\n")
                stream.flush()
        except OSError:
            return False
        return True

    def _finish_stop(self, deadline: float) -> None:
        for sock in self._socks:
            sock.settimeout(max(0.1, deadline - time.monotonic()))
        try:
            for stream in self._streams.values():
                stream.readline()
        except (OSError, ValueError):
            logger.warning("%s: no answer to quit; killing", self.name)

    def _close_streams(self) -> None:
        for s in self._socks:
            try:
                s.close()
            except OSError:
                pass
        self._socks.clear()
        self._streams.clear()

    def __enter__(self) -> StoreNode:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.stop()


def stop_nodes(nodes: list[StoreNode], stop_timeout_s: float = 30.0) -> None:
    """``stop`` several nodes at once (their ranks close and exit in parallel)."""
    deadline = time.monotonic() + stop_timeout_s
    asked = [node for node in nodes if node._send_quit()]
    for node in asked:
        node._finish_stop(deadline)
    for node in nodes:
        for p in node.procs:
            try:
                p.wait(max(0.0, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                pass
        node.kill()
