"""Mooncake settings: SGLang's three sources and their precedence, its defaults, and one
``ValueError`` naming the key, variable or file for each bad value."""

from __future__ import annotations

import json

import pytest

from hicache_prefill.hicache.storage.config import parse_size
from hicache_prefill.hicache.storage.mooncake.config import (
    ENV_CONFIG_PATH,
    device_for_rank,
    load_mooncake_config,
)

MASTER = {"master_server_address": "127.0.0.1:50051"}


def test_extra_config_wins_and_missing_keys_take_sglangs_defaults_not_the_environment():
    env = {"MOONCAKE_MASTER": "10.0.0.1:1", "MOONCAKE_GLOBAL_SEGMENT_SIZE": "1gb",
           ENV_CONFIG_PATH: "/nonexistent.json"}  # fmt: skip
    c = load_mooncake_config({**MASTER, "global_segment_size": "2gb"}, env)
    assert c.master_server_address == "127.0.0.1:50051"
    assert c.global_segment_size == 2 << 30
    assert (c.local_hostname, c.metadata_server, c.protocol, c.device_name) == (
        "localhost", "P2PHANDSHAKE", "rdma", "")  # fmt: skip
    assert c.source("global_segment_size").startswith("extra config")
    c = load_mooncake_config(MASTER, env)
    assert c.global_segment_size == 4 << 30  # SGLang: the default, not MOONCAKE_GLOBAL_...


def test_protocol_and_local_hostname_follow_the_environment_in_every_source():
    env = {"MOONCAKE_PROTOCOL": "tcp", "MOONCAKE_LOCAL_HOSTNAME": "node7"}
    c = load_mooncake_config({**MASTER, "local_hostname": "ignored"}, env)
    assert (c.protocol, c.local_hostname) == ("tcp", "node7")
    assert load_mooncake_config({**MASTER, "protocol": "rdma"}, env).protocol == "rdma"
    assert load_mooncake_config(MASTER, {"LOCAL_HOSTNAME": "n2"}).local_hostname == "n2"


def test_json_file_then_environment(tmp_path):
    path = tmp_path / "mc.json"
    path.write_text(json.dumps({"master_server_address": "127.0.0.1:7", "protocol": "tcp",
                                "global_segment_size": 123456, "tenant_id": " "}))  # fmt: skip
    c = load_mooncake_config({}, {ENV_CONFIG_PATH: str(path), "MOONCAKE_MASTER": "x:1"})
    assert (c.master_server_address, c.protocol, c.global_segment_size) == (
        "127.0.0.1:7",
        "tcp",
        123456,
    )
    assert c.tenant_id == "default" and ENV_CONFIG_PATH in c.source("protocol")
    env = {"MOONCAKE_MASTER": "127.0.0.1:9", "MOONCAKE_PROTOCOL": "tcp",
           "MOONCAKE_GLOBAL_SEGMENT_SIZE": "512mb", "MOONCAKE_CHECK_SERVER": "1",
           "MOONCAKE_TENANT_ID": "t1"}  # fmt: skip
    c = load_mooncake_config(None, env)
    assert (c.master_server_address, c.global_segment_size, c.check_server, c.tenant_id) == (
        "127.0.0.1:9", 512 << 20, True, "t1")  # fmt: skip
    assert c.source("master_server_address") == "environment variable MOONCAKE_MASTER"


@pytest.mark.parametrize(
    "extra, env, match",
    [
        ({}, {}, "no Mooncake master configured.*MOONCAKE_MASTER"),
        ({"master_server_address": "nohost"}, {}, "'master_server_address'.*host:port"),
        ({"master_server_address": "h:70000"}, {}, "host:port"),
        ({**MASTER, "global_segment_size": "4 parsecs"}, {}, "'global_segment_size'"),
        ({**MASTER, "global_segment_size": -1}, {}, "'global_segment_size'"),
        ({**MASTER, "protocol": ""}, {}, "'protocol'.*non-empty"),
        ({**MASTER, "check_server": "maybe"}, {}, "'check_server'.*true or false"),
        ({**MASTER, "master_metrics_port": "x"}, {}, "'master_metrics_port'"),
        ({**MASTER, "standalone_storage": True}, {}, "dummy-client mode"),
        ({"client_server_address": "127.0.0.1:50052"}, {}, "dummy-client mode"),
        (
            {},
            {"MOONCAKE_MASTER": "127.0.0.1:1", "MOONCAKE_CHECK_SERVER": "yes please"},
            "MOONCAKE_CHECK_SERVER",
        ),
        ({}, {ENV_CONFIG_PATH: "/nonexistent/mc.json"}, f"{ENV_CONFIG_PATH}.*cannot read"),
    ],
)
def test_bad_settings_raise_naming_the_source(extra, env, match):
    with pytest.raises(ValueError, match=match):
        load_mooncake_config(extra, env)


def test_a_config_file_without_a_master_or_not_an_object(tmp_path):
    path = tmp_path / "mc.json"
    path.write_text(json.dumps({"protocol": "tcp"}))
    with pytest.raises(ValueError, match="neither master_server_address"):
        load_mooncake_config({}, {ENV_CONFIG_PATH: str(path)})
    path.write_text("[1, 2]")
    with pytest.raises(ValueError, match="JSON object"):
        load_mooncake_config({}, {ENV_CONFIG_PATH: str(path)})


def test_segment_sizes_in_sglangs_and_this_projects_forms():
    assert parse_size("4gb", "k") == parse_size("4GB", "k") == 4 << 30
    assert parse_size("64mb", "k") == 64 << 20
    assert parse_size("1Gi", "k") == 1 << 30 and parse_size("2G", "k") == 2 * 10**9
    assert parse_size(0, "k") == 0 and parse_size("17", "k") == 17


def test_per_rank_devices_from_sglangs_json_form():
    table = '{"0": "mlx5_0,mlx5_1", "1": "mlx5_2"}'
    assert device_for_rank(table, 1, "k") == "mlx5_2"
    assert device_for_rank(table, 3, "k") == ""
    assert device_for_rank("mlx5_0", 5, "k") == "mlx5_0"
    with pytest.raises(ValueError, match="device"):
        device_for_rank("{not json", 0, "device")
