"""``python -m bench.transfer``: see :mod:`bench.transfer.bench`."""

from __future__ import annotations

from bench.transfer.bench import main

raise SystemExit(main())
