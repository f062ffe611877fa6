"""Keeping Mooncake's listeners on loopback in tests and benchmarks.

Who listens where (Mooncake 0.3.13.post1, ``ss -ltnp`` by pid):

- ``mooncake_master``: its RPC port and metrics (HTTP) port on ``0.0.0.0`` and an HTTP metadata
  server on ``0.0.0.0:8080`` by default; ``MooncakeMaster.start`` passes
  ``--rpc_address=127.0.0.1 --metrics_host=127.0.0.1 --enable_http_metadata_server=false``, so
  only ``127.0.0.1`` is bound;
- every store client (``MooncakeDistributedStore.setup``: one per process and TP rank) embeds a
  transfer engine with a handshake (RPC) port on ``0.0.0.0`` and a TCP data port on the IPv6
  wildcard ``::``, whatever ``local_hostname`` says; no environment variable of Mooncake 0.3.13
  changes that (``MC_TCP_BIND_ADDRESS`` does not).

Clients are restricted by an ``LD_PRELOAD`` shim built from ``bind_loopback.c`` (beside this
file): it rewrites a ``bind()`` to ``0.0.0.0`` into ``127.0.0.1`` and one to ``::`` into
``::ffff:127.0.0.1``, and passes every other ``bind()`` through. Tests and benchmarks start every
process that holds a Mooncake client with ``preload_env()``; a process cannot preload into
itself, so they never hold one in-process. (A network namespace, ``unshare -rn``, works too.)

Interface shared with the Mooncake PD transport's ``prefill.disagg.mooncake.loopback`` (issue 22:
same shim source, ``HICACHE_LOOPBACK_SHIM``, default path ``build/loopback/bind_loopback.so``,
function names), so one of the two can replace the other when both are merged.
"""

from __future__ import annotations

import ipaddress
import logging
import os
import re
import shutil
import subprocess
import tempfile
from pathlib import Path

logger = logging.getLogger(__name__)

SHIM_SOURCE = Path(__file__).with_name("bind_loopback.c")
SHIM_ENV = "HICACHE_LOOPBACK_SHIM"
"""Names the built shim (default ``<repo>/build/loopback/bind_loopback.so``)."""

_REPO = Path(__file__).resolve().parents[3]


class ShimUnavailable(RuntimeError):
    """The loopback shim cannot be built here (the reason is the message)."""


def shim_path() -> Path:
    env = os.environ.get(SHIM_ENV)
    return Path(env) if env else _REPO / "build" / "loopback" / "bind_loopback.so"


def build_shim(path: Path | None = None) -> Path:
    """The shim at ``path`` (default ``shim_path()``), compiled from ``SHIM_SOURCE`` with ``cc``
    when missing or older than the source; ``ShimUnavailable`` without a compiler or when
    compiling fails. Safe from several processes at once (atomic rename)."""
    path = Path(path) if path is not None else shim_path()
    if path.exists() and path.stat().st_mtime >= SHIM_SOURCE.stat().st_mtime:
        return path
    cc = os.environ.get("CC") or shutil.which("cc") or shutil.which("gcc")
    if cc is None:
        raise ShimUnavailable("no C compiler (cc) to build the loopback shim")
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(suffix=".so", dir=path.parent)
    os.close(fd)
    cmd = [cc, "-shared", "-fPIC", "-O2", "-o", tmp, str(SHIM_SOURCE), "-ldl"]
    proc = subprocess.run(cmd, capture_output=True, text=True)
    if proc.returncode != 0:
        os.unlink(tmp)
        raise ShimUnavailable(f"building the loopback shim failed: {proc.stderr.strip()}")
    os.replace(tmp, path)
    return path


def shim_loaded() -> bool:
    """Whether this process has the shim mapped (``/proc/self/maps``)."""
    try:
        return shim_path().name in Path("/proc/self/maps").read_text()
    except OSError:
        return False


def is_loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def preload_env(env: dict[str, str] | None = None) -> dict[str, str]:
    """A copy of ``env`` (default ``os.environ``) whose ``LD_PRELOAD`` starts with the shim
    (built when needed; ``ShimUnavailable`` otherwise), for a child that holds a client."""
    out = dict(os.environ if env is None else env)
    lib = str(build_shim())
    rest = [p for p in out.get("LD_PRELOAD", "").split(":") if p and p != lib]
    out["LD_PRELOAD"] = ":".join([lib, *rest])
    out[SHIM_ENV] = lib
    return out


def tcp_listeners(pids: set[int] | list[int]) -> list[tuple[str, int]]:
    """``(local address, pid)`` of every TCP listener of ``pids`` (``ss -ltnpH``; ``[]`` when
    ``ss`` is missing)."""
    wanted = set(pids)
    try:
        out = subprocess.run(["ss", "-ltnpH"], capture_output=True, text=True).stdout
    except OSError:
        return []
    found = []
    for line in out.splitlines():
        for pid in {int(p) for p in re.findall(r"pid=(\d+)", line)} & wanted:
            found.append((line.split()[3], pid))
    return found


def non_loopback(listeners: list[tuple[str, int]]) -> list[tuple[str, int]]:
    """The listeners whose address is not loopback (``127.*``, ``[::1]``, ``[::ffff:127.*]``)."""
    ok = ("127.", "[::1]", "[::ffff:127.")
    return [(addr, pid) for addr, pid in listeners if not addr.startswith(ok)]
