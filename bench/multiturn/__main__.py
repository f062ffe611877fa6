"""``python -m bench.multiturn``: see ``bench.multiturn.bench``."""

import sys

from bench.e2e.report import main
from bench.multiturn.bench import run

sys.exit(main("multiturn", run))
