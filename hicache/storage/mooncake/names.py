"""Mooncake object names of KV pages, SGLang 0.5.23's, so an SGLang instance and this project find
each other's pages in one store.

A page key (``hicache.storage.hash_keys``) becomes one object per part of the page:

- MHA: ``{prefix}_{key}_{tp_rank}_k`` and ``{prefix}_{key}_{tp_rank}_v`` (each TP rank stores
  its own shard of the heads);
- MLA: ``{prefix}_{key}__k`` (one object for every rank: the latent is not split);
- with ``pp_size > 1``: ``_{tp_rank}_{pp_rank}`` (MHA) and ``_{pp_rank}`` (MLA) in place of the
  rank part.

``prefix`` is the extra-config ``extra_backend_tag`` (when set) and the storage config's
``model_name`` with ``/`` replaced by ``-``, joined by ``_``; with neither, names start at the key.
The model name carries the page format tag by default (``hicache.storage.format_tag``:
``{model}-{dtype}-{layer-major|token-major}``); ``storage_format_tag: "none"`` gives SGLang's
untagged names. For tokens 1..16 at page 16, model ``Qwen/Qwen3-8B``, TP rank 0, untagged:
``Qwen-Qwen3-8B_77d735ce…9b07_0_k`` and ``…_0_v`` (MLA: ``Qwen-Qwen3-8B_77d735ce…9b07__k``).

The order of a page's names is the order of ``get_page_buffer_meta``'s pointers for one page
(K then V), which Mooncake zips with them. MHA names carry neither the TP size nor the head
count (SGLang's neither): two servers of one MHA model at different TP sizes write objects of
different sizes under the same names. ``MooncakeStore`` checks every object's size, so a reader
of the other TP size gets misses (counted, warned once), never wrong KV; but a writer finds the
names taken and skips the put, so the two do not share. Give each TP size its own
``extra_backend_tag`` (SGLang's advice for differing formats). MLA names need no TP size: the
latent is the same on every rank and at every TP size.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

from hicache.storage.config import HiCacheStorageConfig

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class ObjectNames:
    """The naming of one rank's objects (module docstring)."""

    prefix: str | None
    suffixes: tuple[str, ...]  # per page, in pointer order: ("_0_k", "_0_v") or ("__k",)

    @classmethod
    def for_config(
        cls, config: HiCacheStorageConfig, extra_backend_tag: str | None = None
    ) -> ObjectNames:
        parts = []
        if extra_backend_tag is not None:
            parts.append(str(extra_backend_tag))
        if config.model_name:
            parts.append("-".join(config.model_name.split("/")))
        prefix = "_".join(parts) if parts else None
        pp = config.pp_size > 1
        if config.is_mla_model:
            rank_part = f"{config.pp_rank}" if pp else ""
            return cls(prefix, (f"_{rank_part}_k",))
        rank_part = f"{config.tp_rank}_{config.pp_rank}" if pp else f"{config.tp_rank}"
        return cls(prefix, (f"_{rank_part}_k", f"_{rank_part}_v"))

    @property
    def per_page(self) -> int:
        """Objects per page (2 for MHA, 1 for MLA)."""
        return len(self.suffixes)

    def tagged(self, key: str) -> str:
        """``key`` with the prefix (SGLang's ``_tag_keys``)."""
        return key if self.prefix is None else f"{self.prefix}_{key}"

    def objects(self, keys: list[str]) -> list[str]:
        """Every object name of ``keys``' pages, page by page, parts in pointer order."""
        return [self.tagged(k) + s for k in keys for s in self.suffixes]
