"""``python -m bench.transfer``: see :mod:`bench.transfer.bench`."""

import sys

from bench.transfer.bench import main

sys.exit(main())
