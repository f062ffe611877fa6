"""``SGLangNodeProcess``: the check's handle on one SGLang PD node child
(:mod:`tests.sglang_check.pd_sglang_node`), started on loopback and stopped by its pid.

The child preloads the loopback shim (``tests.support.loopback.preload_env``), dies with its
parent (``PR_SET_PDEATHSIG``), and answers one JSON line per command. ``stop()`` asks it to quit
and then SIGKILLs exactly the recorded pid; ``kill()``, ``freeze()`` and ``thaw()`` send SIGKILL,
SIGSTOP and SIGCONT to that pid (the fault cases). Its stderr goes to a temporary log whose tail
is in every error.
"""

from __future__ import annotations

import json
import os
import select
import signal
import subprocess
import sys
import tempfile
import time
from typing import Any

from tests.sglang_check import rows
from tests.support.loopback import die_with_parent, preload_env

SHORT_TIMEOUTS = {
    # SGLang's own knobs, shortened so that each fault case ends in seconds.
    "SGLANG_DISAGGREGATION_BOOTSTRAP_TIMEOUT": "4",
    "SGLANG_DISAGGREGATION_WAITING_TIMEOUT": "8",
    "SGLANG_DISAGGREGATION_HEARTBEAT_INTERVAL": "2",
    "SGLANG_DISAGGREGATION_HEARTBEAT_MAX_FAILURE": "2",
    "SGLANG_DISAGGREGATION_ZMQ_SEND_TIMEOUT": "1",
    "SGLANG_DISAGGREGATION_ENGINE_INIT_TIMEOUT": "30",
    # Mooncake's TCP transport: a frozen peer fails a write after this many seconds.
    "MC_TCP_PROGRESS_TIMEOUT_SEC": "3",
    "MC_TRANSFER_TIMEOUT": "3",
}
"""The environment every node child starts with (besides TCP and loopback)."""


class NodeError(RuntimeError):
    """The node answered an error, died, or did not answer in time (the message says which)."""


def recorded_row(row: dict[str, Any]) -> Any:
    """:func:`tests.sglang_check.rows.recorded_row` for a PD row: a ``NodeError`` or
    ``AssertionError`` is the row's ``error`` without a traceback."""
    return rows.recorded_row(row, (NodeError, AssertionError))


class SGLangNodeProcess:
    """One child hosting SGLang's connector for ``role`` (``decode`` or ``prefill``)."""

    def __init__(self, site: str, role: str, config: dict[str, Any],
                 start_timeout_s: float = 120.0) -> None:  # fmt: skip
        self.role = role
        self.log = tempfile.NamedTemporaryFile(prefix=f"sglang-pd-{role}-", suffix=".log",
                                               delete=False)  # fmt: skip
        env = preload_env()
        env.update(SHORT_TIMEOUTS)
        env.update({"MC_FORCE_TCP": "1", "MOONCAKE_PROTOCOL": "tcp",
                    "SGLANG_HOST_IP": "127.0.0.1", "PYTHONUNBUFFERED": "1"})  # fmt: skip
        cmd = [sys.executable, "-m", "tests.sglang_check.pd_sglang_node", "--site", site,
               "--role", role, "--config", json.dumps(config)]  # fmt: skip
        self.proc = subprocess.Popen(
            cmd, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=self.log,
            env=env, preexec_fn=die_with_parent, text=True, bufsize=1,
        )  # fmt: skip
        self.pid = self.proc.pid
        self.frozen = False
        hello = self._read(start_timeout_s)
        if not hello.get("ok"):
            self.stop()
            raise NodeError(f"{role} node did not start: {hello.get('error')}\n"
                            f"{hello.get('traceback', '')}{self.log_tail()}")  # fmt: skip
        self.stubs: dict[str, str] = hello["stubs"]
        self.info = self.call("info")

    def log_tail(self, n: int = 3000) -> str:
        try:
            with open(self.log.name, encoding="utf-8", errors="replace") as f:
                return f.read()[-n:]
        except OSError:
            return ""

    def _read(self, timeout_s: float) -> dict[str, Any]:
        assert self.proc.stdout is not None
        ready, _, _ = select.select([self.proc.stdout], [], [], timeout_s)
        if not ready:
            raise NodeError(f"{self.role} node (pid {self.pid}) gave no answer in {timeout_s}s"
                            f"\n{self.log_tail()}")  # fmt: skip
        line = self.proc.stdout.readline()
        if not line:
            raise NodeError(f"{self.role} node (pid {self.pid}) exited "
                            f"({self.proc.poll()})\n{self.log_tail()}")  # fmt: skip
        return json.loads(line)

    def call(self, op: str, timeout_s: float = 60.0, **kw: Any) -> dict[str, Any]:
        """Send one command and return its answer; ``NodeError`` on an error answer."""
        assert self.proc.stdin is not None
        try:
            self.proc.stdin.write(json.dumps({"op": op, **kw}) + "\n")
            self.proc.stdin.flush()
        except (BrokenPipeError, OSError) as e:
            raise NodeError(f"{self.role} node (pid {self.pid}) is gone: {e}") from None
        out = self._read(timeout_s)
        if not out.get("ok"):
            raise NodeError(f"{self.role} node {op}: {out.get('error')}\n"
                            f"{out.get('traceback', '')}")  # fmt: skip
        return out

    def wait_status(self, op: str, room: int, want: set[int], timeout_s: float,
                    interval_s: float = 0.01) -> dict[str, Any]:  # fmt: skip
        """Poll ``op`` for ``room`` until its status is in ``want``, Failed, or the time is up
        (then the last answer, with ``timed_out``)."""
        deadline = time.monotonic() + timeout_s
        while True:
            out = self.call(op, room=room)
            if out["status"] in want or out["status"] == 0:
                return out
            if time.monotonic() > deadline:
                return {**out, "timed_out": True}
            time.sleep(interval_s)

    def alive(self) -> bool:
        return self.proc.poll() is None

    def kill(self) -> None:
        """SIGKILL to the recorded pid (a fault case, or the end of ``stop``)."""
        if self.proc.poll() is None:
            os.kill(self.pid, signal.SIGKILL)
            self.proc.wait(timeout=30)

    def freeze(self) -> None:
        os.kill(self.pid, signal.SIGSTOP)
        self.frozen = True

    def thaw(self) -> None:
        if self.frozen and self.proc.poll() is None:
            os.kill(self.pid, signal.SIGCONT)
        self.frozen = False

    def stop(self) -> None:
        """Quit politely, then SIGKILL the recorded pid if it is still there."""
        self.thaw()
        if self.proc.poll() is None:
            try:
                assert self.proc.stdin is not None
                self.proc.stdin.write('{"op": "quit"}\n')
                self.proc.stdin.flush()
                self.proc.wait(timeout=5)
            except (OSError, subprocess.TimeoutExpired, ValueError):
                pass
        self.kill()
        for f in (self.proc.stdin, self.proc.stdout):
            try:
                if f is not None:
                    f.close()
            except OSError:
                pass
        self.log.close()

    def __enter__(self) -> SGLangNodeProcess:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.stop()
