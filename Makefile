# The README's commands. Each installs what it needs first (torch pinned to the local CPU wheel on this
# machine kind; elsewhere e.g. `make train TORCH=torch`).
PY ?= python3
TORCH ?= torch==2.13.0
OUT ?= runs/kjv-hybridnorm-star
ARGS ?=

.PHONY: install install-dev train test bench docs

install:
	$(PY) -m pip install -q "$(TORCH)" -e .

install-dev:
	$(PY) -m pip install -q "$(TORCH)" -e ".[dev]"

# The main job: the default small HybridNorm* LM on the embedded KJV corpus. Re-running it continues an
# interrupted run from its last checkpoint (--resume), or reports a finished one.
train: install
	$(PY) -m hybridnorm.cli train --out $(OUT) --resume $(ARGS)

test: install-dev
	$(PY) -m ruff check src tests benchmarks
	$(PY) -m hybridnorm.placements.docs --check docs/placements.md
	$(PY) -m hybridnorm.experiments.claims --check docs/results
	$(PY) -m pytest tests

bench: install-dev
	$(PY) benchmarks/train_step.py

docs:
	$(PY) -m hybridnorm.placements.docs > docs/placements.md
