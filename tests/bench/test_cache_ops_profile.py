"""Smoke test of the tree profile of ``bench_cache_ops`` at its smallest size."""

from __future__ import annotations

import pytest

from bench.cache_ops.profile import PARTS, profile
from bench.cache_ops.trace import ProjectDriver, ProjectListDriver


@pytest.mark.parametrize("driver", [ProjectDriver, ProjectListDriver])
def test_profile_splits_match_and_insert_into_parts(driver) -> None:
    r = profile(10_000, page_size=16, steps=20, driver=driver)
    for op in ("match", "insert"):
        assert r[op]["total"] > 0 and r[op]["nodes"] > 0
        assert set(PARTS) | {"rest", "total", "warm", "nodes", "splits"} == set(r[op])
    assert r["match"]["cat"] > 0 and r["insert"]["clone"] > 0 and r["match"]["warm"] > 0
