"""``python -m bench.trace``: see :mod:`bench.trace.bench`."""

from bench.trace.bench import main

if __name__ == "__main__":  # a spawned child imports this module too
    raise SystemExit(main())
