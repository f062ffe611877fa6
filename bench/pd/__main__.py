"""``python -m bench.pd``."""

from bench.pd.bench import main

if __name__ == "__main__":
    raise SystemExit(main())
