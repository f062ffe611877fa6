"""L3 storage: SGLang 0.5.23's ``HiCacheStorage`` interface (``base``), page keys
(``hash_keys``, ``format_tag``), the ``file`` backend (``file_backend``, ``lru_file_evictor``),
the Mooncake Store backend (``mooncake/``), the factory, the fault injector, the extra config's
readers and the controller side (``io/``). Nothing here imports the cache above it.
"""
