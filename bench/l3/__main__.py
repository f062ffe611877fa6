"""``python -m bench.l3``."""

from __future__ import annotations

from bench.l3.bench import main

raise SystemExit(main())
