"""``benchmarks/gpu_check.py``, the one-sitting GPU check, run on the CPU as its docstring writes it
(``--device cpu --size tiny``): every check runs the same code as on a GPU and passes, the JSON and the
Markdown table are written; ``--resume`` keeps what a sitting finished; a spent budget runs nothing; without
a GPU the default ``--device cuda`` says so and exits 0."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "benchmarks" / "gpu_check.py"
CHECKS = ["environment", "numerics", "cuda_tests", "train_hybridnorm_star_ac_off", "train_hybridnorm_star_ac_on",
          "train_pre_ac_off", "train_pre_ac_on", "fsdp_resume", "generate_export", "mfu", "memory_vs_plan"]


def _run(*args: str, cache: Path, timeout: float = 900) -> subprocess.CompletedProcess:
    env = {**os.environ, "HYBRIDNORM_CACHE": str(cache), "OMP_NUM_THREADS": "2"}
    return subprocess.run([sys.executable, str(SCRIPT), *args], cwd=ROOT, capture_output=True, text=True,
                          timeout=timeout, env=env)


@pytest.fixture(scope="module")
def sitting(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path, subprocess.CompletedProcess]:
    out, cache = tmp_path_factory.mktemp("gpu_check"), tmp_path_factory.mktemp("cache")
    return out, cache, _run("--device", "cpu", "--size", "tiny", "--out", str(out), cache=cache)


def test_cpu_smoke_runs_every_check_and_passes(sitting):
    out, _, done = sitting
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    report = json.loads((out / "gpu_check.json").read_text())
    assert list(report["checks"]) == CHECKS
    status = {n: r["status"] for n, r in report["checks"].items()}
    assert status == {**dict.fromkeys(CHECKS, "pass"), "memory_vs_plan": "skip"}  # no CUDA allocator on a CPU
    checks = report["checks"]
    assert checks["environment"]["details"]["torch"] == torch.__version__ and len(report["commit"]) == 40
    # the compile counters come from the trainer's own metrics: HybridNorm*'s first block is its own graph
    assert checks["train_hybridnorm_star_ac_off"]["details"]["graphs"] == 2
    assert checks["train_pre_ac_on"]["details"]["graphs"] == 1
    assert all(checks[n]["details"]["recompiles_after_step_1"] == 0 for n in CHECKS if n.startswith("train_"))
    assert checks["fsdp_resume"]["details"]["sharded_files"] == ["model-r00000.safetensors",
                                                                 "optimizer-r00000.safetensors"]
    assert checks["generate_export"]["details"]["greedy_tokens_checked"] > 0
    assert [(r["placement"], r["ac"]) for r in report["mfu"]] == [("hybridnorm_star", False), ("hybridnorm_star", True),
                                                                  ("pre", False), ("pre", True)]
    table = (out / "gpu_check.md").read_text()
    assert all(f"| {n} | " in table for n in CHECKS) and "| hybridnorm_star | on | 2 × 64 |" in table


def test_resume_keeps_finished_checks_and_a_spent_budget_runs_nothing(sitting, tmp_path):
    out, cache, _ = sitting
    before = json.loads((out / "gpu_check.json").read_text())["checks"]
    again = _run("--device", "cpu", "--size", "tiny", "--out", str(out), "--resume", cache=cache, timeout=300)
    assert again.returncode == 0, again.stderr[-3000:]
    after = json.loads((out / "gpu_check.json").read_text())["checks"]
    assert {n: r["seconds"] for n, r in after.items() if n != "environment"} == \
        {n: r["seconds"] for n, r in before.items() if n != "environment"}  # nothing re-run

    fresh = tmp_path / "fresh"
    spent = _run("--device", "cpu", "--size", "tiny", "--out", str(fresh), "--budget-s", "0", "--only", "numerics",
                 cache=cache, timeout=300)
    assert spent.returncode == 0, spent.stderr[-3000:]
    checks = json.loads((fresh / "gpu_check.json").read_text())["checks"]
    assert {n: r["status"] for n, r in checks.items()} == {"environment": "not run", "numerics": "not run"}


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the message of a machine without a GPU")
def test_without_a_gpu_the_default_says_so_and_exits_0(tmp_path):
    done = _run("--out", str(tmp_path / "x"), cache=tmp_path, timeout=120)
    assert done.returncode == 0 and "no CUDA GPU here" in done.stdout
    assert not (tmp_path / "x").exists()


def test_the_sitting_runs_every_file_that_holds_cuda_tests():
    """A ``cuda``-marked test in a file the sitting does not list would never run on a GPU: every test file that
    marks one is in ``gpu_check_steps.CUDA_TEST_FILES``, and every listed file marks one."""
    import importlib.util
    import re

    spec = importlib.util.spec_from_file_location("gpu_check_steps", ROOT / "benchmarks" / "gpu_check_steps.py")
    steps = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(steps)
    marked = {p.relative_to(ROOT).as_posix() for p in (ROOT / "tests").rglob("test_*.py")
              if re.search(r"pytest\.mark\.cuda|^@cuda\b", p.read_text(encoding="utf-8"), flags=re.M)}
    assert marked == set(steps.CUDA_TEST_FILES)
