"""``--num-fewshot`` above what a task's few-shot split holds, on ``hybridnorm eval --tasks``: one error line
naming the task, the number asked for and the most there are, for lm-eval's two samplers, the few-shot split
the evaluated one or another. Before 2026-12-02 the ``first_n`` sampler's AssertionError was a traceback (exit
1) and the default sampler's ``ValueError: Sample larger than population`` named neither. The oracle for
"the most": lm-eval itself scores the task with that many."""

from __future__ import annotations

import pytest
from eval_helpers import write_jsonl

from hybridnorm import cli

lm_eval = pytest.importorskip("lm_eval", reason="lm_eval is not installed: pip install 'hybridnorm[eval]'")
from hybridnorm.eval.lm_eval_adapter import run_lm_eval  # noqa: E402

MC = [{"context": f"The lord said {i}", "endings": ["unto moses", "go", "by day and by night"], "label": i % 3}
      for i in range(5)]
SHOTS = MC[:3]  # the other split's few-shot documents: 3


def _task(folder, name: str, sampler: str, own_split: bool) -> None:
    test, shots = write_jsonl(folder / f"{name}.jsonl", MC), write_jsonl(folder / f"{name}_shots.jsonl", SHOTS)
    (folder / f"{name}.yaml").write_text(
        f"task: {name}\ndataset_path: json\ndataset_kwargs:\n  data_files:\n    test: {test}\n    shots: {shots}\n"
        f"  cache_dir: {folder / 'hf-cache'}\ntest_split: test\nfewshot_split: {'test' if own_split else 'shots'}\n"
        f"fewshot_config:\n  sampler: {sampler}\noutput_type: multiple_choice\ndoc_to_text: '{{{{context}}}}'\n"
        "doc_to_choice: '{{endings}}'\ndoc_to_target: '{{label}}'\nmetric_list:\n  - metric: acc\n"
        "metadata:\n  version: 1.0\n", encoding="utf-8")


@pytest.mark.parametrize(("sampler", "own_split", "most"), [
    ("default", True, len(MC) - 1), ("first_n", True, len(MC) - 1),  # a document is not its own example
    ("default", False, len(SHOTS)), ("first_n", False, len(SHOTS)),
])
def test_more_shots_than_documents_is_one_error_naming_the_most(run_dir, tmp_path, capsys, sampler, own_split,
                                                                  most):
    folder = tmp_path / "tasks"
    folder.mkdir()
    _task(folder, "shots_mc", sampler, own_split)
    res = run_lm_eval(run_dir, ["shots_mc"], include_path=folder, include_defaults=False, num_fewshot=most)
    assert res["n-shot"]["shots_mc"] == most and res["n-samples"]["shots_mc"]["effective"] == len(MC)
    capsys.readouterr()
    argv = ["eval", str(run_dir), "--tasks", "shots_mc", "--include-path", str(folder), "--num-fewshot", str(most + 1)]
    assert cli.main(argv) == 2
    lines = capsys.readouterr().err.strip().splitlines()
    assert [ln for ln in lines if ln.startswith(("error", "Traceback"))] == [lines[-1]], lines
    split = "test" if own_split else "shots"
    assert lines[-1].startswith(f"error: lm-eval task 'shots_mc': {most + 1} few-shot examples asked for "), lines[-1]
    assert f"(split {split!r}) are {len(MC) if own_split else len(SHOTS)}" in lines[-1], lines[-1]
    assert f": at most {most} (" in lines[-1], lines[-1]
