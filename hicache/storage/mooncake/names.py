"""``ObjectNames``: SGLang 0.5.23's Mooncake object names of KV pages: one object per part, in
``get_page_buffer_meta``'s pointer order: MHA ``{prefix}_{key}_{tp_rank}_k`` / ``_v``, MLA
``{prefix}_{key}__k``; with ``pp_size > 1`` the rank part is ``{tp_rank}_{pp_rank}`` (MHA) or
``{pp_rank}`` (MLA). ``prefix``: ``extra_backend_tag`` and the (tagged) model name. MHA names carry
no TP size: two TP sizes of one model need their own ``extra_backend_tag``.
"""

from __future__ import annotations

from dataclasses import dataclass

from hicache_prefill.hicache.storage.config import HiCacheStorageConfig


@dataclass(frozen=True)
class ObjectNames:
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
        return len(self.suffixes)

    def tagged(self, key: str) -> str:
        """``key`` with the prefix (SGLang's ``_tag_keys``)."""
        return key if self.prefix is None else f"{self.prefix}_{key}"

    def objects(self, keys: list[str]) -> list[str]:
        return [self.tagged(k) + s for k in keys for s in self.suffixes]
