"""Whether Mooncake can run here, and whether an engine may start on a loopback host.

Mooncake comes as one wheel (``mooncake-transfer-engine-non-cuda``) with two modules:
``mooncake.engine`` (the PD transport) and ``mooncake.store`` (the L3 backend); both need
``libibverbs.so.1`` even over TCP. Checks are cheap and cached; nothing imports a Mooncake
module at import time. An engine's listeners bind every interface whatever host it is given,
so on a loopback host the process must preload the ``LD_PRELOAD`` shim that rewrites wildcard
binds to loopback (``require_loopback_engines``).
"""

from __future__ import annotations

import ctypes
import importlib
import importlib.util
import ipaddress
import os
from functools import cache
from pathlib import Path

WHEEL = "mooncake-transfer-engine-non-cuda"
"""The PyPI name of the CPU/TCP build ``make test`` installs."""

IBVERBS = "libibverbs.so.1"
"""The one system library Mooncake's extension modules need (Debian package ``libibverbs1``)."""

SHIM_ENV = "HICACHE_LOOPBACK_SHIM"
"""Names the built shim (default ``<repo>/build/loopback/bind_loopback.so``)."""

_REPO = Path(__file__).resolve().parents[3]


@cache
def wheel_reason() -> str | None:
    """Why the Mooncake package is not importable (``None`` when ``import mooncake`` finds it)."""
    try:
        if importlib.util.find_spec("mooncake") is None:
            return f"the Mooncake wheel is not installed (pip install {WHEEL})"
    except (ImportError, ValueError) as e:
        return f"the Mooncake wheel is not importable ({e})"
    return None


@cache
def ibverbs_reason() -> str | None:
    """Why ``libibverbs.so.1`` does not load (``None`` when it does)."""
    try:
        ctypes.CDLL(IBVERBS)
    except OSError:
        return f"{IBVERBS} does not load (install the Debian package libibverbs1)"
    return None


def installed() -> bool:
    """The wheel is there and ``libibverbs.so.1`` loads (no Mooncake module is imported)."""
    return wheel_reason() is None and ibverbs_reason() is None


@cache
def module_reason(module: str) -> str | None:
    """Why ``mooncake.<module>`` (``"engine"`` or ``"store"``) cannot be imported here, or
    ``None``; the wheel and library checks come first so the reason names what to install."""
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
    """Where the loopback shim library is (or will be built)."""
    env = os.environ.get(SHIM_ENV)
    return Path(env) if env else _REPO / "build" / "loopback" / "bind_loopback.so"


def shim_loaded() -> bool:
    """Whether this process has a library named like the shim mapped (``/proc/self/maps``)."""
    try:
        maps = Path("/proc/self/maps").read_text()
    except OSError:
        return False
    return shim_path().name in maps


def is_loopback(host: str) -> bool:
    """``host`` is a loopback address or ``localhost``."""
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def require_loopback_engines(host: str) -> None:
    """Refuse to start a Mooncake engine on a loopback ``host`` in a process without the shim
    (its listeners would bind every interface). ``RuntimeError`` says how to run it."""
    if is_loopback(host) and not shim_loaded():
        raise RuntimeError(
            f"a Mooncake engine for host {host} would listen on 0.0.0.0 and ::; start this "
            f"process with LD_PRELOAD={shim_path()} (built by make test or make mooncake) to "
            "keep it on loopback"
        )
