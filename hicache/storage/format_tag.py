"""The page-format tag in the model-name part of a storage key.

SGLang's page objects carry no header: a file holds a host pool's flat page and nothing says in
which byte order or dtype. Two pools of one model and TP shard write pages of the same size
under the same name whether they store bfloat16 or float16, ``page_first`` (token-major) or
``layer_first`` / ``page_first_direct`` (layer-major), so a reader of the other format would load
wrong KV without noticing. (A different geometry changes the page's size, which a reader that
checks sizes, as ``HiCacheFile`` does, treats as a miss.)

SGLang 0.5.23 has the mechanism: a host pool may carry ``storage_format_tag``, and the controller
builds the storage config's ``model_name`` as ``f"{model_name}-{tag}"`` (``storage_model_name``),
so pages of another format are misses. SGLang's own MHA / MLA pools carry no tag (only its unified
pool does, ``"unified-token-major"``). This project's pools always carry one,
``"{dtype}-{layer-major|token-major}"`` (``HostPoolPagesMixin.storage_format_tag``), and
``storage_config_for_pool`` applies it unless told otherwise by the extra-config key
``storage_format_tag``:

- absent or ``"auto"`` (the default): the key's model part is ``{model}-{pool's tag}``, e.g.
  ``Qwen-Qwen3-8B-bfloat16-token-major``; files are shared with this project's pools of the same
  dtype and byte order;
- ``"none"``: ``{model}``, SGLang's untagged name; files are shared with stock SGLang 0.5.23
  (``HiCacheFile``), and every writer must use one layout and dtype (the operator's promise);
- any other string: ``{model}-{string}``, shared with whoever uses the same string.

The trade-off: with the default tag, pages written here are invisible to a stock SGLang reading
the same directory under the plain model name (and the other way round); that costs a recompute,
never wrong KV. Sharing with stock SGLang takes either ``"none"`` (safety then rests on every
writer using one layout and dtype) or starting SGLang with ``--served-model-name`` set to the
tagged name (``Qwen/Qwen3-8B-bfloat16-token-major``: its ``/`` becomes ``-`` as here).
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
