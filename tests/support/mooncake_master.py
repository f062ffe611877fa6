"""``MooncakeMaster``: a Mooncake master the tests and benchmarks start and stop, or one they
connect to.

``MooncakeMaster.start()`` runs the ``mooncake_master`` binary of the installed wheel bound to
loopback only: ``--rpc_address=127.0.0.1 --metrics_host=127.0.0.1
--enable_http_metadata_server=false`` (its defaults bind every interface: RPC and metrics on
``0.0.0.0``, and an HTTP metadata server on ``0.0.0.0:8080``), on free ports unless given. It
waits until the master serves (``GET /health`` on the metrics port reports ``service_ready``
and the RPC port accepts a connection; about 0.1-0.4 s), records the pid, and ``stop()`` ends
exactly that process (SIGTERM, about 1 s; SIGKILL after ``stop_timeout_s``). The child gets
``PR_SET_PDEATHSIG``: it dies with the process that started it. Its log goes to ``log_path``
(a temporary file by default; its tail is in every startup error).

``MooncakeMaster.connect(address)`` wraps a master someone else runs: it checks that the address
accepts connections and never stops it.

Errors are ``ValueError``s naming the setting: a given port that is in use (``rpc_port``,
``metrics_port``), a binary that is missing, a master that exits or does not serve within
``ready_timeout_s``, an address where nothing listens. A master keeps every object in memory: a
restart (``restart()``, same ports) loses them all; clients rejoin it by themselves.

    python -m tests.support.mooncake_master [--rpc-port P] [--metrics-port M] [--flag=value...]

prints the address and pid, serves until SIGINT / SIGTERM, then stops the master.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import logging
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path
from typing import Any

from hicache_prefill.hicache.storage.mooncake.config import split_address
from tests.support.loopback import LOOPBACK, die_with_parent, free_port

logger = logging.getLogger(__name__)

LOOPBACK_FLAGS = ("--rpc_address=127.0.0.1", "--metrics_host=127.0.0.1",
                  "--enable_http_metadata_server=false")  # fmt: skip


def _check_free(port: int, name: str) -> None:
    """``ValueError`` naming ``name`` when something listens on ``port`` (``SO_REUSEADDR``, as
    a server binds: the TIME_WAIT connections a stopped master leaves do not count)."""
    with socket.socket() as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            s.bind((LOOPBACK, port))
        except OSError as e:
            raise ValueError(f"{name}={port} is in use on {LOOPBACK} ({e})") from None


def master_binary() -> str:
    """The ``mooncake_master`` of the installed wheel (the ELF beside the package, else the
    console script on ``PATH``); ``ValueError`` when there is none."""
    spec = importlib.util.find_spec("mooncake")
    if spec is not None and spec.submodule_search_locations:
        elf = Path(next(iter(spec.submodule_search_locations))) / "mooncake_master"
        if elf.is_file() and os.access(elf, os.X_OK):
            return str(elf)
    found = shutil.which("mooncake_master")
    if found:
        return found
    raise ValueError("mooncake_master not found: install mooncake-transfer-engine-non-cuda")


def master_health(host: str, metrics_port: int, timeout_s: float = 0.5) -> dict | None:
    """The master's ``GET /health`` answer, or ``None`` when it does not answer."""
    try:
        with urllib.request.urlopen(f"http://{host}:{metrics_port}/health", timeout=timeout_s) as r:
            return json.loads(r.read())
    except (OSError, ValueError):
        return None


def accepts(host: str, port: int, timeout_s: float = 0.5) -> bool:
    try:
        socket.create_connection((host, port), timeout=timeout_s).close()
        return True
    except OSError:
        return False


class MooncakeMaster:
    """A master's address, and its process when this project started it (module docstring)."""

    def __init__(
        self,
        address: str,
        *,
        metrics_port: int | None = None,
        process: subprocess.Popen | None = None,
        log_path: str | None = None,
        flags: tuple[str, ...] = (),
    ) -> None:
        self.address = address
        self.metrics_port = metrics_port
        self.process = process
        self.log_path = log_path
        self.flags = flags
        self.exited_early = False  # the process ended before it served (a port taken?)

    # ------------------------------------------------------------------ construction
    @classmethod
    def start(
        cls,
        rpc_port: int | None = None,
        metrics_port: int | None = None,
        *,
        flags: tuple[str, ...] | list[str] = (),
        ready_timeout_s: float = 30.0,
        log_path: str | None = None,
        binary: str | None = None,
    ) -> MooncakeMaster:
        """Start a master on loopback (module docstring); ``flags``: more ``--flag=value``
        arguments (``--default_kv_lease_ttl=...``, ``--client_ttl=...``)."""
        for flag in flags:
            if any(flag.split("=")[0] == f.split("=")[0] for f in LOOPBACK_FLAGS):
                raise ValueError(f"flags: {flag!r} would undo the loopback binding")
        if rpc_port is not None and rpc_port == metrics_port:
            raise ValueError(f"rpc_port and metrics_port must differ, both {rpc_port}")
        for name, port in (("rpc_port", rpc_port), ("metrics_port", metrics_port)):
            if port is not None:
                _check_free(port, name)
        exe = binary or master_binary()
        attempts = 1 if rpc_port is not None and metrics_port is not None else 3
        for attempt in range(attempts):  # free ports picked here may be taken before the bind
            rpc = rpc_port if rpc_port is not None else free_port()
            metrics = metrics_port if metrics_port is not None else free_port()
            if rpc == metrics:
                continue
            master = cls._spawn(exe, rpc, metrics, tuple(flags), log_path)
            try:
                master._wait_ready(ready_timeout_s)
            except ValueError:
                master.stop()
                if master.exited_early and attempt + 1 < attempts:
                    continue
                raise
            except BaseException:
                master.stop()
                raise
            logger.info("mooncake_master pid %d serving %s (metrics %d, log %s)", master.pid,
                        master.address, metrics, master.log_path)  # fmt: skip
            return master
        raise ValueError("could not find two free ports for mooncake_master")

    @classmethod
    def _spawn(
        cls, exe: str, rpc_port: int, metrics_port: int, flags: tuple[str, ...],
        log_path: str | None,
    ) -> MooncakeMaster:  # fmt: skip
        if log_path is None:
            fd, log_path = tempfile.mkstemp(prefix=f"mooncake_master_{rpc_port}_", suffix=".log")
            os.close(fd)
        cmd = [exe, f"--rpc_port={rpc_port}", f"--metrics_port={metrics_port}",
               *LOOPBACK_FLAGS, *flags]  # fmt: skip
        with open(log_path, "ab") as log:
            proc = subprocess.Popen(cmd, stdin=subprocess.DEVNULL, stdout=log, stderr=log,
                                    preexec_fn=die_with_parent)  # fmt: skip
        return cls(f"{LOOPBACK}:{rpc_port}", metrics_port=metrics_port, process=proc,
                   log_path=log_path, flags=flags)  # fmt: skip

    @classmethod
    def connect(cls, address: str, timeout_s: float = 2.0) -> MooncakeMaster:
        """A master someone else runs at ``address`` (``host:port``); ``ValueError`` when
        nothing accepts connections there. ``stop()`` leaves it running."""
        host_port = split_address(address, "master_server_address")
        if host_port is not None and not accepts(*host_port, timeout_s=timeout_s):
            raise ValueError(f"master_server_address={address}: nothing accepts connections")
        return cls(address)

    def _wait_ready(self, timeout_s: float) -> None:
        assert self.process is not None and self.metrics_port is not None
        host, port = split_address(self.address, "address") or (LOOPBACK, 0)
        deadline = time.monotonic() + timeout_s
        while True:
            rc = self.process.poll()
            if rc is not None:
                self.exited_early = True
                raise ValueError(
                    f"mooncake_master exited with {rc} before serving {self.address} "
                    f"(rpc_port={port}, metrics_port={self.metrics_port}; a port in use?): "
                    f"{self.log_tail()}"
                )
            health = master_health(host, self.metrics_port)
            if health and health.get("service_ready") and accepts(host, port):
                if self.process.poll() is None:
                    return
            if time.monotonic() > deadline:
                raise ValueError(
                    f"mooncake_master pid {self.pid} did not serve {self.address} within "
                    f"{timeout_s:g} s: {self.log_tail()}"
                )
            time.sleep(0.02)

    # ------------------------------------------------------------------ state
    @property
    def pid(self) -> int | None:
        return None if self.process is None else self.process.pid

    @property
    def owned(self) -> bool:
        """Whether this project started it (and ``stop`` ends it)."""
        return self.process is not None

    @property
    def rpc_port(self) -> int:
        host_port = split_address(self.address, "address")
        assert host_port is not None
        return host_port[1]

    def is_alive(self) -> bool:
        return self.process is not None and self.process.poll() is None

    def health(self) -> dict | None:
        """The ``/health`` answer of a master this project started (``None``: not serving)."""
        if self.metrics_port is None:
            return None
        return master_health(LOOPBACK, self.metrics_port)

    def log_tail(self, n: int = 2000) -> str:
        if not self.log_path:
            return ""
        try:
            with open(self.log_path, "rb") as f:
                f.seek(0, os.SEEK_END)
                f.seek(max(0, f.tell() - n))
                return f.read().decode(errors="replace").strip()
        except OSError:
            return ""

    # ------------------------------------------------------------------ lifecycle
    def stop(self, timeout_s: float = 10.0) -> int | None:
        """End the master this project started (SIGTERM to its pid, SIGKILL after
        ``timeout_s``) and return its exit status; idempotent; ``None`` for a connected one."""
        proc = self.process
        if proc is None:
            return None
        if proc.poll() is None:
            proc.send_signal(signal.SIGTERM)
            try:
                proc.wait(timeout_s)
            except subprocess.TimeoutExpired:
                logger.warning("mooncake_master pid %d ignored SIGTERM; killing it", proc.pid)
                proc.kill()
                proc.wait(timeout_s)
        return proc.returncode

    def restart(self, ready_timeout_s: float = 30.0) -> MooncakeMaster:
        """A new master on the same ports (this one stopped first); every object is gone."""
        if self.metrics_port is None:
            raise ValueError("restart: only a master this project started can be restarted")
        self.stop()
        return MooncakeMaster.start(
            self.rpc_port,
            self.metrics_port,
            flags=self.flags,
            ready_timeout_s=ready_timeout_s,
            log_path=self.log_path,
        )

    def __enter__(self) -> MooncakeMaster:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.stop()

    def __repr__(self) -> str:
        who = f"pid {self.pid}" if self.owned else "not ours"
        return f"MooncakeMaster({self.address}, {who})"


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m tests.support.mooncake_master",
                                description=__doc__.split("\n\n")[0])  # fmt: skip
    p.add_argument("--rpc-port", type=int, default=None)
    p.add_argument("--metrics-port", type=int, default=None)
    opts, flags = p.parse_known_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    master = MooncakeMaster.start(opts.rpc_port, opts.metrics_port, flags=tuple(flags))
    sys.stdout.write(f"master_server_address={master.address} pid={master.pid} "
                     f"metrics_port={master.metrics_port} log={master.log_path}\n")  # fmt: skip
    sys.stdout.flush()
    stop = {"now": False}

    def _stop(signum: int, frame: Any) -> None:
        stop["now"] = True

    signal.signal(signal.SIGTERM, _stop)
    signal.signal(signal.SIGINT, _stop)
    try:
        while not stop["now"] and master.is_alive():
            time.sleep(0.2)
    finally:
        rc = master.stop()
    return 0 if rc in (0, None, -signal.SIGTERM) else 1


if __name__ == "__main__":
    sys.exit(main())
