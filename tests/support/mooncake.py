"""What the tests that run a real Mooncake share: the skip marker (one line saying what is
missing: the wheel, ``libibverbs.so.1`` or a C compiler for the loopback shim; ``make test``
installs the first two where it can) and the ``mooncake_master`` fixture (a master on loopback,
stopped by its pid when the test ends, failed or not)."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from tests.support.loopback import skip_reason
from tests.support.mooncake_master import MooncakeMaster


def missing() -> str | None:
    """Why the real-Mooncake tests cannot run here (``mooncake.store`` or the loopback shim),
    or ``None``."""
    return skip_reason("store")


needs_mooncake = pytest.mark.skipif(missing() is not None, reason=missing() or "")


@pytest.fixture
def mooncake_master(request: pytest.FixtureRequest) -> Iterator[MooncakeMaster]:
    """A master on free loopback ports for one test; stopped by its pid afterwards."""
    master = MooncakeMaster.start()
    request.addfinalizer(master.stop)
    yield master
