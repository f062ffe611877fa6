"""``python -m bench.trace``: see :mod:`bench.trace.bench`."""

import sys

from bench.trace.bench import main

if __name__ == "__main__":  # a spawned child imports this module too
    sys.exit(main())
