"""``python -m bench.transfer``: see :mod:`bench.transfer.bench`."""

from __future__ import annotations

import sys

from bench.transfer.bench import main

sys.exit(main())
