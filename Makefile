# Two commands do all the set-up on a fresh machine: `make test` and `make bench`.
PY ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed
# The pinned CPU wheel; on a machine with CUDA the user's CUDA torch is used instead.
CPU_TORCH ?= torch==2.13.0
# PyTorch's CPU-only wheel index: a machine without a GPU never downloads the CUDA build (PyPI's
# Linux torch wheel is the CUDA one). When it cannot be reached, the default index is used.
CPU_INDEX ?= https://download.pytorch.org/whl/cpu

.PHONY: test bench bench-trace lint clean sglang-check bench-vs-sglang mooncake

# Mooncake's transfer engine (the PD transport, bench.pd) and the loopback shim: optional,
# installed by the stamp below; one line each, never failing the make.
include mk/mooncake.mk

# $(call cpu_torch,PIP): install $(CPU_TORCH) with PIP from $(CPU_INDEX), or from the default
# index when that one is unreachable or its install fails (one shell line).
cpu_torch = if $(PY) -c "import urllib.request as u; u.urlopen('$(CPU_INDEX)/torch/', timeout=10)" \
		>/dev/null 2>&1; then \
	echo "[setup] $(CPU_TORCH) (CPU build) from $(CPU_INDEX)"; \
	$(1) install -q --index-url $(CPU_INDEX) $(CPU_TORCH) || { \
		echo "[setup] $(CPU_INDEX) failed: $(CPU_TORCH) from the default index"; \
		$(1) install -q $(CPU_TORCH); }; \
	else \
	echo "[setup] $(CPU_INDEX) unreachable: $(CPU_TORCH) from the default index"; \
	$(1) install -q $(CPU_TORCH); \
	fi

$(STAMP): pyproject.toml Makefile mk/mooncake.mk $(LOOPBACK_SRC)
	@if $(PY) -c "import torch, sys; sys.exit(0 if torch.cuda.is_available() else 1)" 2>/dev/null; then \
		echo "[setup] CUDA torch found for $(PY): venv shares its site-packages"; \
		$(PY) -m venv --system-site-packages $(VENV); \
	else \
		$(PY) -m venv $(VENV); \
		if command -v nvidia-smi >/dev/null 2>&1 && nvidia-smi -L >/dev/null 2>&1; then \
			echo "[setup] NVIDIA GPU without a CUDA torch: installing torch (CUDA build)"; \
			$(BIN)/pip install -q torch; \
		else \
			echo "[setup] no CUDA device"; $(call cpu_torch,$(BIN)/pip); \
		fi; \
	fi
	$(BIN)/pip install -q -e '.[test,bench]'
	@$(call mooncake_install,$(VENV))
	@$(call loopback_shim)
	@touch $(STAMP)

mooncake: $(STAMP)
	@$(call mooncake_install,$(VENV))
	@$(call loopback_shim)

test: $(STAMP)
	$(BIN)/python -m pytest -q

# The suite's results are committed: make bench writes them to results/ (a plain
# `python -m bench` writes to the ignored bench-out/).
bench: $(STAMP)
	$(BIN)/python -m bench --out results

lint: $(STAMP)
	$(BIN)/pip install -q ruff && $(BIN)/ruff check .

# SGLang compatibility check (not part of `make test`: it downloads the pinned releases).
# Its own venv: torch as `make test` installs it, the pins with --no-deps in separate target dirs,
# and only what SGLang's host-pool and argument modules import (numpy, psutil, msgspec).
SGLANG_PINS ?= 0.5.17 0.5.23
SGLANG_VENV := .venv-sglang-check

# SGLang 0.5.23 depends on HuggingFace's `kernels` (import name `kernels`): installed at SGLang's
# pin beside the project (editable here; a non-editable copy in project-wheel/, rebuilt per run),
# so the check proves the project's namespace never shadows it.
HF_KERNELS_PIN ?= kernels>=0.14.1,<0.15
# The real-stack run (tests/sglang_check/real_stack.py) imports SGLang 0.5.23's own device pools,
# `sglang.srt.utils` and `sglang/__init__`, so the venv holds the pure-Python packages they import
# (SGLang's pins where it has one). CUDA-only wheels (sglang-kernel, flashinfer, deep-ep, ...) and
# torchvision (PyPI's wheel is the CUDA build) are not installed; the check stubs what needs them.
# The torch already installed is a constraint: none of them may replace it (with a CUDA build).
SGLANG_REAL_DEPS ?= orjson pybase64 requests pillow starlette pydantic pyzmq IPython aiohttp \
	'transformers==5.19.0' 'apache-tvm-ffi==0.1.11' 'sentencepiece==0.2.1' dill \
	'compressed-tensors==0.18.0' gguf partial_json_parser 'openai==2.8.0' datasets \
	setproctitle einops uvicorn fastapi prometheus_client

# Mooncake (the CPU/TCP wheel, as for `make test`): the L3 rows on a real loopback mooncake_master
# run where it imports and the loopback shim builds, and report themselves skipped otherwise.
$(SGLANG_VENV)/.installed: Makefile pyproject.toml mk/mooncake.mk
	$(PY) -m venv $(SGLANG_VENV)
	$(call cpu_torch,$(SGLANG_VENV)/bin/pip)
	$(SGLANG_VENV)/bin/pip install -q triton numpy psutil msgspec '$(HF_KERNELS_PIN)'
	$(SGLANG_VENV)/bin/pip freeze | grep -i '^torch==' > $(SGLANG_VENV)/torch-pin.txt
	$(SGLANG_VENV)/bin/pip install -q -c $(SGLANG_VENV)/torch-pin.txt $(SGLANG_REAL_DEPS)
	$(SGLANG_VENV)/bin/pip install -q --no-deps -e .
	@$(call mooncake_install,$(SGLANG_VENV))
	@touch $@

sglang-check: $(SGLANG_VENV)/.installed
	@$(call loopback_shim)
	@for pin in $(SGLANG_PINS); do \
		if [ ! -f $(SGLANG_VENV)/sglang-$$pin/.done ]; then \
			echo "[sglang-check] pip install --no-deps sglang==$$pin"; \
			rm -rf $(SGLANG_VENV)/sglang-$$pin; \
			$(SGLANG_VENV)/bin/pip install -q --no-deps --target $(SGLANG_VENV)/sglang-$$pin \
				sglang==$$pin && touch $(SGLANG_VENV)/sglang-$$pin/.done || exit 1; \
		fi; \
	done
	@rm -rf $(SGLANG_VENV)/project-wheel
	$(SGLANG_VENV)/bin/pip install -q --no-deps --target $(SGLANG_VENV)/project-wheel .
	PYTHONPATH=$(CURDIR) $(SGLANG_VENV)/bin/python -m tests.sglang_check \
		--venv $(SGLANG_VENV) --pins $(SGLANG_PINS)

# This project's RadixCache against SGLang's own trees (its Python RadixCache and its
# UnifiedRadixCache with the Rust TreeCore shipped in the wheel) on the bench_cache_ops trace, CPU
# only. Reuses the sglang-check venv and its pin directory; adds only `packaging` (called by
# sglang.srt.utils at import) in bench-deps/. Unrelated imports are stubbed and listed in
# bench/cache_ops/sglang_loader.py. BENCH_VS_ARGS: e.g. --quick, or --steps 2000 --sizes 10000 100000.
# The stub list of bench/cache_ops/sglang_loader.py is made for this release.
BENCH_VS_PIN := 0.5.23
BENCH_VS_ARGS ?= --steps 2000
BENCH_VS_SITE := $(SGLANG_VENV)/sglang-$(BENCH_VS_PIN)

$(BENCH_VS_SITE)/.done: | $(SGLANG_VENV)/.installed
	rm -rf $(BENCH_VS_SITE)
	$(SGLANG_VENV)/bin/pip install -q --no-deps --target $(BENCH_VS_SITE) sglang==$(BENCH_VS_PIN)
	@touch $@

$(SGLANG_VENV)/bench-deps/.done: | $(SGLANG_VENV)/.installed
	rm -rf $(SGLANG_VENV)/bench-deps
	$(SGLANG_VENV)/bin/pip install -q --no-deps --target $(SGLANG_VENV)/bench-deps packaging \
		psutil msgspec
	@touch $@

bench-vs-sglang: $(BENCH_VS_SITE)/.done $(SGLANG_VENV)/bench-deps/.done
	OMP_NUM_THREADS=1 PYTHONPATH=$(CURDIR) $(SGLANG_VENV)/bin/python -m bench.cache_ops \
		--against-sglang --sglang-site $(BENCH_VS_SITE) --out results $(BENCH_VS_ARGS)

# The whole Mooncake FAST'25 conversation trace through the tree and tiers (about 10 minutes on
# 2 cores), with SGLang 0.5.23's trees beside the project's for the bookkeeping cost.
bench-trace: $(STAMP) $(BENCH_VS_SITE)/.done $(SGLANG_VENV)/bench-deps/.done
	OMP_NUM_THREADS=1 PYTHONPATH=$(SGLANG_VENV)/bench-deps $(BIN)/python -m bench.trace \
		--sglang-site $(BENCH_VS_SITE) --out results/trace

clean:
	rm -rf $(VENV) $(SGLANG_VENV) build *.egg-info .pytest_cache
