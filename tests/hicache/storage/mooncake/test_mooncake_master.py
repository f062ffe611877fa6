"""The master launcher against the real ``mooncake_master``: loopback only, ready when it
returns, pid recorded, exactly that process stopped; a port in use and a missing master are one
``ValueError`` naming the setting; a connected master is never stopped."""

from __future__ import annotations

import socket

import pytest

from tests.support.loopback import non_loopback, tcp_listeners
from tests.support.mooncake import mooncake_master, needs_mooncake
from tests.support.mooncake_master import MooncakeMaster, free_port

pytestmark = needs_mooncake
__all__ = ["mooncake_master"]


def test_start_serves_on_loopback_and_stop_ends_that_pid(mooncake_master):
    m = mooncake_master
    assert m.owned and m.is_alive() and m.address.startswith("127.0.0.1:")
    assert m.health()["service_ready"] is True
    listeners = tcp_listeners([m.pid])
    ports = {int(addr.rsplit(":", 1)[1]) for addr, _ in listeners}
    assert {m.rpc_port, m.metrics_port} <= ports
    assert non_loopback(listeners) == []  # no 0.0.0.0, no HTTP metadata server on 8080
    assert m.stop() == 0 and not m.is_alive()
    assert m.stop() == 0  # idempotent


def test_a_port_in_use_is_named():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen()
        port = s.getsockname()[1]
        with pytest.raises(ValueError, match=f"rpc_port={port} is in use"):
            MooncakeMaster.start(rpc_port=port)
        with pytest.raises(ValueError, match=f"metrics_port={port} is in use"):
            MooncakeMaster.start(metrics_port=port)
    with pytest.raises(ValueError, match="undo the loopback binding"):
        MooncakeMaster.start(flags=["--rpc_address=0.0.0.0"])


def test_restart_keeps_the_address_and_connect_never_stops_it(mooncake_master):
    m = mooncake_master
    again = m.restart()
    try:
        assert not m.is_alive() and again.is_alive() and again.address == m.address
        assert again.pid != m.pid
        other = MooncakeMaster.connect(again.address)
        assert not other.owned and other.stop() is None and again.is_alive()
    finally:
        again.stop()
    with pytest.raises(ValueError, match="master_server_address=.*nothing accepts"):
        MooncakeMaster.connect(f"127.0.0.1:{free_port()}")
