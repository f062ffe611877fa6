"""Hierarchical KV cache: ``memory``, ``transfer``, ``tree``, ``storage`` (L3), ``tp`` (rank
agreement), the builder and the counters. Never sees a request."""
