"""Plugging these kernels into a running SGLang: ``compat.install`` and what it uses."""
