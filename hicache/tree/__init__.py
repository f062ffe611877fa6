"""The prefix index: nodes and their packed keys, the device-only radix tree, the hierarchical tree
with SGLang's write policies, its two-phase copies, device eviction, the LRU candidate queues and
the integrity checks."""
