"""A task whose ``metric_list`` names a metric or an aggregation lm-eval does not know, on ``hybridnorm eval
--tasks``: one ``error:`` line naming the task and the metric, before lm-eval builds a single request (its
progress bar) or any is scored. Before 2026-12-02 lm-eval's ``KeyError: None`` was the whole message for a
metric without an aggregation, and the other two ended in ``'NoneType' object is not callable`` after every
request had been scored, the progress bars printed first. An unknown aggregation of a task named directly or
through a tag is refused before its dataset is read (since 2026-12-02)."""

from __future__ import annotations

import pytest
from eval_helpers import task_folder

from hybridnorm import cli

lm_eval = pytest.importorskip("lm_eval", reason="lm_eval is not installed: pip install 'hybridnorm[eval]'")
from hybridnorm.eval.lm_eval_adapter import HybridNormLM, run_lm_eval  # noqa: E402

MC = [{"context": "The lord said", "endings": ["unto moses", "go", "by day and by night"], "label": 1},
      {"context": "And the river", "endings": ["ran dry", "x", "was built upon a hill"], "label": 2}]
BODY = "output_type: multiple_choice\ndoc_to_text: '{{context}}'\ndoc_to_choice: '{{endings}}'\n" \
       "doc_to_target: '{{label}}'\nmetric_list:\n"
TASKS = {
    "good_mc": (MC, BODY + "  - metric: acc\n"),
    "no_such_metric": (MC, BODY + "  - metric: acc\n  - metric: nosuchmetric\n"),  # lm-eval: KeyError: None
    "no_such_metric_agg": (MC, BODY + "  - metric: nosuchmetric\n    aggregation: mean\n"),
    "no_such_agg": (MC, BODY + "  - metric: acc\n    aggregation: nosuchagg\n"),
    # its data file is removed below: an error about the aggregation, not the data, shows it came first
    "agg_before_data": (MC, "tag: agg_tag\n" + BODY + "  - metric: acc\n    aggregation: nosuchagg\n"),
    "function_agg": (MC, BODY + "  - metric: acc\n    aggregation: !function aggs.halved_mean\n"),
}


@pytest.fixture(scope="module")
def tasks(tmp_path_factory):
    folder = task_folder(tmp_path_factory.mktemp("metrics"), TASKS)
    (folder / "mixed_group.yaml").write_text("group: mixed_group\ntask:\n  - good_mc\n  - no_such_metric\n",
                                             encoding="utf-8")
    (folder.parent / "agg_before_data.jsonl").unlink()
    (folder / "aggs.py").write_text("def halved_mean(items):\n    return sum(items) / len(items) / 2\n",
                                    encoding="utf-8")
    return folder


@pytest.mark.parametrize(("names", "needles"), [
    ("no_such_metric", ["lm-eval task 'no_such_metric': metric 'nosuchmetric'", "names no aggregation",
                        "acc_norm", "mean, median"]),
    ("no_such_metric_agg", ["lm-eval task 'no_such_metric_agg': metric 'nosuchmetric'", "is not one lm-eval knows",
                            "acc_norm"]),
    ("no_such_agg", ["lm-eval task 'no_such_agg': aggregation 'nosuchagg' of metric 'acc'", "mean, median"]),
    ("good_mc,mixed_group", ["lm-eval task 'no_such_metric': metric 'nosuchmetric'"]),  # inside a group
    # before its dataset is read (before 2026-12-02 after it: here a missing data file was the error)
    ("agg_before_data", ["lm-eval task 'agg_before_data': aggregation 'nosuchagg' of metric 'acc'", "mean, median"]),
    ("good_mc,agg_tag", ["lm-eval task 'agg_before_data': aggregation 'nosuchagg' of metric 'acc'"]),  # a tag's task
])
def test_an_unknown_metric_is_one_error_line_before_any_request(run_dir, tasks, names, needles, capsys,
                                                                 monkeypatch):
    def scored(*_a, **_k):
        raise AssertionError("a request was scored before the unknown metric was refused")

    monkeypatch.setattr(HybridNormLM, "loglikelihood", scored)
    capsys.readouterr()
    assert cli.main(["eval", str(run_dir), "--tasks", names, "--include-path", str(tasks)]) == 2
    err = capsys.readouterr().err
    lines = err.strip().splitlines()
    assert lines[-1].startswith("error: ") and [ln for ln in lines if ln.startswith(("error", "Traceback"))] == \
        [lines[-1]], err
    assert all(n in lines[-1] for n in needles), lines[-1]
    assert "KeyError" not in err and "NoneType" not in err, err
    assert "it/s]" not in err, err  # lm-eval's progress bar of building the requests: not started
    assert "not found in the evaluate library" not in err, err  # lm-eval's own log line of the same thing


def test_the_library_call_raises_the_same_error_and_a_good_task_still_scores(run_dir, tasks):
    from hybridnorm.errors import ConfigError

    with pytest.raises(ConfigError, match=r"^lm-eval task 'no_such_agg': aggregation 'nosuchagg'"):
        run_lm_eval(run_dir, ["no_such_agg"], include_path=tasks, include_defaults=False)
    res = run_lm_eval(run_dir, ["good_mc"], include_path=tasks, include_defaults=False)
    assert res["n-samples"]["good_mc"]["effective"] == len(MC) and 0 <= res["results"]["good_mc"]["acc,none"] <= 1


def test_a_function_aggregation_is_not_taken_for_an_unknown_name(run_dir, tasks):
    """lm-eval's index holds a ``!function`` unresolved (a path): the early check leaves it to lm-eval."""
    res = run_lm_eval(run_dir, ["function_agg"], include_path=tasks, include_defaults=False)
    samples = run_lm_eval(run_dir, ["good_mc"], include_path=tasks, include_defaults=False, log_samples=True)
    accs = [s["acc"] for s in samples["samples"]["good_mc"]]
    assert res["results"]["function_agg"]["acc,none"] == pytest.approx(sum(accs) / len(accs) / 2)


def test_simple_evaluate_on_tasks_built_by_build_tasks_gets_the_metric_check(run_dir, tasks):
    """docs/evaluation.md's route for a direct ``simple_evaluate(model="hybridnorm")``: its own task loading
    leaves an unknown aggregation to fail after the requests are scored; tasks built by ``build_tasks`` do not."""
    from lm_eval.tasks import TaskManager

    from hybridnorm.errors import ConfigError
    from hybridnorm.eval.lm_eval_checks import build_tasks

    tm = TaskManager(include_path=str(tasks), include_defaults=False)
    args = f"pretrained={run_dir},device=cpu"
    with pytest.raises(ConfigError, match=r"^lm-eval task 'no_such_agg': aggregation 'nosuchagg'"):
        lm_eval.simple_evaluate(model="hybridnorm", model_args=args, tasks=build_tasks(tm, ["no_such_agg"]),
                                task_manager=tm)
    res = lm_eval.simple_evaluate(model="hybridnorm", model_args=args, tasks=build_tasks(tm, ["good_mc"]),
                                  task_manager=tm)
    assert res["results"]["good_mc"]["acc,none"] == \
        run_lm_eval(run_dir, ["good_mc"], include_path=tasks, include_defaults=False)["results"]["good_mc"]["acc,none"]
