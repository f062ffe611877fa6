"""``python -m bench.l3``."""

from __future__ import annotations

import sys

from bench.l3.bench import main

if __name__ == "__main__":
    sys.exit(main())
