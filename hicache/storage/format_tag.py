"""The page-format tag in the model-name part of a storage key (SGLang 0.5.23's
``storage_model_name``): pages carry no header, so pools of one model in another dtype or layout
must use other names. Extra-config key ``storage_format_tag``: absent or ``"auto"``: the host
pool's tag (``"{dtype}-{layer-major|token-major}"``); ``"none"``: no tag (SGLang's names); any
other string: that tag. Sharing with stock SGLang: docs/GUIDE.md.
"""

from __future__ import annotations

from typing import Any

FORMAT_TAG_KEY = "storage_format_tag"
AUTO = "auto"
NO_TAG = "none"


def resolve_format_tag(setting: Any, host_pool: Any) -> str | None:
    """``ValueError`` naming the key for a non-string or empty value."""
    if setting is None or setting == AUTO:
        return getattr(host_pool, "storage_format_tag", None)
    if not isinstance(setting, str) or not setting.strip():
        raise ValueError(
            f"extra config key {FORMAT_TAG_KEY!r} must be 'auto', 'none' or a non-empty string, "
            f"got {setting!r}"
        )
    return None if setting == NO_TAG else setting


def tagged_model_name(model_name: str | None, host_pool: Any, setting: Any = AUTO) -> str | None:
    tag = resolve_format_tag(setting, host_pool)
    if tag is None:
        return model_name
    return f"{model_name}-{tag}" if model_name else tag
