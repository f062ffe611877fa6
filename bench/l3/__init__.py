"""``python -m bench.l3``: the L3 storage tier (multi-turn rows per tier, a warm restart in a
second process, L3 read/write bandwidth against plain file copies)."""
