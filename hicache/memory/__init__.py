"""Where KV lives: the device pools, the host pools and their page access for storage, host RAM
sizing and pinning, and the page allocator."""
