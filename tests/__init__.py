"""The test suite: one folder per package (``kernels``, ``hicache``, ``prefill``, ``bench``) and
``support`` for helpers several folders share. Every test passes or skips without a GPU."""
