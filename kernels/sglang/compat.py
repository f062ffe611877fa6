"""Plug this project's kvcacheio kernels into a running SGLang: one :func:`install` call.

It checks everything it will touch first (an unknown SGLang gets one ``ValueError`` naming its
version, and nothing is patched), then: registers a minimal ``sgl_kernel.kvcacheio`` when
sgl-kernel is absent, else rebinds the ops on it; imports SGLang's host-pool modules and rebinds
every kvcacheio name they import at module level (:mod:`kernels.sglang.rebind` reads which);
with ``route_around_jit`` rebinds SGLang's JIT predicates to ``False``; with ``warm`` runs
:func:`warm_up`. :meth:`SGLangKernels.uninstall` restores every binding exactly. Imports nothing
of SGLang at import time.
"""

from __future__ import annotations

import importlib
import importlib.metadata
import importlib.util
import logging
import sys
import types
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any

from kernels import KVCACHEIO_OPS
from kernels.sglang.rebind import Binding, plan_rebinding, required_names
from kernels.sglang.warm_up import WarmUpReport, verify_pool_tables, warm_up

logger = logging.getLogger(__name__)

__all__ = [
    "KVCACHEIO_NAMES",
    "MODULE_LAYOUTS",
    "SGLangKernels",
    "WarmUpReport",
    "active",
    "install",
    "provided_ops",
    "sglang_version",
    "verify_pool_tables",
    "warm_up",
]

KVCACHEIO_NAMES: tuple[str, ...] = KVCACHEIO_OPS
"""The ``sgl_kernel.kvcacheio`` surface this module supplies: every op :mod:`kernels` provides."""


MODULE_LAYOUTS: dict[str, tuple[str, ...]] = {
    # MHA / MLA host pools split into a package (0.5.17 ... 0.5.23 at least).
    "pool_host": (
        "sglang.srt.mem_cache.pool_host.mha",
        "sglang.srt.mem_cache.pool_host.mla",
    ),
    # Every host pool in one module (0.5.14 and earlier).
    "memory_pool_host": ("sglang.srt.mem_cache.memory_pool_host",),
}
"""The host-pool module layouts this module recognises: layout name -> modules that must import
kvcacheio ops. The first layout whose modules all exist is used."""


HOST_POOL_JIT_FLAGS: tuple[str, ...] = ("can_use_jit", "can_use_write_back_jit")


def sglang_version() -> str:
    """The installed SGLang's version (``"unknown"`` when it has no distribution metadata)."""
    try:
        return importlib.metadata.version("sglang")
    except importlib.metadata.PackageNotFoundError:
        mod = sys.modules.get("sglang.version")
        return str(getattr(mod, "__version__", "unknown"))


def provided_ops() -> dict[str, Any]:
    """This project's ops by SGLang name (only the names :mod:`kernels` defines)."""
    import kernels

    return {name: getattr(kernels, name) for name in KVCACHEIO_NAMES if hasattr(kernels, name)}


@dataclass
class SGLangKernels:
    """The handle :func:`install` returns. Read-only record of what was patched."""

    sglang_version: str
    layout: str
    route_around_jit: bool
    registered_sgl_kernel: bool
    patched_modules: dict[str, tuple[str, ...]]
    skipped: dict[str, tuple[str, ...]]
    resolved_at_call: dict[str, tuple[str, ...]] = field(default_factory=dict)
    warm: WarmUpReport = field(default_factory=WarmUpReport)
    _bindings: list[Binding] = field(default_factory=list, repr=False)
    _registered: list[str] = field(default_factory=list, repr=False)
    _options: tuple = field(default=(), repr=False)
    installed: bool = True

    def uninstall(self) -> None:
        """Restore every binding and remove registered modules. A second call does nothing."""
        global _ACTIVE
        if not self.installed:
            return
        for binding in reversed(self._bindings):
            binding.restore()
        for name in reversed(self._registered):
            module = sys.modules.pop(name, None)
            parent, _, child = name.rpartition(".")
            if parent and module is not None and getattr(sys.modules.get(parent), child, None):
                delattr(sys.modules[parent], child)
        self._bindings.clear()
        self._registered.clear()
        self.installed = False
        if _ACTIVE is self:
            _ACTIVE = None
        logger.info("sglang_compat: uninstalled (SGLang %s)", self.sglang_version)

    def warm_up(self, host_pool: Any, device_pool: Any) -> WarmUpReport:
        """:func:`warm_up` one pair, recorded in :attr:`warm`."""
        report = warm_up(host_pool, device_pool)
        self.warm.calls += report.calls
        self.warm.skipped += report.skipped
        self.warm.verified_tables += report.verified_tables
        return report


_ACTIVE: SGLangKernels | None = None


def active() -> SGLangKernels | None:
    """The installed handle, if any."""
    return _ACTIVE


def _sgl_kernel_present() -> bool:
    if "sgl_kernel" in sys.modules:
        return True
    try:
        return importlib.util.find_spec("sgl_kernel") is not None
    except (ImportError, ValueError):
        return False


def _find_layout(version: str) -> str:
    for layout, modules in MODULE_LAYOUTS.items():
        try:
            if all(importlib.util.find_spec(m) is not None for m in modules):
                return layout
        except (ImportError, ValueError):
            continue
    known = "; ".join(f"{k}: {', '.join(v)}" for k, v in MODULE_LAYOUTS.items())
    raise ValueError(
        f"SGLang {version}: no known host-pool module layout found (known layouts: {known}); "
        f"sglang_compat does not support this SGLang version"
    )


def _fake_sgl_kernel(ops: dict[str, Any]) -> dict[str, types.ModuleType]:
    """A minimal ``sgl_kernel`` package whose ``kvcacheio`` holds ``ops`` (not yet registered)."""
    pkg = types.ModuleType("sgl_kernel")
    pkg.__path__ = []
    pkg.__doc__ = "Stand-in registered by kernels.sglang.compat: only kvcacheio is provided."
    io = types.ModuleType("sgl_kernel.kvcacheio")
    io.__doc__ = "This project's kvcacheio ops (kernels.sglang.compat)."
    for name, fn in ops.items():
        setattr(io, name, fn)
    io.__all__ = sorted(ops)
    pkg.kvcacheio = io
    return {"sgl_kernel": pkg, "sgl_kernel.kvcacheio": io}


def install(
    *,
    route_around_jit: bool = False,
    import_modules: bool = True,
    host_pools: Iterable[Any] = (),
    warm: Iterable[tuple[Any, Any]] = (),
) -> SGLangKernels:
    """Plug this project's kernels into SGLang (see the module docstring). Returns the handle.

    ``host_pools``: already built SGLang host pools whose JIT flags to clear (with
    ``route_around_jit``). ``warm``: ``(host_pool, device_pool)`` pairs to :func:`warm_up`.
    Raises ``ValueError`` naming the SGLang version when its modules are not recognised; nothing
    is patched then.
    """
    global _ACTIVE
    host_pools, warm = list(host_pools), list(warm)
    options = (bool(route_around_jit), bool(import_modules))
    if _ACTIVE is not None and _ACTIVE.installed:
        if _ACTIVE._options != options:
            raise ValueError(
                f"sglang_compat is already installed with route_around_jit="
                f"{_ACTIVE._options[0]}, import_modules={_ACTIVE._options[1]}: uninstall first"
            )
        if host_pools or warm:
            raise ValueError("host_pools / warm need a fresh install: call handle.warm_up()")
        return _ACTIVE

    version = sglang_version()
    ops = provided_ops()
    layout = _find_layout(version)
    required = MODULE_LAYOUTS[layout]
    # Check the required modules' imports from their source before touching anything.
    needed = {name: required_names(version, layout, name, ops) for name in required}
    has_sgl_kernel = _sgl_kernel_present()

    # 1. The ops module: registered before SGLang's host-pool modules import (they bind it), or
    # sgl-kernel's own, rebound below. Undone if anything after this fails.
    registered = {} if has_sgl_kernel else _fake_sgl_kernel(ops)
    bindings: list[Binding] = []
    sys.modules.update(registered)
    try:
        if has_sgl_kernel:
            io_module = importlib.import_module("sgl_kernel.kvcacheio")
            bindings += [Binding(io_module, n, fn) for n, fn in ops.items()]
        for name in required:
            if import_modules:
                importlib.import_module(name)
            elif name not in sys.modules:
                raise ValueError(
                    f"SGLang {version}: {name} is not imported (pass import_modules=True)"
                )
        patched, skipped, at_call, module_bindings = plan_rebinding(needed, ops, route_around_jit)
    except BaseException:
        for name in registered:
            sys.modules.pop(name, None)
        raise
    bindings += module_bindings
    if route_around_jit:
        for pool in host_pools:
            bindings += [
                Binding(pool, flag, False) for flag in HOST_POOL_JIT_FLAGS if hasattr(pool, flag)
            ]

    # 2. Everything checked: apply.
    for binding in bindings:
        binding.apply()
    handle = SGLangKernels(
        sglang_version=version,
        layout=layout,
        route_around_jit=bool(route_around_jit),
        registered_sgl_kernel=bool(registered),
        patched_modules=patched,
        skipped=skipped,
        resolved_at_call=at_call,
        _bindings=bindings,
        _registered=list(registered),
        _options=options,
    )
    _ACTIVE = handle
    logger.info(
        "sglang_compat: SGLang %s (%s layout), %s sgl_kernel.kvcacheio, rebound %d names in %s%s",
        version,
        layout,
        "registered" if registered else "patched",
        sum(len(v) for v in patched.values()),
        ", ".join(patched) or "no module",
        ", JIT routed around" if route_around_jit else "",
    )
    try:
        for host_pool, device_pool in warm:
            handle.warm_up(host_pool, device_pool)
    except BaseException:
        handle.uninstall()
        raise
    return handle
