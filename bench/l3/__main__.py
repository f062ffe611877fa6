"""``python -m bench.l3``."""

from bench.l3.bench import main

if __name__ == "__main__":
    raise SystemExit(main())
