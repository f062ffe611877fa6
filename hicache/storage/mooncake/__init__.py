"""The Mooncake Store as the L3 backend (``--hicache-storage-backend mooncake``): several prefill
instances share one distributed KV store. ``store`` (the backend), ``config``, ``names``,
``page_footers``, ``client``, ``store_stats``, ``availability`` (also the PD transport's). Nothing
imports ``mooncake`` at module import.
"""
