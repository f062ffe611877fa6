"""``python -m bench.mooncake_store``."""

from __future__ import annotations

from bench.mooncake_store.bench import main

raise SystemExit(main())
