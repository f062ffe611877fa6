"""Hierarchical KV cache: ``memory`` (pools, allocator), ``transfer`` (streams, controller),
``tree`` (radix trees, eviction), ``storage`` (L3), ``tp`` (rank agreement), with the builder
(``builder.build_kv_cache``) and the counters (``cache_stats``). Never sees a request.
"""
