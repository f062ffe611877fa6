"""``python -m bench.transfer``: bandwidth of the KV copy ops against the link ceiling."""
