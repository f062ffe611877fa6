"""What :func:`kernels.sglang.compat.install` rebinds in SGLang's modules, read from their source.

SGLang imports the kvcacheio ops under platform ``if`` branches, so on a machine without CUDA
those imports never ran: the names each module imports (from ``sgl_kernel.kvcacheio`` or 0.5.23's
``_kvcacheio``, and the JIT predicates) are read from its source text (:func:`imported_names`,
:func:`module_source`). :func:`required_names` checks a host-pool module the installer needs;
:func:`plan_rebinding` lists every :class:`Binding` (one name on one module, with what it held,
so it can be restored exactly) for the required modules and the other imported modules under
:data:`SCANNED_PACKAGE`. Nothing is applied here.

Imports nothing of SGLang or of this project.
"""

from __future__ import annotations

import ast
import importlib.util
import sys
import types
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

__all__ = [
    "JIT_PREDICATES",
    "JIT_SOURCES",
    "KVCACHEIO_SOURCES",
    "SCANNED_PACKAGE",
    "Binding",
    "imported_names",
    "module_source",
    "plan_rebinding",
    "required_names",
]

KVCACHEIO_SOURCES: tuple[str, ...] = (
    "sgl_kernel.kvcacheio",
    "sglang.srt.mem_cache.pool_host._kvcacheio",  # 0.5.23's per-op binding module (XPU)
)
JIT_SOURCES: tuple[str, ...] = (
    "sglang.kernels.ops.kvcache.hicache",  # 0.5.17+
    "sglang.jit_kernel.hicache",  # 0.5.14
)
JIT_PREDICATES: tuple[str, ...] = ("can_use_hicache_jit_kernel", "can_use_write_back_jit_kernel")

SCANNED_PACKAGE = "sglang.srt.mem_cache."
"""Other already-imported modules under this package that import kvcacheio ops are rebound too."""

_ABSENT = object()


def _false_predicate(*args: Any, **kwargs: Any) -> bool:
    """Stands for SGLang's JIT predicates when routing around the JIT kernels."""
    return False


def imported_names(
    source: str, sources: Sequence[str], only_ops: bool = True, module_level: bool = False
) -> set[str]:
    """Names a module's ``source`` text imports from any of ``sources`` (``from X import a, b``), at
    any nesting (SGLang's imports sit under platform ``if`` branches, so on a machine without CUDA
    they never ran: the names are read from the text, not from the module's globals).

    From a module other than ``sgl_kernel.kvcacheio`` itself (0.5.23's ``_kvcacheio`` also exports
    helpers such as ``require_kvcacheio_ops``), only op names count: ``transfer_*`` and
    ``get_device_accessible_ptr`` (``only_ops=False`` keeps every name). ``module_level=True``:
    only imports that bind module globals (not those inside a function or class body).
    """
    names: set[str] = set()
    for node in _import_nodes(ast.parse(source), module_level):
        if node.module in sources and node.level == 0:
            for alias in node.names:
                if not only_ops or node.module == "sgl_kernel.kvcacheio" or _is_op(alias.name):
                    names.add(alias.name)
    return names


_SCOPES = (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda, ast.ClassDef)


def _import_nodes(tree: ast.AST, module_level: bool) -> list[ast.ImportFrom]:
    """Every ``from ... import`` of ``tree``; with ``module_level``, not those in a new scope."""
    if not module_level:
        return [n for n in ast.walk(tree) if isinstance(n, ast.ImportFrom)]
    out: list[ast.ImportFrom] = []
    todo = [tree]
    while todo:
        node = todo.pop()
        for child in ast.iter_child_nodes(node):
            if isinstance(child, ast.ImportFrom):
                out.append(child)
            elif not isinstance(child, _SCOPES):
                todo.append(child)
    return out


def _is_op(name: str) -> bool:
    return name.startswith("transfer_") or name == "get_device_accessible_ptr"


def module_source(name: str) -> str:
    """The source text of module ``name`` (imported or not; importing its parent packages).

    Raises ``ValueError`` when it cannot be found or read.
    """
    module = sys.modules.get(name)
    path = getattr(module, "__file__", None) if module is not None else None
    if path is None:
        try:
            spec = importlib.util.find_spec(name)
        except (ImportError, ValueError) as e:
            raise ValueError(f"cannot locate {name}: {e}") from e
        path = spec.origin if spec is not None else None
    if not path or not str(path).endswith(".py"):
        raise ValueError(f"cannot read the source of {name} (origin {path!r})")
    try:
        with open(path, encoding="utf-8") as f:
            return f.read()
    except OSError as e:
        raise ValueError(f"cannot read the source of {name}: {e}") from e


@dataclass
class Binding:
    """One name to set on one namespace (module or object), with what it held before."""

    target: Any
    name: str
    value: Any
    old: Any = _ABSENT

    def apply(self) -> None:
        self.old = getattr(self.target, self.name, _ABSENT)
        setattr(self.target, self.name, self.value)

    def restore(self) -> None:
        if self.old is _ABSENT:
            if hasattr(self.target, self.name):
                delattr(self.target, self.name)
        else:
            setattr(self.target, self.name, self.old)


def required_names(version: str, layout: str, name: str, ops: dict[str, Any]) -> set[str]:
    """The kvcacheio names required module ``name`` imports; ``ValueError`` when it imports none
    or one this project lacks."""
    try:
        names = imported_names(module_source(name), KVCACHEIO_SOURCES)
    except (ValueError, SyntaxError) as e:
        raise ValueError(f"SGLang {version} ({layout} layout): {e}") from e
    if not names:
        raise ValueError(
            f"SGLang {version} ({layout} layout): {name} imports no kvcacheio op from "
            f"{' or '.join(KVCACHEIO_SOURCES)}; sglang_compat does not recognise its layout"
        )
    missing = sorted(names - set(ops))
    if missing:
        raise ValueError(
            f"SGLang {version} ({layout} layout): {name} imports {missing} from "
            f"sgl_kernel.kvcacheio, which this project's kernels do not provide"
        )
    return names


def plan_rebinding(
    required_names: dict[str, set[str]],
    ops: dict[str, Any],
    route_around_jit: bool,
) -> tuple[
    dict[str, tuple[str, ...]],
    dict[str, tuple[str, ...]],
    dict[str, tuple[str, ...]],
    list[Binding],
]:
    """Every module binding to apply: the required modules, then other imported modules under
    :data:`SCANNED_PACKAGE` whose kvcacheio imports this project covers (others are skipped).
    Only names imported at module level are bound; names imported inside functions resolve
    through ``sgl_kernel.kvcacheio`` when called (returned per module, third)."""
    others = sorted(
        name
        for name, mod in list(sys.modules.items())
        if name.startswith(SCANNED_PACKAGE) and name not in required_names and mod is not None
    )
    patched: dict[str, tuple[str, ...]] = {}
    skipped: dict[str, tuple[str, ...]] = {}
    at_call: dict[str, tuple[str, ...]] = {}
    bindings: list[Binding] = []
    for name in [*required_names, *others]:
        module = sys.modules[name]
        if name in required_names:
            names = required_names[name]
            source = module_source(name)
        else:
            if not _mentions_kvcacheio(module):
                continue
            try:
                source = module_source(name)
                names = imported_names(source, KVCACHEIO_SOURCES)
            except (ValueError, SyntaxError):
                continue
            missing = tuple(sorted(names - set(ops)))
            if missing:
                skipped[name] = missing
                continue
            if not names:
                continue
        bound = names & imported_names(source, KVCACHEIO_SOURCES, module_level=True)
        if names - bound:
            at_call[name] = tuple(sorted(names - bound))
        if bound:
            bindings += [Binding(module, n, ops[n]) for n in sorted(bound)]
            patched[name] = tuple(sorted(bound))
        if route_around_jit:
            jit = imported_names(source, JIT_SOURCES, only_ops=False, module_level=True)
            bindings += [
                Binding(module, n, _false_predicate) for n in sorted(jit & set(JIT_PREDICATES))
            ]
    return patched, skipped, at_call, bindings


def _mentions_kvcacheio(module: types.ModuleType) -> bool:
    """Cheap filter before parsing a module: does its source file mention kvcacheio at all?"""
    path = getattr(module, "__file__", None)
    if not path or not path.endswith(".py"):
        return False
    try:
        with open(path, encoding="utf-8") as f:
            return "kvcacheio" in f.read()
    except OSError:
        return False
