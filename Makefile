# The two commands of the README. Each installs what it needs first (torch pinned to the local CPU wheel
# on this machine kind; override with `make test TORCH=torch` elsewhere).
PY ?= python3
TORCH ?= torch==2.13.0

.PHONY: install test bench docs

install:
	$(PY) -m pip install -q "$(TORCH)" -e ".[dev]"

test: install
	$(PY) -m ruff check src tests benchmarks
	$(PY) -m hybridnorm.placements.docs --check docs/placements.md
	$(PY) -m pytest tests

bench: install
	$(PY) benchmarks/train_step.py

docs:
	$(PY) -m hybridnorm.placements.docs > docs/placements.md
