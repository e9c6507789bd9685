"""The scale-out path as a user runs it: ``torchrun`` 2 CPU processes under FSDP (gloo), the same run
continued by ONE process from its sharded checkpoint, exported, and loaded by ``AutoModelForCausalLM``
with the logits of our own model."""

from __future__ import annotations

import os
import subprocess

import pytest
import torch
from train_helpers import TORCHRUN, cli_in_process, read_metrics, tiny_overrides

from hybridnorm import cli

pytestmark = pytest.mark.skipif(not torch.distributed.is_available(), reason="this torch has no torch.distributed")


def test_fsdp_run_resumes_in_one_process_and_exports(corpus, cache_dir, no_peak_measure, tmp_path):
    pytest.importorskip("transformers")
    out = tmp_path / "R"
    # 2 ranks x batch 2 = the global batch of 1 process x batch 4 below
    args = [*tiny_overrides(corpus, cache_dir, out), "--batch_size=2", "--ckpt_interval=5", "--max_steps=10"]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    proc = subprocess.run([*TORCHRUN, "--nproc_per_node", "2", "-m", "hybridnorm.cli", "train", "--parallel=fsdp",
                           *args], capture_output=True, text=True, timeout=600, env=env)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert proc.stdout.count("final: step 10") == 1  # one summary, from rank 0
    ckpt = out / "checkpoints" / "step_000010"
    assert (ckpt / "model-r00001.safetensors").is_file()  # sharded: one file per rank

    assert cli.main(["train", *tiny_overrides(corpus, cache_dir, out), "--batch_size=4", "--ckpt_interval=5",
                     "--max_steps=14", "--resume"]) == 0
    steps = [r["step"] for r in read_metrics(out)]
    assert steps == list(range(1, 15))  # 10 sharded steps, then 4 in one process: one history

    hf_dir = tmp_path / "hf"
    assert cli.main(["export", str(out), "--to", "hf", str(hf_dir)]) == 0
    from transformers import AutoModelForCausalLM

    import hybridnorm.hf  # noqa: F401  (registers the hybridnorm class with the Auto factories)
    from hybridnorm.loading import load_run

    hf = AutoModelForCausalLM.from_pretrained(hf_dir).eval()
    ours = load_run(out).model
    ids = torch.randint(0, 257, (2, 16), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        torch.testing.assert_close(hf(ids).logits, ours(ids), rtol=1e-5, atol=1e-5)


def test_a_bad_parallel_choice_is_one_error_line_naming_the_choices():
    out = cli_in_process("train", "--parallel=nope", ok=False)
    assert out.returncode == 2
    lines = out.stderr.strip().splitlines()
    assert len(lines) == 1 and "parallel" in lines[0] and "'fsdp'" in lines[0], out.stderr
