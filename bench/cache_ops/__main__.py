"""``python -m bench.cache_ops``: see :mod:`bench.cache_ops.bench`."""

from bench.cache_ops.bench import main

if __name__ == "__main__":
    raise SystemExit(main())
