"""The controller side of the L3 storage tier (SGLang 0.5.23's storage part of
``HiCacheController`` and of its radix cache), one module per concern:

- ``settings``: ``StorageSettings`` (prefetch policy and threshold, timeouts, host memory mode)
  read from the extra config, SGLang's keys and defaults;
- ``operations``: ``CacheRequestHandle`` (a request's attempt), ``StorageOperation`` (a backup),
  ``PrefetchOperation`` and ``PrefetchAck``;
- ``workers``: ``StorageWorkers``, the backend and its three IO threads (prefetch query,
  prefetch IO, backup), batches of ``STORAGE_BATCH_SIZE`` pages;
- ``prefetch``: ``PrefetchBook``, the scheduler-thread state of prefetches (hits, host pages,
  acks, stop policies, results);
- ``backup``: ``BackupBook``, the scheduler-thread state of backups (host protection until the
  storage ack, buffer-only staging) and ``StoredBeliefs``;
- ``controller``: ``HiCacheStorageController``, the one object the tree and the executor talk
  to; it agrees every rank-local result on the cache group at each tick;
- ``stats``: ``StorageStats``.

Nothing here imports the tree or the executor: what it needs of the tree is the small
``controller.StorageTree`` protocol.
"""
