"""The controller side of the L3 storage tier: ``workers`` (the IO threads and the records they
carry), ``prefetch`` (``PrefetchBook``), ``controller`` (``HiCacheStorageController``, the one
object the tree and the executor talk to, and ``build_storage_controller``). Nothing here imports
the tree or the executor."""
