"""``MooncakeStoreConfig``: where the Mooncake client finds its master (SGLang 0.5.23's fields,
sources, precedence and defaults). The first source that applies wins: the extra config when it
sets ``master_server_address``, else the JSON file in ``SGLANG_HICACHE_MOONCAKE_CONFIG_PATH``,
else the ``MOONCAKE_*`` environment. A key missing from a dict source takes the default, except
``protocol`` (``MOONCAKE_PROTOCOL``) and ``local_hostname`` (``MOONCAKE_LOCAL_HOSTNAME`` /
``LOCAL_HOSTNAME`` win over every source). Bad values raise ``ValueError`` naming their source.
"""

from __future__ import annotations

import json
import os
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from hicache_prefill.hicache.storage.config import FLAG, parse_size

ENV_CONFIG_PATH = "SGLANG_HICACHE_MOONCAKE_CONFIG_PATH"
DEFAULT_TENANT_ID = "default"

# field -> (environment variable, default); the keys are the extra-config / JSON keys.
FIELDS: dict[str, tuple[str, Any]] = {
    "master_server_address": ("MOONCAKE_MASTER", None),
    "local_hostname": ("MOONCAKE_LOCAL_HOSTNAME", "localhost"),
    "metadata_server": ("MOONCAKE_TE_META_DATA_SERVER", "P2PHANDSHAKE"),
    "global_segment_size": ("MOONCAKE_GLOBAL_SEGMENT_SIZE", "4gb"),
    "protocol": ("MOONCAKE_PROTOCOL", "rdma"),
    "device_name": ("MOONCAKE_DEVICE", ""),
    "master_metrics_port": ("MOONCAKE_MASTER_METRICS_PORT", 9003),
    "check_server": ("MOONCAKE_CHECK_SERVER", False),
    "standalone_storage": ("MOONCAKE_STANDALONE_STORAGE", False),
    "client_server_address": ("MOONCAKE_CLIENT", None),
    "enable_ssd_offload": ("MOONCAKE_ENABLE_SSD_OFFLOAD", False),
    "ssd_offload_path": ("MOONCAKE_OFFLOAD_FILE_STORAGE_PATH", None),
    "tenant_id": ("MOONCAKE_TENANT_ID", DEFAULT_TENANT_ID),
}
BACKEND_KEYS = frozenset(FIELDS) | {"extra_backend_tag", "enable_group_semantics"}

_TRUE = ("1", "true", "yes", "on")
_FALSE = ("0", "false", "no", "off", "")


@dataclass(frozen=True)
class MooncakeStoreConfig:
    """``sources`` names where each field came from."""

    master_server_address: str
    local_hostname: str = "localhost"
    metadata_server: str = "P2PHANDSHAKE"
    global_segment_size: int = 4 << 30
    protocol: str = "rdma"
    device_name: str = ""
    master_metrics_port: int = 9003
    check_server: bool = False
    standalone_storage: bool = False
    client_server_address: str | None = None
    enable_ssd_offload: bool = False
    ssd_offload_path: str | None = None
    tenant_id: str = DEFAULT_TENANT_ID
    sources: Mapping[str, str] = field(default_factory=dict, compare=False, repr=False)

    def source(self, name: str) -> str:
        return self.sources.get(name, f"the default {name}")

    def master_host_port(self) -> tuple[str, int] | None:
        return split_address(self.master_server_address, self.source("master_server_address"))


def split_address(address: str, name: str) -> tuple[str, int] | None:
    """``(host, port)`` of ``"host:port"`` (``[v6]:port`` too); ``None`` for ``etcd://...``."""
    if address.startswith("etcd://"):
        return None
    host, sep, port = address.rpartition(":")
    host = host.strip("[]")
    if not sep or not host or not port.isdigit() or not 0 < int(port) < 65536:
        raise ValueError(f"{name}={address!r} must be host:port (port in 1..65535)")
    return host, int(port)


def parse_bool(value: Any, name: str) -> bool:
    """A bool or ``1/0``, ``true/false``, ``yes/no``, ``on/off``."""
    if isinstance(value, bool):
        return value
    if isinstance(value, str) and value.strip().lower() in _TRUE + _FALSE:
        return value.strip().lower() in _TRUE
    raise ValueError(f"{name} must be true or false, got {value!r}")


def _text(value: Any, name: str, *, empty_ok: bool = False) -> str:
    if not isinstance(value, str) or (not empty_ok and not value.strip()):
        what = "a string" if empty_ok else "a non-empty string"
        raise ValueError(f"{name} must be {what}, got {value!r}")
    return value


def _port(value: Any, name: str) -> int:
    try:
        if isinstance(value, bool):
            raise TypeError
        port = int(value)
    except (TypeError, ValueError):
        raise ValueError(f"{name} must be a port number, got {value!r}") from None
    if not 0 < port < 65536:
        raise ValueError(f"{name}={value!r} must be in 1..65535")
    return port


_CHECKS = {
    "master_server_address": _text,
    "local_hostname": _text,
    "metadata_server": _text,
    "global_segment_size": parse_size,
    "protocol": _text,
    "device_name": lambda v, n: _text(v, n, empty_ok=True),
    "master_metrics_port": _port,
    "check_server": parse_bool,
    "standalone_storage": parse_bool,
    "client_server_address": _text,
    "enable_ssd_offload": parse_bool,
    "ssd_offload_path": _text,
    "tenant_id": lambda v, n: str(v).strip() or DEFAULT_TENANT_ID,
}


def _raw(values: Mapping[str, Any] | None, where: str, env: Mapping[str, str]) -> dict:
    """field -> (raw value, source) of a dict source (``values``) or, with ``None``, of ``env``."""
    out: dict[str, tuple[Any, str]] = {}
    for name, (var, default) in FIELDS.items():
        if values is not None and values.get(name) is not None:
            out[name] = (values[name], f"{where} key {name!r}")
        elif (values is None or name == "protocol") and env.get(var):
            out[name] = (env[var], f"environment variable {var}")
        else:
            out[name] = (default, f"the default {name}")
    return out


def _read_file(path: str) -> dict:
    where = f"environment variable {ENV_CONFIG_PATH}={path!r}"
    try:
        with open(path, encoding="utf-8") as f:
            data = json.load(f)
    except (OSError, ValueError) as e:
        raise ValueError(f"{where}: cannot read a JSON config from it: {e}") from e
    if not isinstance(data, dict):
        raise ValueError(f"{where}: the file must hold a JSON object, got {type(data).__name__}")
    return data


def load_mooncake_config(
    extra_config: Mapping[str, Any] | None, env: Mapping[str, str] | None = None
) -> MooncakeStoreConfig:
    """``env``: the environment to read (default ``os.environ``)."""
    env = os.environ if env is None else env
    extra = dict(extra_config or {})
    if extra.get("master_server_address") is not None or extra.get("client_server_address"):
        raw = _raw(extra, f"extra config ({FLAG})", env)
    elif env.get(ENV_CONFIG_PATH):
        path = env[ENV_CONFIG_PATH]
        data = _read_file(path)
        if data.get("master_server_address") is None and not data.get("client_server_address"):
            raise ValueError(
                f"environment variable {ENV_CONFIG_PATH}={path!r}: the file sets neither "
                "master_server_address nor client_server_address"
            )
        raw = _raw(data, f"{ENV_CONFIG_PATH}={path!r}", env)
    else:
        raw = _raw(None, "", env)
        if raw["master_server_address"][0] is None and raw["client_server_address"][0] is None:
            raise ValueError(
                "no Mooncake master configured: set master_server_address in "
                f"{FLAG}, a JSON file in {ENV_CONFIG_PATH}, or the environment variable "
                "MOONCAKE_MASTER (Mooncake's mooncake_master command starts one)"
            )
    for var in ("MOONCAKE_LOCAL_HOSTNAME", "LOCAL_HOSTNAME"):  # a node names itself
        if env.get(var):
            raw["local_hostname"] = (env[var], f"environment variable {var}")
            break
    values: dict[str, Any] = {}
    sources: dict[str, str] = {}
    for name, (value, source) in raw.items():
        sources[name] = source
        values[name] = None if value is None else _CHECKS[name](value, source)
    if values["standalone_storage"] or values["client_server_address"]:
        which = "standalone_storage" if values["standalone_storage"] else "client_server_address"
        raise ValueError(
            f"{sources[which]}: Mooncake's dummy-client mode (standalone_storage, "
            "client_server_address) is not supported here; give master_server_address and let "
            "each process run its own client"
        )
    if values["master_server_address"] is None:
        raise ValueError(f"{sources['master_server_address']}: master_server_address is required")
    config = MooncakeStoreConfig(**values, sources=sources)
    config.master_host_port()  # validates the address
    return config


def device_for_rank(device_name: str, tp_rank: int, source: str) -> str:
    """``device_name`` itself, or for SGLang's per-rank JSON form (``'{"0": "mlx5_0"}'``) the
    rank's entry (``""`` when absent)."""
    if not device_name.strip().startswith("{"):
        return device_name
    try:
        table = json.loads(device_name)
    except ValueError:
        raise ValueError(f"{source}={device_name!r} is neither a device list nor JSON") from None
    if not isinstance(table, dict):
        raise ValueError(f"{source}={device_name!r} must be a JSON object rank -> devices")
    value = table.get(str(tp_rank), table.get(tp_rank, ""))  # type: ignore[call-overload]
    return str(value or "")
