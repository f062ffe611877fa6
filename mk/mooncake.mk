# Optional Mooncake set-up, included by the Makefile (also for the Mooncake Store).
#
#   $(call mooncake_install,VENV)  the transfer engine + store wheel (CPU/TCP build) into VENV:
#       pip-installs $(MOONCAKE_PKG) unless `import mooncake` already works there (a CUDA build the
#       user installed is kept); when libibverbs.so.1 (needed by mooncake.engine and
#       mooncake.store even over TCP) does not load and this is root with apt-get, installs the
#       Debian package libibverbs1 (apt-get update only when the plain install fails).
#   $(call loopback_shim)  builds $(LOOPBACK_SHIM) from $(LOOPBACK_SRC) with cc: the LD_PRELOAD
#       shim that keeps Mooncake's listeners on loopback in tests and benchmarks
#       (tests/support/loopback.py).
#
# Each prints exactly one line and never fails the make: where something cannot be done, the
# Mooncake tests skip with one line and bench.pd reports itself skipped.
MOONCAKE_PKG ?= mooncake-transfer-engine-non-cuda==0.3.13.post1
LOOPBACK_SRC := tests/support/bind_loopback.c
LOOPBACK_SHIM := build/loopback/bind_loopback.so

mooncake_install = P="$(1)/bin/python"; why=""; \
	"$$P" -c "import mooncake" >/dev/null 2>&1 || \
		"$$P" -m pip install -q "$(MOONCAKE_PKG)" >/dev/null 2>&1 || \
		why="pip install $(MOONCAKE_PKG) failed"; \
	if [ -z "$$why" ] && ! "$$P" -c "import ctypes; ctypes.CDLL('libibverbs.so.1')" >/dev/null 2>&1; then \
		if [ "$$(id -u)" = 0 ] && command -v apt-get >/dev/null 2>&1; then \
			export DEBIAN_FRONTEND=noninteractive; \
			apt-get install -y -q libibverbs1 >/dev/null 2>&1 || \
			{ apt-get update -q >/dev/null 2>&1 && apt-get install -y -q libibverbs1 >/dev/null 2>&1; } || \
			why="apt-get install libibverbs1 failed"; \
		else \
			why="libibverbs.so.1 is missing (install the libibverbs1 package; needs root and apt-get)"; \
		fi; \
	fi; \
	if [ -z "$$why" ] && "$$P" -c "import mooncake.engine, mooncake.store" >/dev/null 2>&1; then \
		echo "[mooncake] ready: $$("$$P" -c "from importlib.metadata import version as v; \
			print(v('mooncake-transfer-engine-non-cuda'))" 2>/dev/null || echo installed) in $(1)"; \
	else \
		echo "[mooncake] unavailable ($${why:-import mooncake.engine, mooncake.store failed}); the Mooncake tests skip"; \
	fi; true

loopback_shim = mkdir -p $(dir $(LOOPBACK_SHIM)); \
	if $${CC:-cc} -shared -fPIC -O2 -o $(LOOPBACK_SHIM) $(LOOPBACK_SRC) -ldl >/dev/null 2>&1; then \
		echo "[mooncake] loopback shim: $(LOOPBACK_SHIM)"; \
	else \
		echo "[mooncake] no C compiler built $(LOOPBACK_SHIM); the Mooncake tests skip"; \
	fi; true
