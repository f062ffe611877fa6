"""Plug this project's kvcacheio kernels into a running SGLang: one :func:`install` call.

It checks everything first (an unknown SGLang gets one ``ValueError`` naming its version, and
nothing is patched), then registers a minimal ``sgl_kernel.kvcacheio`` (or rebinds sgl-kernel's),
rebinds the names SGLang's host-pool modules import, optionally routes around the JIT kernels
and warms up. :meth:`SGLangKernels.uninstall` restores every binding exactly.
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

from hicache_prefill.kernels import KVCACHEIO_OPS
from hicache_prefill.kernels.sglang.rebind import Binding, plan_rebinding, required_names
from hicache_prefill.kernels.sglang.warm_up import (
    HOST_POOL_JIT_FLAGS,
    WarmUpReport,
    verify_pool_tables,
    warm_up,
)

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

# Host-pool module layouts: name -> modules that must import kvcacheio ops (first found is used).
MODULE_LAYOUTS: dict[str, tuple[str, ...]] = {
    # MHA / MLA host pools split into a package (0.5.17 ... 0.5.23 at least).
    "pool_host": (
        "sglang.srt.mem_cache.pool_host.mha",
        "sglang.srt.mem_cache.pool_host.mla",
    ),
    # Every host pool in one module (0.5.14 and earlier).
    "memory_pool_host": ("sglang.srt.mem_cache.memory_pool_host",),
}


def sglang_version() -> str:
    try:
        return importlib.metadata.version("sglang")
    except importlib.metadata.PackageNotFoundError:
        mod = sys.modules.get("sglang.version")
        return str(getattr(mod, "__version__", "unknown"))


def provided_ops() -> dict[str, Any]:
    from hicache_prefill import kernels

    return {name: getattr(kernels, name) for name in KVCACHEIO_NAMES if hasattr(kernels, name)}


@dataclass
class SGLangKernels:
    """What :func:`install` patched; the handle that undoes it."""

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
        """Restore every binding and remove registered modules (idempotent)."""
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
        report = warm_up(host_pool, device_pool)
        self.warm.calls += report.calls
        self.warm.skipped += report.skipped
        self.warm.verified_tables += report.verified_tables
        return report


_ACTIVE: SGLangKernels | None = None


def active() -> SGLangKernels | None:
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
    pkg = types.ModuleType("sgl_kernel")
    pkg.__path__ = []
    io = types.ModuleType("sgl_kernel.kvcacheio")
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
    """Plug this project's kernels into SGLang. ``host_pools``: built SGLang host pools whose JIT
    flags to clear (with ``route_around_jit``); ``warm``: ``(host_pool, device_pool)`` pairs."""
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
