"""The Mooncake Store as the L3 tier on a CPU (``python -m bench.mooncake_store``, ``bench``)."""
