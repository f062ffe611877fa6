"""``python -m bench.mooncake_store``."""

from bench.mooncake_store.bench import main

raise SystemExit(main())
