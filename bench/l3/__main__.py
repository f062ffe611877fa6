"""``python -m bench.l3``."""

from bench.l3.bench import main

raise SystemExit(main())
