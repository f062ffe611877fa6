"""The Mooncake Store as the L3 tier, measured on a CPU (``python -m bench.mooncake_store``,
``bench``): put / get bandwidth against memcpy."""
