"""The Mooncake Store as the L3 backend (``--hicache-storage-backend mooncake``, SGLang 0.5.23's
``mem_cache/storage/mooncake_store``): several prefill instances share one distributed KV store.

``store`` (the backend), ``config`` (its settings), ``names`` (SGLang's object names),
``page_footers`` (the pages' integrity check), ``client`` (the guarded Mooncake client),
``store_stats`` (its counters), ``availability`` (whether Mooncake imports; the loopback
check the PD transport shares). Nothing here imports ``mooncake`` at module import: without it,
building the backend raises one ``ValueError`` saying what is missing.
"""
