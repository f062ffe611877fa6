"""Typed readers of backend settings: an extra-config key first, then its environment variable,
then the default (SGLang's precedence for the file backend's budget). A malformed value raises a
``ValueError`` naming the key or the variable, where SGLang 0.5.23 warns and disables the budget
(a typo such as ``"200GB"`` would otherwise silently leave the disk unbounded).

Sizes: ``hicache.storage.config.parse_size``; ``0`` means "off".
"""

from __future__ import annotations

import logging
import os
from collections.abc import Mapping
from typing import Any

from hicache.storage.config import FLAG, parse_size

logger = logging.getLogger(__name__)


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
