"""The prefill executor's ranks in lock step under tensor parallelism (``sync``, ``driver``)."""
