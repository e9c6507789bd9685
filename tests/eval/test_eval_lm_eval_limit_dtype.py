"""``--limit`` as a fraction and the ``dtype`` model arg, each against lm-eval's own Hugging Face backend
(``HFLM``) on the stock ``LlamaForCausalLM`` that ``hybridnorm export`` writes of the same weights.
Before 2026-12-02 ``--limit 0.5`` was refused (lm-eval takes a fraction of each task's documents) and
``model_args="...,dtype=bfloat16"`` was an unknown model arg (HFLM takes it)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from eval_helpers import task_folder, write_jsonl

from hybridnorm import ModelConfig, TransformerLM, cli
from hybridnorm.data.tokenizer import ByteTokenizer
from hybridnorm.errors import ConfigError

lm_eval = pytest.importorskip("lm_eval", reason="the eval extra (lm_eval) is not installed")
pytest.importorskip("transformers", reason="the hf extra (transformers) is not installed")
pytest.importorskip("accelerate", reason="lm-eval's HFLM needs accelerate (in the dev extra)")

from hybridnorm.eval.lm_eval_adapter import run_lm_eval, task_manager  # noqa: E402
from hybridnorm.hf.export import export_model, import_hf  # noqa: E402

WORDS = "the lord said unto moses and aaron go forth into a land of milk and honey where the people".split()
QUESTIONS = [{"context": " ".join(WORDS[i:i + 6]).capitalize(), "endings": [" ".join(WORDS[j:j + 3]) for j in
                                                                            (i + 6, i + 1, i + 9)], "label": 0}
             for i in range(7)]  # 7: half is 3.5 documents, which lm-eval rounds up to 4
MC_TASK = ("output_type: multiple_choice\ndoc_to_text: '{{context}}'\ndoc_to_choice: '{{endings}}'\n"
           "doc_to_target: '{{label}}'\nmetric_list:\n  - metric: acc\n  - metric: acc_norm\n")


@pytest.fixture(scope="module")
def exported(tmp_path_factory) -> tuple[Path, Path, Path, Path]:
    """(the HF folder, the run imported from it, a task folder with ``lim_mc``, the same questions as --mc)."""
    root = tmp_path_factory.mktemp("limit_dtype")
    torch.manual_seed(0)
    mc = ModelConfig(vocab_size=257, d_model=64, n_layers=2, n_heads=4, ffn_hidden_size=96, max_seq_len=256,
                     placement="pre")
    assert export_model(TransformerLM(mc), root / "hf", ByteTokenizer()).class_name == "LlamaForCausalLM"
    import_hf(root / "hf", root / "run")
    return (root / "hf", root / "run", task_folder(root, {"lim_mc": (QUESTIONS, MC_TASK)}),
            write_jsonl(root / "q.jsonl", QUESTIONS))


def _hflm(hf: Path, tasks: Path, **kw: object) -> dict:
    from lm_eval.models.huggingface import HFLM

    # add_bos_token: HFLM then prefixes the tokenizer's bos (<|endoftext|>), as our adapter always does
    model = HFLM(pretrained=str(hf), batch_size=4, add_bos_token=True, device="cpu", **kw.pop("model_kw", {}))
    return lm_eval.simple_evaluate(model=model, tasks=["lim_mc"], log_samples=True,
                                   task_manager=task_manager(["lim_mc"], tasks), **kw)


def _logliks(samples: list[dict]) -> dict[int, list[float]]:
    """doc_id -> each choice's log-likelihood (lm-eval's samples files hold them as text)."""
    return {s["doc_id"]: [float(r[0]) for r in s["filtered_resps"]] for s in samples}


def test_limit_half_scores_the_documents_lm_eval_scores_and_mc_takes_it_too(exported, tmp_path, capsys):
    hf, run, tasks, questions = exported
    out = tmp_path / "r.json"
    assert cli.main(["eval", str(run), "--tasks", "lim_mc", "--include-path", str(tasks), "--mc", str(questions),
                     "--limit", "0.5", "--output", str(out), "--log-samples"]) == 0
    ours = _logliks([json.loads(x) for x in (tmp_path / "r_samples_lim_mc.jsonl").read_text().splitlines()])
    theirs = _hflm(hf, tasks, limit=0.5)
    assert theirs["config"]["limit"] == 0.5 and theirs["n-samples"]["lim_mc"]["effective"] == 4
    expected = _logliks(theirs["samples"]["lim_mc"])
    assert sorted(ours) == sorted(expected) == [0, 1, 2, 3]
    for doc in expected:
        assert ours[doc] == pytest.approx(expected[doc], rel=1e-6, abs=1e-4), doc  # fp32, other model code
    result = json.loads(out.read_text(encoding="utf-8"))
    assert result["lm_eval"]["config"]["limit"] == 0.5
    assert result["lm_eval"]["n-samples"]["lim_mc"]["effective"] == 4
    mc = result["mc"]  # --mc: the same first half of the same questions, rounded up the same way
    assert mc["n"] == 4 and [it["index"] for it in mc["items"]] == [0, 1, 2, 3]
    for it in mc["items"]:
        assert it["loglikelihoods"] == pytest.approx(expected[it["index"]], rel=1e-6, abs=1e-4)


@pytest.mark.parametrize(("argv", "needle"), [
    (["--tasks", "kjv_mc", "--limit", "1.5"], "--limit='1.5' must be a whole number of documents >= 1 or a fraction"),
    (["--tasks", "kjv_mc", "--limit", "0"], "--limit='0' must be"),
    (["--tasks", "kjv_mc", "--limit", "-0.5"], "--limit='-0.5' must be"),
    (["--tasks", "kjv_mc", "--limit", "half"], "--limit='half' must be"),
    (["--text", "kjv", "--limit", "5"], "--limit only applies to --mc and --tasks"),  # was: ignored
    (["--tasks", "kjv_mc", "--dtype", "int8"], "--dtype='int8' is not one of auto, float32, bfloat16, float16"),
])
def test_a_bad_limit_or_dtype_is_one_error_line(exported, argv, needle, capsys):
    capsys.readouterr()
    assert cli.main(["eval", str(exported[1]), *argv]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("error: ") and needle in err[0], err


def test_dtype_bfloat16_runs_in_bf16_and_scores_as_hflm_does_in_bf16(exported, tmp_path):
    hf, run, tasks, _ = exported
    tm = task_manager(["lim_mc"], tasks)

    def ours(dtype: str) -> dict:  # through lm-eval's own entry point: the registered model and its model_args
        return lm_eval.simple_evaluate(model="hybridnorm", model_args=f"pretrained={run},device=cpu,dtype={dtype}",
                                       tasks=["lim_mc"], log_samples=True, task_manager=tm)

    bf16, fp32 = ours("bfloat16"), ours("float32")
    assert bf16["config"]["model_dtype"] == "torch.bfloat16" and fp32["config"]["model_dtype"] == "torch.float32"
    a, b = _logliks(bf16["samples"]["lim_mc"]), _logliks(fp32["samples"]["lim_mc"])
    # HFLM in bf16 with its log-softmax in fp32 (softmax_dtype): as ours, whose norms and log-softmax are fp32
    theirs = _hflm(hf, tasks, model_kw={"dtype": "bfloat16", "softmax_dtype": "float32"})
    c = _logliks(theirs["samples"]["lim_mc"])
    assert sorted(a) == sorted(c) == list(range(len(QUESTIONS)))
    # the sums are of ~20-40 log-probs of a few units each; bf16 keeps 8 significant bits (2^-8 = 0.4% per
    # rounding), and the two models round at different places (fused projections, attention kernels), so they
    # agree to about 0.1, where fp32 agrees to 1e-4 (test_eval_hflm_oracle)
    assert max(abs(x - y) for d in a for x, y in zip(a[d], c[d], strict=True)) < 0.1
    assert max(abs(x - y) for d in a for x, y in zip(a[d], b[d], strict=True)) > 1e-3  # really computed in bf16
    # the command line's --dtype: the same model, the same numbers
    out = tmp_path / "r.json"
    assert cli.main(["eval", str(run), "--tasks", "lim_mc", "--include-path", str(tasks), "--dtype", "bfloat16",
                     "--output", str(out), "--log-samples"]) == 0
    assert json.loads(out.read_text(encoding="utf-8"))["lm_eval"]["config"]["model_dtype"] == "torch.bfloat16"
    assert _logliks([json.loads(x) for x in (tmp_path / "r_samples_lim_mc.jsonl").read_text().splitlines()]) == a


def test_an_unknown_dtype_model_arg_is_refused_before_loading(exported):
    with pytest.raises(ConfigError, match=r"^dtype='fp8' is not one of auto, float32, bfloat16, float16"):
        lm_eval.simple_evaluate(model="hybridnorm", model_args=f"pretrained={exported[1]},dtype=fp8",
                                tasks=["kjv_mc"], task_manager=task_manager(["kjv_mc"]))
    with pytest.raises(ConfigError, match=r"^limit=2\.5 must be a whole number"):
        run_lm_eval(exported[1], ["kjv_mc"], limit=2.5)
