import sys

from bench.mooncake_store.bench import main

sys.exit(main())
