"""Test configuration: CPU Triton interpretation, the ``gpu`` marker, repository on sys.path,
sharding and per-test progress lines for ``bench/gpu_check.sh`` (``HICACHE_TEST_SHARD``,
``HICACHE_TEST_PROGRESS``), the ``one_torch_thread`` fixture (modules running the tiny model use
it with ``pytestmark = pytest.mark.usefixtures("one_torch_thread")``), and the loopback shim.

Loopback shim: where Mooncake's engine is installed, a pytest run re-executes itself once under
``LD_PRELOAD`` of the loopback shim (``tests.support.loopback``), because the Mooncake tests
start transfer engines in this process and an engine's listeners would otherwise bind every
interface. ``HICACHE_LOOPBACK_REEXEC=0`` turns this off (those tests then skip). Children of the
test process do not inherit ``LD_PRELOAD``."""

from __future__ import annotations

import os
import sys
from collections.abc import Iterator

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if ROOT not in sys.path:
    sys.path.insert(0, ROOT)

# Before any test module imports triton.
from hicache_prefill.kernels._env import cuda_available, ensure_triton_interpret  # noqa: E402

ensure_triton_interpret()

HAS_CUDA = cuda_available()


def pytest_configure(config: pytest.Config) -> None:
    from hicache_prefill.hicache.storage.mooncake import availability
    from tests.support import loopback

    if availability.shim_loaded():
        loopback.forget_preload()
        return
    if "pytest" not in os.path.basename(os.path.dirname(sys.argv[0])) + sys.argv[0]:
        return  # pytest.main() inside another program: not re-executed
    if not availability.installed():
        return  # the Mooncake tests skip with their one line
    env = loopback.reexec_env()
    if env is None:
        return
    capman = config.pluginmanager.getplugin("capturemanager")
    if capman is not None:
        capman.stop_global_capturing()  # the new process gets the terminal, not capture files
    loopback.reexec_under_shim(env)


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    _keep_shard(config, items)
    if HAS_CUDA:
        return
    skip = pytest.mark.skip(reason="needs a CUDA device")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


def _keep_shard(config: pytest.Config, items: list[pytest.Item]) -> None:
    """``HICACHE_TEST_SHARD=i/n``: keep the ``i``-th of ``n`` contiguous blocks of the collected
    tests (``bench/gpu/precompile.py`` runs the kernel tests in parallel shards)."""
    shard = os.environ.get("HICACHE_TEST_SHARD")
    if not shard:
        return
    i, n = (int(x) for x in shard.split("/"))
    lo, hi = len(items) * i // n, len(items) * (i + 1) // n
    config.hook.pytest_deselected(items=items[:lo] + items[hi:])
    items[:] = items[lo:hi]


def pytest_runtest_logstart(nodeid: str, location: tuple) -> None:
    """``HICACHE_TEST_PROGRESS=1``: one line per test as it starts, so a run cut short by a
    time limit (``bench/gpu_check.sh``) names the test it was in."""
    if os.environ.get("HICACHE_TEST_PROGRESS"):
        print(f"[test] start {nodeid}", file=sys.stderr, flush=True)


@pytest.fixture
def one_torch_thread() -> Iterator[None]:
    """One intra-op torch thread for the test (see
    ``tests.support.harness.single_torch_thread``)."""
    from tests.support.harness import single_torch_thread

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
