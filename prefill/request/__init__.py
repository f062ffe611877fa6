"""A prefill request: its state and result, its device KV, its speculative L3 pages."""
