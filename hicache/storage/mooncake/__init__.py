"""The Mooncake Store as the L3 backend (``--hicache-storage-backend mooncake``, SGLang 0.5.23's
``mem_cache/storage/mooncake_store``): several prefill instances share one distributed KV store.

One module per concern (import each name from its home module):

- ``store``: ``MooncakeStore``, the ``HiCacheStorage`` backend (zero-copy v1 calls, health
  gating, counted failures);
- ``config``: ``MooncakeStoreConfig`` and ``load_mooncake_config`` (extra config, JSON file or
  environment, SGLang's keys, variables and precedence);
- ``names``: ``ObjectNames``, SGLang's object names of a page's parts;
- ``client``: ``MooncakeClient`` and ``open_client`` (setup with clear startup errors, the
  close guard, return-code names);
- ``stats``: ``MooncakeStoreStats``;
- ``availability``: whether ``mooncake.engine`` / ``mooncake.store`` import here, and the
  refusal of an engine on a loopback host without the loopback shim (shared with the PD
  transport, ``prefill.disagg.mooncake``).

A master is Mooncake's own ``mooncake_master`` command.

Nothing here imports ``mooncake`` at module import: without Mooncake installed, building the
backend raises one ``ValueError`` saying what is missing, and everything else works.
"""
