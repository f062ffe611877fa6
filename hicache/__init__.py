"""Hierarchical KV cache: device and host pools, allocators, streams, controller, radix tree."""
