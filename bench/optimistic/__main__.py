"""``python -m bench.optimistic``: see ``bench.optimistic.bench``."""

import sys

from bench.e2e.report import main
from bench.optimistic.bench import run

sys.exit(main("optimistic", run))
