"""The benchmark's SGLang loader: bad sites are refused untouched, every replacement is documented.

Only the refusing path runs here: a successful ``install`` puts a process-wide import finder in
place that stubs packages (PIL, requests, pydantic) the rest of the suite may import.
"""

from __future__ import annotations

import sys

import pytest

from bench.cache_ops import sglang_loader
from bench.cache_ops.sglang_trees import load_sglang


def test_site_without_sglang_is_refused_and_nothing_changes(tmp_path) -> None:
    path, meta = list(sys.path), list(sys.meta_path)
    with pytest.raises(ValueError, match="site="):
        sglang_loader.install(str(tmp_path))
    assert sys.path == path and sys.meta_path == meta


def test_load_sglang_reports_a_bad_site_instead_of_raising(tmp_path) -> None:
    meta = list(sys.meta_path)
    sgl, note = load_sglang(str(tmp_path))
    assert sgl is None and "site=" in note and str(tmp_path) in note
    assert sys.meta_path == meta


def test_every_replacement_is_named_in_the_module_docstring() -> None:
    doc = sglang_loader.__doc__
    names = list(sglang_loader.BARE_PACKAGES) + list(sglang_loader.stubs())
    assert names, "no replacements listed"
    for name in names:
        assert f"``{name}``" in doc, name
    for name, stub in sglang_loader.stubs().items():
        assert stub.reason and not stub.accessed, name
