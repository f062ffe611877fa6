"""Whether Mooncake can run here, and the one line a skipped test or benchmark prints when not.

Mooncake comes as one wheel (``mooncake-transfer-engine-non-cuda``, installed by ``make test``
through ``mk/mooncake.mk``) with two modules: ``mooncake.engine`` (the transfer engine, the PD
transport) and ``mooncake.store`` (the distributed store, the L3 backend). Both need the system
library ``libibverbs.so.1`` even over TCP (Debian package ``libibverbs1``); ``import mooncake``
alone works without it. Checks here are cheap and cached per process; nothing imports a Mooncake
module at import time.
"""

from __future__ import annotations

import ctypes
import importlib.util
import logging
from functools import cache

from hicache.mooncake import loopback

logger = logging.getLogger(__name__)

WHEEL = "mooncake-transfer-engine-non-cuda"
"""The PyPI name of the CPU/TCP build ``make test`` installs."""

IBVERBS = "libibverbs.so.1"
"""The one system library Mooncake's extension modules need (Debian package ``libibverbs1``)."""


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
    ``None`` when it imports. The wheel and library checks come first so the reason names
    what to install."""
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


def skip_reason(module: str = "engine", shim_in_process: bool = False) -> str | None:
    """One line saying why tests or benchmarks of ``mooncake.<module>`` cannot run here, or
    ``None`` when they can: the module does not import (wheel, ``libibverbs.so.1``), the
    loopback shim cannot be built, or (``shim_in_process``: this process itself hosts an engine
    on loopback) this process does not preload the shim."""
    reason = module_reason(module)
    if reason is not None:
        return f"Mooncake unavailable: {reason}"
    try:
        loopback.build_shim()
    except loopback.ShimUnavailable as e:
        return f"loopback shim unavailable: {e}"
    if shim_in_process and not loopback.shim_loaded():
        return ("this process does not preload the loopback shim "
                f"(run under pytest or with LD_PRELOAD={loopback.shim_path()}; "
                f"{loopback.REEXEC_ENV}=0 turns the re-execution off)")  # fmt: skip
    return None
