"""Benchmarks: ``python -m bench`` runs the suite (the README's ``make bench``).

Importing the package prepares CPU runs before anything imports Triton: on a machine without
CUDA the kernel io backend then runs the torch reference of the kvcacheio ops instead of the
Triton interpreter (orders of magnitude slower, meaningless to time), and torch runs on one
thread so the copy streams' worker threads get the other core. A ``TRITON_INTERPRET`` value the
user set is respected. Triton kernels are timed on CUDA only.
"""

from __future__ import annotations

import os


def _prepare_cpu_run() -> None:
    try:
        import torch
    except ImportError:  # bench.gpu.probe says so in one line
        return

    if not torch.cuda.is_available():
        os.environ.setdefault("TRITON_INTERPRET", "0")
        torch.set_num_threads(1)


_prepare_cpu_run()
