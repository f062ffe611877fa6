"""The shared Mooncake set-up (``availability``, ``tests.support.loopback``): availability checks
and their one-line reasons, and the loopback shim (build, preload environment, what it does to
a wildcard bind)."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys

import pytest

from hicache_prefill.hicache.storage.mooncake import availability
from tests.support import loopback


def test_reasons_are_one_line_or_none() -> None:
    reasons = [availability.wheel_reason(), availability.ibverbs_reason()]
    for module in ("engine", "store"):
        reasons += [availability.module_reason(module), loopback.skip_reason(module)]
    for reason in reasons:
        assert reason is None or (reason and "\n" not in reason)
    assert availability.installed() == (availability.wheel_reason() is None
                                        and availability.ibverbs_reason() is None)  # fmt: skip
    if availability.module_reason("engine") is None:
        assert availability.installed()


def test_module_reason_names_the_argument() -> None:
    with pytest.raises(ValueError, match="module='bogus'"):
        availability.module_reason("bogus")


def test_missing_wheel_and_library_are_named(monkeypatch: pytest.MonkeyPatch) -> None:
    import importlib.util

    for f in (availability.wheel_reason, availability.ibverbs_reason, availability.module_reason):
        f.cache_clear()
    monkeypatch.setattr(importlib.util, "find_spec", lambda name: None)
    monkeypatch.setattr(availability, "IBVERBS", "libno-such-library-here.so.1")
    try:
        assert availability.wheel_reason() == (
            f"the Mooncake wheel is not installed (pip install {availability.WHEEL})"
        )
        assert "libno-such-library-here.so.1 does not load" in availability.ibverbs_reason()
        assert not availability.installed()
        assert loopback.skip_reason("store").startswith("Mooncake unavailable: the Mooncake "
                                                            "wheel is not installed")  # fmt: skip
    finally:
        for f in (availability.wheel_reason, availability.ibverbs_reason,
                  availability.module_reason):  # fmt: skip
            f.cache_clear()


def test_loopback_hosts() -> None:
    assert availability.is_loopback("127.0.0.1") and availability.is_loopback("localhost")
    assert availability.is_loopback("::1") and not availability.is_loopback("10.0.0.1")
    assert not availability.is_loopback("example.invalid")
    assert loopback.non_loopback([("127.0.0.1:5", 1), ("[::ffff:127.0.0.1]:6", 1),
                                  ("0.0.0.0:7", 2), ("[::]:8", 2)]) == [("0.0.0.0:7", 2),
                                                                         ("[::]:8", 2)]  # fmt: skip


@pytest.mark.skipif(shutil.which("cc") is None and shutil.which("gcc") is None,
                    reason="no C compiler for the loopback shim")  # fmt: skip
def test_shim_turns_wildcard_binds_into_loopback() -> None:
    """A child under ``preload_env()`` binding ``0.0.0.0`` and ``::`` listens on loopback only
    (``getsockname``), and its environment names the shim first in ``LD_PRELOAD``."""
    env = loopback.preload_env({**os.environ, "LD_PRELOAD": "/nonexistent-other.so"})
    assert env["LD_PRELOAD"].split(":")[0] == str(availability.shim_path())
    assert env[availability.SHIM_ENV] == str(availability.shim_path())
    env["LD_PRELOAD"] = str(availability.shim_path())  # the other one does not exist
    code = (
        "import socket\n"
        "a = socket.socket(); a.bind(('0.0.0.0', 0)); a.listen()\n"
        "b = socket.socket(socket.AF_INET6); b.bind(('::', 0)); b.listen()\n"
        "print(a.getsockname()[0], b.getsockname()[0])\n"
    )
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True,
                         check=True, timeout=60).stdout.split()  # fmt: skip
    assert out == ["127.0.0.1", "::ffff:127.0.0.1"]


def test_require_loopback_engines_refuses_without_the_shim(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(availability, "shim_loaded", lambda: False)
    with pytest.raises(RuntimeError, match="LD_PRELOAD="):
        availability.require_loopback_engines("127.0.0.1")
    availability.require_loopback_engines("10.1.2.3")  # a routable host: no shim needed
