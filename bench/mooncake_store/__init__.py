"""The Mooncake Store as the L3 tier, measured on a CPU (``python -m bench.mooncake_store``):
put / get bandwidth against memcpy (``bandwidth``, also the node process it runs in)."""
