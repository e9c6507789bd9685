"""An exported HybridNorm* run in the tools users hand it to, through their own entry points: a greedy
``generate()`` equals ``hybridnorm generate --temperature 0`` token for token (cached and uncached, one
prompt and a left-padded batch), ``pipeline("text-generation")`` prints the same text, and lm-eval's
``--model hf`` backend, in process and from its own command line with ``trust_remote_code=True``, scores
every request as ``hybridnorm eval --tasks`` does."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("transformers", reason="the hf extra (transformers) is not installed")
from train_helpers import cli_in_process  # tests/
from transformers import AutoModelForCausalLM, AutoTokenizer, pipeline

import hybridnorm.hf  # noqa: F401  (registers the Auto classes)
from hybridnorm.hf.export import export_run
from hybridnorm.loading import load_run

NEW = 24
PROMPTS = ["and the", "the people shall keep my"]


@pytest.fixture(scope="module")
def exported(tmp_path_factory: pytest.TempPathFactory, trained_run: Path) -> Path:
    out = tmp_path_factory.mktemp("exported") / "hf"
    assert export_run(trained_run, out).class_name == "HybridNormForCausalLM"
    return out


def cli_generate(run: Path, prompt: str) -> str:
    return cli_in_process("generate", str(run), "--prompt", prompt, "--temperature", "0", "--max-new-tokens",
                          str(NEW)).stdout.rstrip("\n")


def test_generate_equals_the_cli_cached_uncached_single_and_left_padded(trained_run: Path, exported: Path) -> None:
    run = load_run(trained_run)
    hf = AutoModelForCausalLM.from_pretrained(exported).eval()
    tok = AutoTokenizer.from_pretrained(exported, padding_side="left")
    texts = [cli_generate(trained_run, p) for p in PROMPTS]
    for prompt, text in zip(PROMPTS, texts, strict=True):
        enc = tok(prompt, return_tensors="pt")
        for use_cache in (True, False):
            out = hf.generate(**enc, max_new_tokens=NEW, min_new_tokens=NEW, do_sample=False, use_cache=use_cache)
            assert run.tokenizer.eot_id not in out[0, 1:].tolist()  # the CLI does not stop at one: compare text
            assert tok.decode(out[0], skip_special_tokens=True) == text
    batch = tok(PROMPTS, return_tensors="pt", padding=True)
    assert batch["attention_mask"][0, 0] == 0  # the short prompt really is padded
    for use_cache in (True, False):
        out = hf.generate(**batch, max_new_tokens=NEW, min_new_tokens=NEW, do_sample=False, use_cache=use_cache)
        assert tok.batch_decode(out, skip_special_tokens=True) == texts


def test_pipeline_text_generation_prints_the_cli_text(trained_run: Path, exported: Path) -> None:
    gen = pipeline("text-generation", model=str(exported), device="cpu")
    for prompt in PROMPTS:
        got = gen(prompt, max_new_tokens=NEW, min_new_tokens=NEW, do_sample=False)[0]["generated_text"]
        assert got == cli_generate(trained_run, prompt)


def test_lm_eval_hf_backend_scores_like_hybridnorm_eval_tasks(trained_run: Path, exported: Path) -> None:
    """Defaults only: the exported tokenizer prepends <|endoftext|> itself, as our adapter does."""
    lm_eval = pytest.importorskip("lm_eval", reason="the eval extra (lm_eval) is not installed")
    pytest.importorskip("accelerate", reason="lm-eval's HFLM needs accelerate (in the dev extra)")
    from lm_eval.models.huggingface import HFLM  # what `lm_eval --model hf` builds

    from hybridnorm.eval.lm_eval_adapter import run_lm_eval, task_manager

    ours = run_lm_eval(trained_run, ["kjv_mc"], limit=6, log_samples=True)
    hflm = HFLM(pretrained=str(exported), batch_size=3, device="cpu")
    theirs = lm_eval.simple_evaluate(model=hflm, tasks=["kjv_mc"], limit=6, log_samples=True,
                                     task_manager=task_manager(["kjv_mc"]))
    a = [[r[0] for r in s["filtered_resps"]] for s in ours["samples"]["kjv_mc"]]
    b = [[r[0] for r in s["filtered_resps"]] for s in theirs["samples"]["kjv_mc"]]
    assert len(a) == len(b) == 6
    for x, y in zip(a, b, strict=True):
        assert x == pytest.approx(y, rel=1e-5, abs=1e-4)
    for metric in ("acc,none", "acc_norm,none"):
        assert ours["results"]["kjv_mc"][metric] == theirs["results"]["kjv_mc"][metric]


def test_lm_eval_command_line_with_trust_remote_code_scores_like_hybridnorm_eval(
        trained_run: Path, exported: Path, tmp_path: Path) -> None:
    """docs/evaluation.md's route for a placement without a stock class, as a user types it: lm-eval's own
    command line in a fresh process (nothing of ours imported first), our class reached only through the
    folder's ``auto_map`` and ``trust_remote_code=True``. Its logged per-request log-likelihoods must be
    ours."""
    pytest.importorskip("lm_eval", reason="the eval extra (lm_eval) is not installed")
    pytest.importorskip("accelerate", reason="lm-eval's HFLM needs accelerate (in the dev extra)")
    from hybridnorm.eval.lm_eval_adapter import run_lm_eval
    from hybridnorm.eval.paths import TASKS_DIR

    env = {**os.environ, "HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1", "HF_HOME": str(tmp_path / "hf_home")}
    cmd = [sys.executable, "-m", "lm_eval", "--model", "hf", "--model_args",
           f"pretrained={exported},trust_remote_code=True", "--tasks", "kjv_mc", "--include_path", str(TASKS_DIR),
           "--limit", "5", "--device", "cpu", "--batch_size", "2", "--log_samples", "--output_path",
           str(tmp_path / "out")]
    proc = subprocess.run(cmd, capture_output=True, text=True, cwd=tmp_path, env=env, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    (samples,) = (tmp_path / "out").rglob("samples_kjv_mc_*.jsonl")
    theirs = [json.loads(line) for line in samples.read_text(encoding="utf-8").splitlines()]
    theirs.sort(key=lambda s: s["doc_id"])
    ours = run_lm_eval(trained_run, ["kjv_mc"], limit=5, log_samples=True)["samples"]["kjv_mc"]
    assert [s["doc_id"] for s in theirs] == [s["doc_id"] for s in ours] == list(range(5))
    for o, t in zip(ours, theirs, strict=True):
        assert [float(r[0]) for r in t["filtered_resps"]] == pytest.approx(
            [r[0] for r in o["filtered_resps"]], rel=1e-5, abs=1e-4)
        assert t["acc"] == o["acc"] and t["acc_norm"] == o["acc_norm"]
