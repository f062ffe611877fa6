"""Test configuration: CPU Triton interpretation, the ``gpu`` marker, repository on sys.path, and
the ``one_torch_thread`` fixture (modules running the tiny model use it with
``pytestmark = pytest.mark.usefixtures("one_torch_thread")``)."""

from __future__ import annotations

import os
import sys
from collections.abc import Iterator

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if ROOT not in sys.path:
    sys.path.insert(0, ROOT)

# Before any test module imports triton.
from kernels._env import cuda_available, ensure_triton_interpret  # noqa: E402

ensure_triton_interpret()

HAS_CUDA = cuda_available()


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    if HAS_CUDA:
        return
    skip = pytest.mark.skip(reason="needs a CUDA device")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


@pytest.fixture
def one_torch_thread() -> Iterator[None]:
    """One intra-op torch thread for the test (see
    ``prefill.testing.harness.single_torch_thread``)."""
    from prefill.testing.harness import single_torch_thread

    with single_torch_thread():
        yield


@pytest.fixture(params=("thread", "inline"))
def stream_mode(request: pytest.FixtureRequest) -> str:
    """The CPU stream mode of the cache a test builds (``build_kv_cache(args, streams=...)``):
    ``"thread"`` (copies on worker threads, acks arrive late) or ``"inline"`` (CUDA's launch
    semantics: a copy runs, and fails, inside the call that launches it). The controller, tree
    and executor stories take it; tests that hold copies at gates (which needs worker threads)
    and the long property tests run on thread streams only."""
    return str(request.param)
