"""Plugging these kernels into a running SGLang: ``compat.install`` (the fork's one call), what it
rebinds (``rebind``), the warm-up (``warm_up``) and the pool description (``pool_info``)."""
