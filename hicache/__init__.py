"""Hierarchical KV cache: ``memory`` (pools, allocator), ``transfer`` (streams, controller),
``tree`` (radix trees, write policies, eviction), ``tp`` (rank agreement), with the builder
(``builder.build_kv_cache``) and the stats at the top. Never sees a request."""
