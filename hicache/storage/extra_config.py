"""Typed readers of backend settings: an extra-config key first, then its environment variable,
then the default (SGLang's precedence for the file backend's budget). A malformed value raises a
``ValueError`` naming the key or the variable, where SGLang 0.5.23 warns and disables the budget
(a typo such as ``"200GB"`` would otherwise silently leave the disk unbounded).

Sizes: a non-negative int (bytes), or a string of a plain integer or a number with an SI suffix
(``k``, ``M``, ``G``, ``T``: powers of 1000, decimals allowed) or an IEC suffix (``Ki``, ``Mi``,
``Gi``, ``Ti``: powers of 1024, integers only), case-sensitive, as SGLang's ``human_readable_int``.
``0`` (or an empty string) means "off".
"""

from __future__ import annotations

import logging
import os
import re
from collections.abc import Mapping
from decimal import Decimal
from typing import Any

logger = logging.getLogger(__name__)

_SI = {"k": 10**3, "M": 10**6, "G": 10**9, "T": 10**12}
_IEC = {"Ki": 2**10, "Mi": 2**20, "Gi": 2**30, "Ti": 2**40}
_SIZE_RE = re.compile(r"(\d+(?:\.\d+)?)(Ki|Mi|Gi|Ti|k|M|G|T)")

FLAG = "--hicache-storage-backend-extra-config"


def as_extra_config(extra_config: Any) -> dict:
    """The extra config as a dict (``{}`` for ``None``); ``ValueError`` for anything else."""
    if extra_config is None:
        return {}
    if not isinstance(extra_config, Mapping):
        raise ValueError(f"{FLAG} must be a JSON object, got {type(extra_config).__name__}")
    return dict(extra_config)


def parse_size(value: Any, name: str) -> int:
    """Bytes of a size setting (module docstring); ``ValueError`` naming ``name``."""
    if isinstance(value, bool):
        raise ValueError(f"{name} must be a size (bytes or e.g. '200G', '1Gi'), got {value!r}")
    if isinstance(value, int | float):
        if value < 0 or value != value:
            raise ValueError(f"{name} must be a non-negative size, got {value!r}")
        return int(value)
    if not isinstance(value, str):
        raise ValueError(f"{name} must be a size (bytes or e.g. '200G', '1Gi'), got {value!r}")
    text = value.strip()
    if not text:
        return 0
    match = _SIZE_RE.fullmatch(text)
    if match:
        number, suffix = match.groups()
        if suffix in _IEC:
            if "." in number:
                raise ValueError(f"{name}={value!r}: IEC suffixes take integers only")
            return int(number) * _IEC[suffix]
        return int(Decimal(number) * _SI[suffix])
    try:
        size = int(text)
    except ValueError:
        raise ValueError(
            f"{name}={value!r} is not a size: use bytes, SI (1k, 200G) or IEC (1Ki, 1Gi) suffixes"
        ) from None
    if size < 0:
        raise ValueError(f"{name} must be a non-negative size, got {value!r}")
    return size


def _setting(extra: Mapping, key: str, env: str) -> tuple[Any, str] | None:
    """(value, name of its source) of ``key`` or, when absent or ``None``, of ``env``."""
    if extra.get(key) is not None:
        return extra[key], f"extra config key {key!r} ({FLAG})"
    raw = os.environ.get(env)
    if raw is not None and raw != "":
        return raw, f"environment variable {env}"
    return None


def read_size(extra: Mapping, key: str, env: str, default: int = 0) -> int:
    """A size setting in bytes (0 = off)."""
    found = _setting(extra, key, env)
    return default if found is None else parse_size(*found)


def read_fraction(extra: Mapping, key: str, env: str, default: float) -> float:
    """A number in ``(0, 1]``."""
    found = _setting(extra, key, env)
    if found is None:
        return default
    value, name = found
    try:
        if isinstance(value, bool):
            raise TypeError
        fraction = float(value)
    except (TypeError, ValueError):
        raise ValueError(f"{name} must be a number in (0, 1], got {value!r}") from None
    if not 0.0 < fraction <= 1.0:
        raise ValueError(f"{name} must be in (0, 1], got {value!r}")
    return fraction


def read_env_float(env: str) -> float | None:
    """A float environment variable, ``None`` when unset (SGLang's ``EnvFloat(None)``)."""
    raw = os.environ.get(env)
    if raw is None or raw == "":
        return None
    try:
        return float(raw)
    except ValueError:
        raise ValueError(f"environment variable {env}={raw!r} is not a number") from None
