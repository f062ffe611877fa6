"""The project installs as one namespace, ``hicache_prefill``, and imports itself only through it:
no top-level ``kernels`` (HuggingFace's import name, which SGLang depends on), ``hicache``,
``prefill`` or ``server_args`` is installed or imported."""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
NAMESPACE = "hicache_prefill"
FOLDERS = ("kernels", "hicache", "prefill")
TOP_LEVEL = {*FOLDERS, "server_args"}
# The SGLang check imports HuggingFace's ``kernels`` on purpose (to prove it is not shadowed).
HF_KERNELS_IMPORTERS = {"tests/sglang_check/run_pin.py"}


def test_every_package_is_listed_under_the_namespace() -> None:
    tomllib = pytest.importorskip("tomllib")  # Python 3.11+
    config = tomllib.loads((REPO / "pyproject.toml").read_text())["tool"]["setuptools"]
    assert config["package-dir"] == {NAMESPACE: "."}
    folders = {
        ".".join((NAMESPACE, *init.parent.relative_to(REPO).parts))
        for folder in FOLDERS
        for init in (REPO / folder).rglob("__init__.py")
    }
    assert set(config["packages"]) == {NAMESPACE, *folders}


def _tracked_python() -> list[Path]:
    out = subprocess.run(
        ["git", "ls-files", "*.py"], cwd=REPO, capture_output=True, text=True, check=False
    )
    if out.returncode:
        pytest.skip("not a git checkout")
    return [REPO / name for name in out.stdout.split()]


def test_no_file_imports_the_project_by_a_top_level_name() -> None:
    offenders = []
    for path in _tracked_python():
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            names = []
            if isinstance(node, ast.Import):
                names = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
                names = [node.module]
            for name in names:
                top = name.split(".")[0]
                allowed = top == "kernels" and str(path.relative_to(REPO)) in HF_KERNELS_IMPORTERS
                if top in TOP_LEVEL and not allowed:
                    offenders.append(f"{path.relative_to(REPO)}:{node.lineno}: {name}")
    assert not offenders, offenders


def test_the_namespace_resolves_to_this_checkout() -> None:
    import hicache_prefill.kernels as project

    assert Path(project.__file__).resolve() == REPO / "kernels" / "__init__.py"
    code = "import importlib.util, sys; sys.exit(importlib.util.find_spec('kernels') is not None)"
    outside = subprocess.run([sys.executable, "-c", code], cwd="/", check=False)
    assert outside.returncode == 0, "a top-level `kernels` is importable outside the checkout"
