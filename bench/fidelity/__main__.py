"""``python -m bench.fidelity``: see :mod:`bench.fidelity.bench`."""

import sys

from bench.e2e.report import bench_main
from bench.fidelity.bench import run

sys.exit(bench_main("fidelity", run))
