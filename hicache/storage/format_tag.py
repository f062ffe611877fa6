"""The page-format tag in the model-name part of a storage key (SGLang 0.5.23's
``storage_model_name``). Page objects carry no header, so two pools of one model writing pages of
one size in another dtype or byte order would read each other's pages as KV; the tag
(``"{dtype}-{layer-major|token-major}"``, from the host pool) gives them other names. The
extra-config key ``storage_format_tag``: absent or ``"auto"``: the pool's tag; ``"none"``: no tag
(SGLang's names; one layout and dtype per store is then the operator's promise); any other
string: that tag. Sharing with stock SGLang: docs/GUIDE.md.
"""

from __future__ import annotations

import logging
from typing import Any

logger = logging.getLogger(__name__)

FORMAT_TAG_KEY = "storage_format_tag"
AUTO = "auto"
NO_TAG = "none"


def _with_tag(model_name: str | None, tag: str | None) -> str | None:
    if tag is None:
        return model_name
    return f"{model_name}-{tag}" if model_name else tag


def storage_model_name(model_name: str | None, host_pool: Any) -> str | None:
    """SGLang's ``storage_model_name``: ``model_name`` tagged with ``host_pool``'s
    ``storage_format_tag`` when it has one (``None`` or absent: untouched)."""
    return _with_tag(model_name, getattr(host_pool, "storage_format_tag", None))


def resolve_format_tag(setting: Any, host_pool: Any) -> str | None:
    """The tag the extra-config ``storage_format_tag`` asks for (list in the module docstring);
    ``ValueError`` naming the key for a non-string or empty value."""
    if setting is None or setting == AUTO:
        return getattr(host_pool, "storage_format_tag", None)
    if not isinstance(setting, str) or not setting.strip():
        raise ValueError(
            f"extra config key {FORMAT_TAG_KEY!r} must be 'auto', 'none' or a non-empty string, "
            f"got {setting!r}"
        )
    return None if setting == NO_TAG else setting


def tagged_model_name(model_name: str | None, host_pool: Any, setting: Any = AUTO) -> str | None:
    """``model_name`` with the tag ``setting`` resolves to."""
    return _with_tag(model_name, resolve_format_tag(setting, host_pool))
