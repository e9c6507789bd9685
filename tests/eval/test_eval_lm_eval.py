"""The lm-eval adapter end to end: the shipped kjv_mc task from another directory, and tasks of all three
request kinds from a temporary --include-path folder, cross-checked against the built-in evaluators on
the same items. lm_eval is the optional extra: those tests skip with a reason when it is missing, while
the tests that it stays optional always run."""

from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path

import pytest
from eval_helpers import task_folder

from hybridnorm.errors import ConfigError
from hybridnorm.eval import TASKS_DIR
from hybridnorm.eval.multiple_choice import evaluate_mc, read_mc_jsonl
from hybridnorm.eval.perplexity import perplexity
from hybridnorm.eval.scoring import greedy_until

SHIPPED = TASKS_DIR / "kjv_mc" / "kjv_mc.jsonl"
REASON = "lm_eval is not installed: the lm-eval adapter needs the optional extra pip install 'hybridnorm[eval]'"

MC = [{"context": "The lord said", "endings": ["unto moses", "go", "by day and by night"], "label": 1},
      {"context": "And the river", "endings": ["ran dry", "x", "was built upon a hill"], "label": 2},
      {"context": "Milk and", "endings": ["honey", "qz", "the people shall keep my law"], "label": 0},
      {"context": "Behold the city", "endings": ["was built", "of brass", "upon a hill"], "label": 0}]
ROLL = [{"text": "the lord said unto moses and aaron"}, {"text": "behold the river ran dry " * 4}]
GEN = [{"context": "The lord said", "answer": "unto"}, {"context": "Behold", "answer": "the"}]

# Jinja templates on purpose: the shipped task uses plain field names, so this is a second code path.
TASKS = {
    "tmp_mc": "output_type: multiple_choice\ndoc_to_text: '{{context}}'\ndoc_to_choice: '{{endings}}'\n"
              "doc_to_target: '{{label}}'\nmetric_list:\n  - metric: acc\n  - metric: acc_norm\n",
    "tmp_roll": "output_type: loglikelihood_rolling\ndoc_to_text: ''\ndoc_to_target: '{{text}}'\n"
                "metric_list:\n  - metric: bits_per_byte\n  - metric: word_perplexity\n",
    "tmp_gen": "output_type: generate_until\ndoc_to_text: '{{context}}'\ndoc_to_target: '{{answer}}'\n"
               "generation_kwargs:\n  until: ['.', 'x']\n  max_gen_toks: 6\n  do_sample: false\n"
               "metric_list:\n  - metric: exact_match\n",
}


@pytest.fixture
def lm_eval():
    return pytest.importorskip("lm_eval", reason=REASON)


def _include_folder(root: Path) -> Path:
    """Three tasks reading JSONL through datasets' ``json`` builder by absolute path."""
    docs = {"tmp_mc": MC, "tmp_roll": ROLL, "tmp_gen": GEN}
    return task_folder(root, {name: (docs[name], body) for name, body in TASKS.items()})


def _samples(res: dict, task: str) -> list[dict]:
    return sorted(res["samples"][task], key=lambda s: s["doc_id"])


def test_shipped_kjv_mc_runs_from_any_directory_and_equals_the_builtin_evaluator(lm_eval, run_dir, model, tok,
                                                                                   tmp_path, monkeypatch):
    from hybridnorm.eval import run_lm_eval

    monkeypatch.chdir(tmp_path)  # the task's data must not depend on the working directory
    res = run_lm_eval(run_dir, "kjv_mc", limit=12, batch_size=4, log_samples=True, include_defaults=False)
    got = res["results"]["kjv_mc"]
    assert res["n-samples"]["kjv_mc"] == {"original": 200, "effective": 12}
    ours = evaluate_mc(model, tok, SHIPPED, limit=12)
    assert (got["acc,none"], got["acc_norm,none"]) == pytest.approx((ours.acc, ours.acc_norm))
    assert got["acc_stderr,none"] == pytest.approx(ours.acc_stderr)
    for s, item in zip(_samples(res, "kjv_mc"), ours.items, strict=True):
        assert [ll for ll, _ in s["filtered_resps"]] == pytest.approx(list(item.loglikelihoods), rel=1e-5, abs=1e-5)
        assert (s["acc"], s["acc_norm"]) == (float(item.correct), float(item.correct_norm))
    assert res["config"]["checkpoint"].endswith("step_000000")  # the adapter's get_model_info


def test_include_path_tasks_of_every_request_kind_agree_with_the_builtin_evaluators(lm_eval, run_dir, model, tok,
                                                                                     tmp_path):
    from hybridnorm.eval import run_lm_eval

    folder = _include_folder(tmp_path)
    res = run_lm_eval(run_dir, ["tmp_mc", "tmp_roll", "tmp_gen"], include_path=folder, log_samples=True,
                      include_defaults=False)
    r = res["results"]
    mc = evaluate_mc(model, tok, tmp_path / "tmp_mc.jsonl")
    assert mc.acc != mc.acc_norm  # the cross-check covers both metrics' definitions
    assert (r["tmp_mc"]["acc,none"], r["tmp_mc"]["acc_norm,none"]) == pytest.approx((mc.acc, mc.acc_norm))
    for s, item in zip(_samples(res, "tmp_mc"), mc.items, strict=True):
        assert [ll for ll, _ in s["filtered_resps"]] == pytest.approx(list(item.loglikelihoods), rel=1e-5, abs=1e-5)
    ppl = perplexity(model, tok, [d["text"] for d in ROLL])
    assert r["tmp_roll"]["bits_per_byte,none"] == pytest.approx(ppl.bits_per_byte, rel=1e-6)
    assert r["tmp_roll"]["word_perplexity,none"] == pytest.approx(ppl.word_perplexity, rel=1e-6)
    gens = [s["filtered_resps"][0] for s in _samples(res, "tmp_gen")]
    assert gens == [greedy_until(model, tok, d["context"], [".", "x", "<|endoftext|>"], 6) for d in GEN]
    assert all(len(g.encode()) <= 6 and "." not in g for g in gens)


def test_registered_model_builds_from_model_args(lm_eval, run_dir):
    from lm_eval.api.registry import get_model

    from hybridnorm.eval.lm_eval_adapter import HybridNormLM

    cls = get_model("hybridnorm")
    assert cls is HybridNormLM
    lm = cls.create_from_arg_string(f"pretrained={run_dir},batch_size=4", {"device": "cpu"})
    assert lm.batch_size == 4 and str(lm.device) == "cpu" and lm.run.run_dir == run_dir
    with pytest.raises(ConfigError, match=r"unknown hybridnorm model_args 'revision'; valid: .*device, dtype,"):
        cls.create_from_arg_string(f"pretrained={run_dir},revision=main")
    with pytest.raises(ConfigError, match="dtype='bf16' is not one of auto, float32, bfloat16, float16"):
        cls.create_from_arg_string(f"pretrained={run_dir},dtype=bf16")  # HFLM's names (test_eval_lm_eval_limit_dtype)
    assert cls(run_dir, batch_size="auto").batch_size == "auto"  # tests/eval/test_eval_auto_batch.py
    with pytest.raises(ConfigError, match="batch_size='auto:none'"):
        cls(run_dir, batch_size="auto:none")


def test_the_documented_python_block_runs_as_written(lm_eval, run_dir, monkeypatch):
    """docs/evaluation.md's Python block, with its run path pointed at a test run: both routes run the shipped
    task and agree. Its ``simple_evaluate`` line named no task manager before 2026-12-02, and lm-eval's own index,
    which lacks kjv_mc, failed it with ``KeyError: "Spec 'kjv_mc' is not a registered task..."``."""
    doc = Path(__file__).resolve().parents[2] / "docs" / "evaluation.md"
    (block,) = re.findall(r"```python\n(.*?)```", doc.read_text(encoding="utf-8"), flags=re.S)
    assert block.count("runs/kjv-hybridnorm-star") == 2
    monkeypatch.chdir(run_dir.parent)
    printed: list = []
    names: dict = {"print": printed.append}  # the block's print, only
    exec(compile(block.replace("runs/kjv-hybridnorm-star", run_dir.name), str(doc), "exec"), names)
    assert printed == [names["res"]["results"]["kjv_mc"]["acc_norm,none"]]


def test_unknown_tasks_and_bad_include_paths_are_config_errors(lm_eval, run_dir, tmp_path):
    from hybridnorm.eval import run_lm_eval

    with pytest.raises(ConfigError, match=r"unknown lm-eval task.*'no_such_task'; looked in .*tasks"):
        run_lm_eval(run_dir, "kjv_mc,no_such_task", include_defaults=False)
    with pytest.raises(ConfigError, match=r"nowhere.*not a folder"):
        run_lm_eval(run_dir, "kjv_mc", include_path=tmp_path / "nowhere")
    (tmp_path / "t").mkdir()
    (tmp_path / "t" / "broken.yaml").write_text(
        f"task: broken\ndataset_path: json\ndataset_kwargs:\n  data_files: {tmp_path / 'missing.jsonl'}\n"
        "test_split: train\noutput_type: multiple_choice\ndoc_to_text: context\ndoc_to_choice: endings\n"
        "doc_to_target: label\n", encoding="utf-8")
    with pytest.raises(ConfigError, match=r"lm-eval could not run broken:.*missing\.jsonl"):
        run_lm_eval(run_dir, "broken", include_path=tmp_path / "t", include_defaults=False)


def test_lm_eval_stays_optional(run_dir):
    """In a fresh process: importing hybridnorm (and its eval package and CLI) never imports lm_eval, and
    with lm_eval made unimportable run_lm_eval and `hybridnorm eval --tasks` say what to install."""
    code = f"""
import sys
import hybridnorm, hybridnorm.eval, hybridnorm.eval.scoring, hybridnorm.eval.multiple_choice, hybridnorm.cli
assert "lm_eval" not in sys.modules, "importing hybridnorm imported lm_eval"
sys.modules["lm_eval"] = None  # what a missing install looks like to import
from hybridnorm.errors import ConfigError
from hybridnorm.eval import run_lm_eval
try:
    run_lm_eval({str(run_dir)!r}, "kjv_mc")
except ConfigError as e:
    print("CONFIG_ERROR", e)
sys.exit(hybridnorm.cli.main(["eval", {str(run_dir)!r}, "--tasks", "kjv_mc"]))
"""
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2, proc.stderr
    assert "CONFIG_ERROR" in proc.stdout and "pip install 'hybridnorm[eval]'" in proc.stdout
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: ") and "pip install 'hybridnorm[eval]'" in lines[0]


def test_shipped_task_files_are_consistent():
    """The YAML names its hook, the JSONL is what the generator writes, and the built-in reader takes it."""
    from hybridnorm.eval import make_kjv_task

    yaml_text = (TASKS_DIR / "kjv_mc" / "kjv_mc.yaml").read_text(encoding="utf-8")
    assert "task: kjv_mc" in yaml_text and "!function kjv_mc_data.load" in yaml_text
    config_lines = [line for line in yaml_text.splitlines() if not line.lstrip().startswith("#")]
    assert not any("data_files" in line for line in config_lines)  # a relative one would depend on the CWD
    assert make_kjv_task.main(["--check"]) == 0
    items = read_mc_jsonl(SHIPPED)
    assert len(items) == 200 and all(len(it.endings) == 4 for it in items)
    assert all(len(set(it.endings)) == 4 for it in items)
    records = [json.loads(line) for line in SHIPPED.read_text(encoding="utf-8").splitlines()]
    books = {r["citation"].rsplit(" ", 1)[0] for r in records}
    from hybridnorm.data import KJV_VAL_BOOKS

    assert books <= set(KJV_VAL_BOOKS)  # held-out text only
