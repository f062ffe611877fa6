"""A prefill request: its scheduler state and result (``state``), its device KV through the
tree (``kv``) and the L3 pages of its attempts not finalized (``speculative_l3_pages``)."""
