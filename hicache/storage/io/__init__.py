"""The controller side of the L3 tier: ``workers`` (IO threads), ``prefetch`` (``PrefetchBook``),
``controller`` (``HiCacheStorageController``, what the tree and the executor talk to)."""
