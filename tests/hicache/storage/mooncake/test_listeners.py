"""``tests.support.loopback.tcp_listeners`` reads ``/proc`` (no ``ss`` needed on a fresh CI
image): every listener of a pid, with its address as ``ss`` writes it, IPv4 and IPv6 (wildcard,
loopback, IPv4-mapped; under the loopback shim the wildcards come out as loopback); the same set
as ``ss -ltnp`` where ``ss`` exists; ``non_loopback`` keeps the wildcards."""

from __future__ import annotations

import os
import re
import shutil
import socket
import subprocess

import pytest

from hicache_prefill.hicache.storage.mooncake.availability import shim_loaded
from tests.support.loopback import non_loopback, tcp_listeners


def _listen(family: int, host: str) -> socket.socket:
    s = socket.socket(family, socket.SOCK_STREAM)
    s.bind((host, 0))
    s.listen()
    return s


def test_listeners_of_this_process_with_their_addresses():
    socks = [_listen(socket.AF_INET, "127.0.0.1"), _listen(socket.AF_INET, "0.0.0.0")]
    try:
        socks += [_listen(socket.AF_INET6, "::1"), _listen(socket.AF_INET6, "::"),
                  _listen(socket.AF_INET6, "::ffff:127.0.0.1")]  # fmt: skip
    except OSError:
        pytest.skip("no IPv6 on this machine")
    try:
        ports = [s.getsockname()[1] for s in socks]
        mine = {addr for addr, pid in tcp_listeners([os.getpid()]) if pid == os.getpid()}
        shim = shim_loaded()  # pytest runs under the loopback shim where Mooncake is installed
        any4, any6 = ("127.0.0.1", "[::ffff:127.0.0.1]") if shim else ("0.0.0.0", "[::]")
        want = {f"127.0.0.1:{ports[0]}", f"{any4}:{ports[1]}", f"[::1]:{ports[2]}",
                f"{any6}:{ports[3]}", f"[::ffff:127.0.0.1]:{ports[4]}"}  # fmt: skip
        assert want <= mine
        wild = {a for a, _ in non_loopback([(a, 0) for a in want])}
        assert wild == (set() if shim else {f"0.0.0.0:{ports[1]}", f"[::]:{ports[3]}"})
        assert non_loopback([(f"0.0.0.0:{ports[1]}", 1), (f"[::]:{ports[3]}", 1)]) == [
            (f"0.0.0.0:{ports[1]}", 1), (f"[::]:{ports[3]}", 1)]  # fmt: skip
        if shutil.which("ss"):  # the same listeners as ss sees (its v6 wildcard is "*" or "[::]")
            out = subprocess.run(["ss", "-ltnpH"], capture_output=True, text=True).stdout
            seen = {line.split()[3].replace("*:", "[::]:") for line in out.splitlines()
                    if re.search(rf"pid={os.getpid()},", line)}  # fmt: skip
            assert seen == mine
        assert tcp_listeners([2**22 + 12345]) == []  # no such pid: nothing
    finally:
        for s in socks:
            s.close()
