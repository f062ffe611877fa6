"""``python -m bench.mooncake_store``."""

from bench.mooncake_store.bench import main

if __name__ == "__main__":
    raise SystemExit(main())
