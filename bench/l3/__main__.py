import sys

from bench.l3.bench import main

sys.exit(main())
