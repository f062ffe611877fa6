"""``python -m bench.mooncake_store``."""

from __future__ import annotations

import sys

from bench.mooncake_store.bench import main

if __name__ == "__main__":
    sys.exit(main())
