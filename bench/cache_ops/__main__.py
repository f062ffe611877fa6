"""``python -m bench.cache_ops``: see :mod:`bench.cache_ops.bench`."""

import sys

from bench.cache_ops.bench import main

if __name__ == "__main__":
    sys.exit(main())
