"""``python -m bench.multiturn``: see :mod:`bench.multiturn.bench`."""

import sys

from bench.e2e.report import bench_main
from bench.multiturn.bench import run

sys.exit(bench_main("multiturn", run))
