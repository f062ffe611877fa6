"""The prefix index: radix trees, write policies, device eviction, LRU queues, integrity checks."""
