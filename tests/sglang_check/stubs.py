"""Load SGLang's own modules from an installed release with only unrelated imports stubbed.

Three kinds of replacement, each listed with its reason in :data:`STUBS` / :data:`BARE_PACKAGES`
and reported by :func:`report`:

- a **bare package**: the package's ``__init__.py`` is not run (it imports the whole runtime);
  its submodules still load from the installed files, unmodified.
- a **stub module**: a module that SGLang's host-pool or argument modules import for something
  unrelated to KV transfer. It carries the attributes listed for it; any other attribute is a
  :class:`Placeholder` that raises :class:`StubUsed` when called, so a placeholder reached on a
  transfer path fails the check instead of passing silently.
- everything else is SGLang's file as installed.

Nothing here imports SGLang at import time; :func:`install_importer` is called by the check
process with the pin's site directory first on ``sys.path``.
"""

from __future__ import annotations

import importlib.abc
import importlib.machinery
import importlib.util
import logging
import sys
import types
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

logger = logging.getLogger(__name__)


class StubUsed(RuntimeError):
    """A placeholder from a stubbed module was called: the stub list is wrong for this path."""


class Placeholder:
    """Stands for a name a stubbed module would provide; raises when used as a callable."""

    def __init__(self, qualname: str) -> None:
        self._qualname = qualname

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        raise StubUsed(f"{self._qualname} is a stub placeholder and was called")

    def __getattr__(self, name: str) -> Placeholder:
        if name.startswith("__"):
            raise AttributeError(name)
        return Placeholder(f"{self._qualname}.{name}")

    def __mro_entries__(self, bases: tuple) -> tuple:
        # ``class X(StubbedBase): ...`` at module level: an empty base of its own.
        return (type(self._qualname.rsplit(".", 1)[-1], (), {}),)

    def __repr__(self) -> str:
        return f"<stub {self._qualname}>"


@dataclass
class Stub:
    """One stubbed module: why, and the attributes it provides (others become placeholders)."""

    reason: str
    attrs: Callable[[], dict[str, Any]] = dict
    accessed: set[str] = field(default_factory=set)


class StubModule(types.ModuleType):
    """A module whose unknown attributes are recorded :class:`Placeholder`s."""

    def __init__(self, name: str, stub: Stub) -> None:
        super().__init__(name)
        self.__dict__["_stub"] = stub
        self.__path__: list[str] = []  # may be a parent of further stubbed modules
        self.__dict__.update(stub.attrs())

    def __getattr__(self, name: str) -> Any:
        if name.startswith("__"):
            raise AttributeError(name)
        stub = self.__dict__["_stub"]
        stub.accessed.add(name)
        value = Placeholder(f"{self.__name__}.{name}")
        setattr(self, name, value)
        return value


class _StubLoader(importlib.abc.Loader):
    def __init__(self, stub: Stub | None, bare_path: list[str] | None, origin: str | None):
        self.stub, self.bare_path, self.origin = stub, bare_path, origin

    def create_module(self, spec: importlib.machinery.ModuleSpec) -> types.ModuleType:
        if self.stub is not None:
            return StubModule(spec.name, self.stub)
        module = types.ModuleType(spec.name)
        module.__path__ = list(self.bare_path or [])
        module.__file__ = self.origin
        return module

    def exec_module(self, module: types.ModuleType) -> None:  # nothing to run
        return None


class StubFinder(importlib.abc.MetaPathFinder):
    """Serves the stub modules and bare packages; defers everything else to the normal finders."""

    def __init__(self, stubs: dict[str, Stub], bare: dict[str, str]) -> None:
        self.stubs, self.bare = stubs, bare
        self.bare_loaded: set[str] = set()

    def find_spec(self, fullname: str, path: Any = None, target: Any = None):
        if fullname in self.stubs:
            loader = _StubLoader(self.stubs[fullname], None, None)
            return importlib.machinery.ModuleSpec(fullname, loader, is_package=True)
        if fullname in self.bare:
            real = importlib.machinery.PathFinder.find_spec(fullname, path)
            if real is None or real.submodule_search_locations is None:
                return None
            self.bare_loaded.add(fullname)
            loader = _StubLoader(None, list(real.submodule_search_locations), real.origin)
            spec = importlib.machinery.ModuleSpec(fullname, loader, is_package=True)
            spec.submodule_search_locations = list(real.submodule_search_locations)
            return spec
        return None


_FINDER: StubFinder | None = None


def install_importer(stubs: dict[str, Stub], bare: dict[str, str]) -> StubFinder:
    """Put the stub finder first on ``sys.meta_path`` (once per process)."""
    global _FINDER
    if _FINDER is None:
        _FINDER = StubFinder(stubs, bare)
        sys.meta_path.insert(0, _FINDER)
    return _FINDER


def report(finder: StubFinder) -> list[dict[str, Any]]:
    """Every replacement that was actually used in this process, with its reason."""
    rows: list[dict[str, Any]] = []
    for name in sorted(finder.bare_loaded):
        rows.append({"module": name, "kind": "bare package", "reason": finder.bare[name]})
    for name, stub in sorted(finder.stubs.items()):
        if name in sys.modules and isinstance(sys.modules[name], StubModule):
            rows.append(
                {
                    "module": name,
                    "kind": "stub",
                    "reason": stub.reason,
                    "provided": sorted(stub.attrs()),
                    "placeholders": sorted(stub.accessed),
                }
            )
    return rows
