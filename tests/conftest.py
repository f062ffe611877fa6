"""Test configuration: CPU Triton interpretation, the ``gpu`` marker, repository on sys.path, the
``one_torch_thread`` fixture (modules running the tiny model use it with
``pytestmark = pytest.mark.usefixtures("one_torch_thread")``), and the loopback shim.

Loopback shim: where Mooncake's engine is installed, a pytest run re-executes itself once under
``LD_PRELOAD`` of the loopback shim (``prefill.disagg.mooncake.loopback``), because the
Mooncake tests start prefill-side transfer engines in this process and an engine's listeners
would otherwise bind every interface. ``HICACHE_LOOPBACK_REEXEC=0`` turns this off (those tests
then skip). Children of the test process do not inherit ``LD_PRELOAD``."""

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


def pytest_configure(config: pytest.Config) -> None:
    from prefill.disagg.mooncake import loopback

    if loopback.shim_loaded():
        loopback.forget_preload()
        return
    if "pytest" not in os.path.basename(os.path.dirname(sys.argv[0])) + sys.argv[0]:
        return  # pytest.main() inside another program: not re-executed
    env = loopback.reexec_env()
    if env is None:
        return
    capman = config.pluginmanager.getplugin("capturemanager")
    if capman is not None:
        capman.stop_global_capturing()  # the new process gets the terminal, not capture files
    loopback.reexec_under_shim(env)


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
