"""A prefill request: its scheduler state and result (``state``) and its device KV through the
tree (``kv``)."""
