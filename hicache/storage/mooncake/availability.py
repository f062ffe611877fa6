"""Whether Mooncake can run here (cached checks; ``mooncake.engine`` and ``mooncake.store`` both
need ``libibverbs.so.1`` even over TCP), and whether an engine may start on a loopback host: its
listeners bind every interface, so the process must preload the shim that rewrites wildcard binds
to loopback.
"""

from __future__ import annotations

import ctypes
import importlib
import importlib.util
import ipaddress
import os
from functools import cache
from pathlib import Path

WHEEL = "mooncake-transfer-engine-non-cuda"  # the CPU/TCP build ``make test`` installs
IBVERBS = "libibverbs.so.1"  # Debian package libibverbs1
SHIM_ENV = "HICACHE_LOOPBACK_SHIM"  # the built shim (default build/loopback/bind_loopback.so)

_REPO = Path(__file__).resolve().parents[3]


@cache
def wheel_reason() -> str | None:
    try:
        if importlib.util.find_spec("mooncake") is None:
            return f"the Mooncake wheel is not installed (pip install {WHEEL})"
    except (ImportError, ValueError) as e:
        return f"the Mooncake wheel is not importable ({e})"
    return None


@cache
def ibverbs_reason() -> str | None:
    try:
        ctypes.CDLL(IBVERBS)
    except OSError:
        return f"{IBVERBS} does not load (install the Debian package libibverbs1)"
    return None


def installed() -> bool:
    return wheel_reason() is None and ibverbs_reason() is None


@cache
def module_reason(module: str) -> str | None:
    """Why ``mooncake.<module>`` (``"engine"`` or ``"store"``) cannot be imported, or ``None``."""
    if module not in ("engine", "store"):
        raise ValueError(f"module={module!r} must be 'engine' or 'store'")
    reason = wheel_reason() or ibverbs_reason()
    if reason is not None:
        return reason
    try:
        importlib.import_module(f"mooncake.{module}")
    except ImportError as e:
        return f"import mooncake.{module} failed ({e})"
    return None


def shim_path() -> Path:
    env = os.environ.get(SHIM_ENV)
    return Path(env) if env else _REPO / "build" / "loopback" / "bind_loopback.so"


def shim_loaded() -> bool:
    try:
        maps = Path("/proc/self/maps").read_text()
    except OSError:
        return False
    return shim_path().name in maps


def is_loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def require_loopback_engines(host: str) -> None:
    """``RuntimeError`` for a loopback ``host`` in a process without the shim."""
    if is_loopback(host) and not shim_loaded():
        raise RuntimeError(
            f"a Mooncake engine for host {host} would listen on 0.0.0.0 and ::; start this "
            f"process with LD_PRELOAD={shim_path()} (built by make test or make mooncake) to "
            "keep it on loopback"
        )
