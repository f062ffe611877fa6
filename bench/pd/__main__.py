"""``python -m bench.pd``."""

from bench.pd.bench import main

raise SystemExit(main())
