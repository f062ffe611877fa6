"""``python -m bench.pd``."""

from __future__ import annotations

import sys

from bench.pd.bench import main

if __name__ == "__main__":
    sys.exit(main())
