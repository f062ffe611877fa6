"""``python -m bench.optimistic``: see :mod:`bench.optimistic.bench`."""

import sys

from bench.e2e.report import bench_main
from bench.optimistic.bench import run

sys.exit(bench_main("optimistic", run))
