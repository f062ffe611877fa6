"""What :func:`kernels.sglang.compat.install` rebinds in SGLang's modules, read from their source:
SGLang imports the kvcacheio ops under platform ``if`` branches that never ran on a machine
without CUDA, so the names are read from the text. :func:`plan_rebinding` lists every
:class:`Binding`; nothing is applied here. Imports nothing of SGLang or of this project.
"""

from __future__ import annotations

import ast
import importlib.util
import sys
import types
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

KVCACHEIO_SOURCES: tuple[str, ...] = (
    "sgl_kernel.kvcacheio",
    "sglang.srt.mem_cache.pool_host._kvcacheio",  # 0.5.23's per-op binding module (XPU)
)
JIT_SOURCES: tuple[str, ...] = (
    "sglang.kernels.ops.kvcache.hicache",  # 0.5.17+
    "sglang.jit_kernel.hicache",  # 0.5.14
)
JIT_PREDICATES: tuple[str, ...] = ("can_use_hicache_jit_kernel", "can_use_write_back_jit_kernel")

SCANNED_PACKAGE = "sglang.srt.mem_cache."  # other imported modules here are rebound too

_ABSENT = object()
Names = dict[str, tuple[str, ...]]  # module -> names


def _false_predicate(*args: Any, **kwargs: Any) -> bool:
    return False


def imported_names(
    source: str, sources: Sequence[str], only_ops: bool = True, module_level: bool = False
) -> set[str]:
    """Names ``source`` imports from any of ``sources``, at any nesting. From a module other than
    ``sgl_kernel.kvcacheio`` (0.5.23's ``_kvcacheio`` also exports helpers) only op names count,
    unless ``only_ops=False``. ``module_level``: only imports that bind module globals."""
    names: set[str] = set()
    for node in _import_nodes(ast.parse(source), module_level):
        if node.module in sources and node.level == 0:
            for alias in node.names:
                if not only_ops or node.module == "sgl_kernel.kvcacheio" or _is_op(alias.name):
                    names.add(alias.name)
    return names


_SCOPES = (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda, ast.ClassDef)


def _import_nodes(tree: ast.AST, module_level: bool) -> list[ast.ImportFrom]:
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
    """The source text of module ``name``, imported or not; ``ValueError`` if unreadable."""
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
    """One name to set on a module or object, with what it held before (restored exactly)."""

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
) -> tuple[Names, Names, Names, list[Binding]]:
    """Bindings for the required modules, then for other imported modules under
    ``SCANNED_PACKAGE`` whose kvcacheio imports this project covers. Only module-level imports
    are bound; names imported inside functions resolve at call (returned third)."""
    others = sorted(
        name
        for name, mod in list(sys.modules.items())
        if name.startswith(SCANNED_PACKAGE) and name not in required_names and mod is not None
    )
    patched: Names = {}
    skipped: Names = {}
    at_call: Names = {}
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
    """Cheap filter before parsing a module's source."""
    path = getattr(module, "__file__", None)
    if not path or not path.endswith(".py"):
        return False
    try:
        with open(path, encoding="utf-8") as f:
            return "kvcacheio" in f.read()
    except OSError:
        return False
