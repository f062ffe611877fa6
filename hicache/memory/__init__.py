"""Where KV lives: the device pools, the host pools (layouts, direct copies, slot access, the
factory), host RAM sizing and pinning, and the page allocator."""
