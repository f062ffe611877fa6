"""``python -m bench.pd``."""

from __future__ import annotations

from bench.pd.bench import main

raise SystemExit(main())
