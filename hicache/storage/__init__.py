"""L3 storage: SGLang 0.5.23's ``HiCacheStorage`` interface, page keys, the ``file`` and Mooncake
backends, the factory, the fault injector and the controller side (``io/``).
"""
