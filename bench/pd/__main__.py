"""``python -m bench.pd [--full] [--out DIR]``."""

from __future__ import annotations

import sys

from bench.pd.bench import main

sys.exit(main())
