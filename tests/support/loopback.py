"""Keeping every Mooncake listener of the tests and benchmarks on loopback: the ``LD_PRELOAD``
shim built from ``bind_loopback.c`` (beside this file; it rewrites a ``bind()`` to ``0.0.0.0``
into ``127.0.0.1`` and one to ``::`` into ``::ffff:127.0.0.1``), the environment of a child that
preloads it, re-executing a driver under it, listeners by pid, and the one-line reason a
Mooncake test or benchmark skips. ``make test`` builds the shim into
``build/loopback/bind_loopback.so`` (``mk/mooncake.mk``); ``build_shim`` builds it on first use.
Children with an engine start with ``preload_env()``; drivers hosting one re-execute themselves
under it (``reexec_under_shim``); the product refuses an engine on loopback without it
(``hicache.storage.mooncake.availability.require_loopback_engines``).
"""

from __future__ import annotations

import ctypes
import ipaddress
import logging
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
from pathlib import Path

from hicache_prefill.hicache.storage.mooncake.availability import (
    SHIM_ENV,
    module_reason,
    shim_loaded,
    shim_path,
)

logger = logging.getLogger(__name__)

SHIM_SOURCE = Path(__file__).with_name("bind_loopback.c")
REEXEC_ENV = "HICACHE_LOOPBACK_REEXEC"
"""Set to ``0`` to keep ``reexec_under_shim`` from re-executing; set to ``done`` by it."""

LOOPBACK = "127.0.0.1"


class ShimUnavailable(RuntimeError):
    """The loopback shim cannot be built or loaded here (the reason is the message)."""


def build_shim(path: Path | None = None) -> Path:
    """The shim library at ``path`` (default ``shim_path()``), compiled from ``SHIM_SOURCE`` when
    missing or older than the source. Raises ``ShimUnavailable`` without a C compiler or when
    compiling fails. Safe to call from several processes at once (atomic rename)."""
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


def free_port(host: str = LOOPBACK) -> int:
    """A TCP port on ``host`` that was free a moment ago."""
    with socket.socket() as s:
        s.bind((host, 0))
        return int(s.getsockname()[1])


def skip_reason(module: str = "engine", shim_in_process: bool = False) -> str | None:
    """One line saying why tests or benchmarks of ``mooncake.<module>`` cannot run here, or
    ``None``: the module does not import, the shim cannot be built, or (``shim_in_process``:
    this process hosts an engine on loopback) this process does not preload the shim."""
    reason = module_reason(module)
    if reason is not None:
        return f"Mooncake unavailable: {reason}"
    try:
        build_shim()
    except ShimUnavailable as e:
        return f"loopback shim unavailable: {e}"
    if shim_in_process and not shim_loaded():
        return (
            "this process does not preload the loopback shim "
            f"(run under pytest or with LD_PRELOAD={shim_path()}; "
            f"{REEXEC_ENV}=0 turns the re-execution off)"
        )
    return None


def preload_env(env: dict[str, str] | None = None) -> dict[str, str]:
    """A copy of ``env`` (default ``os.environ``) whose ``LD_PRELOAD`` starts with the shim
    (built if needed; ``ShimUnavailable`` otherwise), for a child process with an engine."""
    out = dict(os.environ if env is None else env)
    lib = str(build_shim())
    rest = [p for p in out.get("LD_PRELOAD", "").split(":") if p and p != lib]
    out["LD_PRELOAD"] = ":".join([lib, *rest])
    out[SHIM_ENV] = lib
    return out


def reexec_env() -> dict[str, str] | None:
    """The environment ``reexec_under_shim`` would re-execute with, or ``None`` when it would
    not: the shim is already loaded, ``HICACHE_LOOPBACK_REEXEC`` is ``0`` or ``done``, or the
    shim cannot be built (logged). Callers re-execute only where Mooncake is installed
    (``availability.installed``)."""
    if shim_loaded() or os.environ.get(REEXEC_ENV) in ("0", "done"):
        return None
    try:
        env = preload_env()
    except ShimUnavailable as e:
        logger.warning("not re-executing under the loopback shim: %s", e)
        return None
    env[REEXEC_ENV] = "done"
    env["HICACHE_LOOPBACK_PRIOR_PRELOAD"] = os.environ.get("LD_PRELOAD", "")
    return env


def reexec_under_shim(env: dict[str, str] | None = None) -> None:
    """Re-execute this interpreter with the same command line (``sys.orig_argv``) under the
    shim, once, when ``reexec_env()`` allows it (or with ``env``); returns, doing nothing,
    otherwise. The re-executed process calls ``forget_preload()`` so that only the processes
    this project starts with ``preload_env`` inherit ``LD_PRELOAD``."""
    env = env if env is not None else reexec_env()
    if env is None:
        return
    sys.stdout.flush()
    sys.stderr.flush()
    os.execve(sys.executable, [sys.executable, *sys.orig_argv[1:]], env)


def forget_preload() -> None:
    """In a process re-executed by ``reexec_under_shim``: restore the ``LD_PRELOAD`` it had
    before (the shim stays loaded in this process; children no longer inherit it)."""
    if os.environ.get(REEXEC_ENV) == "done" and "HICACHE_LOOPBACK_PRIOR_PRELOAD" in os.environ:
        prior = os.environ.pop("HICACHE_LOOPBACK_PRIOR_PRELOAD")
        if prior:
            os.environ["LD_PRELOAD"] = prior
        else:
            os.environ.pop("LD_PRELOAD", None)


def die_with_parent() -> None:
    """Make this process die with its parent (``PR_SET_PDEATHSIG``): the ``preexec_fn`` of every
    child the project starts for Mooncake (masters, decode workers, node ranks, receivers), so a
    killed test or benchmark never leaves one behind."""
    ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG


def tcp_listeners(pids: set[int] | list[int]) -> list[tuple[str, int]]:
    """``(local address, pid)`` of every TCP listener owned by one of ``pids``, read from
    ``/proc`` (no ``ss`` needed: a fresh CI image may lack iproute2). Addresses as ``ss -ltn``
    writes them: ``127.0.0.1:P``, ``0.0.0.0:P``, ``[::ffff:127.0.0.1]:P``, ``[::1]:P``,
    ``[::]:P``. A pid that is gone or not readable owns nothing."""
    inodes: dict[str, set[int]] = {}
    for pid in set(pids):
        try:
            fds = os.listdir(f"/proc/{pid}/fd")
        except OSError:
            continue
        for fd in fds:
            try:
                link = os.readlink(f"/proc/{pid}/fd/{fd}")
            except OSError:
                continue
            if link.startswith("socket:["):
                inodes.setdefault(link[8:-1], set()).add(pid)
    found = []
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        try:
            lines = Path(table).read_text().splitlines()[1:]
        except OSError:
            continue
        for line in lines:
            f = line.split()
            if len(f) < 10 or f[3] != "0A":  # 0A: LISTEN
                continue
            for pid in sorted(inodes.get(f[9], ())):
                found.append((_proc_address(f[1]), pid))
    return found


def _proc_address(field: str) -> str:
    """``/proc/net/tcp{,6}``'s ``HEXADDR:HEXPORT`` (each 32-bit word of the address in host
    byte order) as ``ss`` writes it."""
    hexaddr, hexport = field.split(":")
    raw = bytes.fromhex(hexaddr)
    words = b"".join(raw[i : i + 4][::-1] for i in range(0, len(raw), 4))
    port = int(hexport, 16)
    if len(words) == 4:
        return f"{ipaddress.IPv4Address(words)}:{port}"
    addr = ipaddress.IPv6Address(words)
    if addr.ipv4_mapped is not None:
        return f"[::ffff:{addr.ipv4_mapped}]:{port}"
    return f"[{addr.compressed}]:{port}"


def non_loopback(listeners: list[tuple[str, int]]) -> list[tuple[str, int]]:
    """The listeners whose address is not loopback (``127.*``, ``[::1]``, ``[::ffff:127.*]``)."""
    ok = ("127.", "[::1]", "[::ffff:127.")
    return [(addr, pid) for addr, pid in listeners if not addr.startswith(ok)]
