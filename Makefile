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

.PHONY: test bench lint clean

$(STAMP): pyproject.toml Makefile
	@if $(PY) -c "import torch, sys; sys.exit(0 if torch.cuda.is_available() else 1)" 2>/dev/null; then \
		echo "[setup] CUDA torch found for $(PY): venv shares its site-packages"; \
		$(PY) -m venv --system-site-packages $(VENV); \
	else \
		$(PY) -m venv $(VENV); \
		if command -v nvidia-smi >/dev/null 2>&1 && nvidia-smi -L >/dev/null 2>&1; then \
			echo "[setup] NVIDIA GPU without a CUDA torch: installing torch (CUDA build)"; \
			$(BIN)/pip install -q torch; \
		elif $(PY) -c "import urllib.request as u; u.urlopen('$(CPU_INDEX)/torch/', timeout=10)" \
				>/dev/null 2>&1; then \
			echo "[setup] no CUDA device: installing the CPU build ($(CPU_TORCH)) from $(CPU_INDEX)"; \
			$(BIN)/pip install -q --index-url $(CPU_INDEX) $(CPU_TORCH) || { \
				echo "[setup] $(CPU_INDEX) failed: $(CPU_TORCH) from the default index"; \
				$(BIN)/pip install -q $(CPU_TORCH); }; \
		else \
			echo "[setup] no CUDA device; $(CPU_INDEX) unreachable: $(CPU_TORCH) from the default index"; \
			$(BIN)/pip install -q $(CPU_TORCH); \
		fi; \
	fi
	$(BIN)/pip install -q -e '.[test,bench]'
	@touch $(STAMP)

test: $(STAMP)
	$(BIN)/python -m pytest -q

bench: $(STAMP)
	$(BIN)/python -m bench

lint: $(STAMP)
	$(BIN)/pip install -q ruff && $(BIN)/ruff check .

clean:
	rm -rf $(VENV) build *.egg-info .pytest_cache
