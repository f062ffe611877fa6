"""L3 storage tier: SGLang 0.5.23's ``HiCacheStorage`` interface, page keys and backends.

One module per concern (import each name from its home module):

- ``base``: ``HiCacheStorage`` (the interface every backend implements, SGLang's names and return
  conventions), ``HiCacheStorageExtraInfo``, ``STORAGE_BATCH_SIZE``.
- ``config``: ``HiCacheStorageConfig`` (what every backend is built from) and
  ``storage_config_for_pool`` (a config for a host pool, format tag included).
- ``hash_keys``: page keys, SGLang's SHA-256 chain (``get_hash_str``, ``page_hashes``,
  ``storage_namespace_seed``).
- ``format_tag``: the page-format tag in the model-name part of a key (``storage_model_name``).
- ``file_backend``: ``HiCacheFile``, one file per page; ``lru_file_evictor``: its byte budget;
  ``file_stats``: its counters.
- ``extra_config``: typed readers of extra-config keys and environment variables.
- ``fault_injector``: ``HiCacheStorageFailureInjector`` (random delays and failures).
- ``backend_factory``: ``StorageBackendFactory`` (built-in names, ``register_backend``,
  ``dynamic``).
- ``mooncake/``: ``MooncakeStore``, the Mooncake Store backend (several instances share one
  distributed store), its settings, object names, master launcher and loopback shim.

The host pools' page calls the backends use (``get_page_buffer_meta``, ``get_data_page``,
``get_dummy_flat_data_page``, ``set_from_flat_data_page``) live with the pools
(``hicache.memory.host_pool_pages``); nothing here imports the cache above it.
"""
