# Two commands on a fresh machine: `make demo` and `make test` (what a contributor runs: the unit
# and ranks tiers but their full-length `slow` runs, ~10 minutes here); `make test-all` runs
# everything, the system tier too (CI).
# Each creates/refreshes the local virtual environment .venv as needed.
# GPU=1 selects the CUDA stack (fbgemm-gpu, CUDA torch) instead of the CPU one.
PYTHON ?= python3
VENV ?= .venv
GPU ?= 0
PY := $(VENV)/bin/python
PIP := $(PY) -m pip
ifeq ($(GPU),1)
STAMP := $(VENV)/.installed-gpu
else
STAMP := $(VENV)/.installed-cpu
endif

.PHONY: install demo test test-all clean

install: $(STAMP)

$(STAMP): pyproject.toml Makefile
	$(PYTHON) -m venv $(VENV)
ifeq ($(GPU),1)
	$(PIP) install -e ".[gpu,test,bench,logging]"
else
	$(PIP) install -e ".[cpu,test,bench,logging]"
endif
	# torchrec without its requirements: they name the CUDA fbgemm-gpu (wrong on the CPU path)
	# and pin torchmetrics==1.0.3; its real runtime dependencies are ours.
	$(PIP) install --no-deps torchrec==1.8.0
	$(PY) -c "import torchrec, fbgemm_gpu, tensorboard, lightning_sparselift"
	rm -f $(VENV)/.installed-*
	touch $(STAMP)

demo: $(STAMP)
	$(VENV)/bin/sparselift fit --config configs/dlrm_synthetic.yaml

test: $(STAMP)
	$(PY) -m pytest -q -m "not slow" tests

test-all: $(STAMP)
	$(PY) -m pytest -q tests

clean:
	rm -rf $(VENV)
