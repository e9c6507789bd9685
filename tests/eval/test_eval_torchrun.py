"""``hybridnorm eval --tasks`` under the real ``torchrun`` (2 gloo processes on CPU): lm-eval splits the documents
across the ranks (7 of each task: 4 and 3, so the short rank repeats a request, as lm-eval pads) and rank 0
reports all of them. Oracle: the same command in one process, on the same run: the same metrics for the three
request kinds (multiple choice, rolling log-likelihood, greedy generation). Plus the collectives lm-eval calls,
in a real 2-rank group. ``--mc``, ``--text`` and the validation loss under torchrun: test_eval_rank_share.py."""

from __future__ import annotations

import json
import os
import re
from pathlib import Path

import pytest
import torch
from eval_helpers import task_folder
from train_helpers import TORCHRUN, cli_in_process, run_bounded, spawn_ranks

pytest.importorskip("lm_eval", reason="the eval extra (lm_eval) is not installed")

ROLL = [{"text": f"the lord said unto moses {i} times, behold the river ran dry " * (1 + i % 3)} for i in range(7)]
GEN = [{"q": q, "a": "x"} for q in ("The lord said", "Behold", "And the river", "Milk and honey where the",
                                    "Go forth into a land", "By day and", "The city was")]
TASKS = {
    "tr_roll": (ROLL, "output_type: loglikelihood_rolling\ndoc_to_text: ''\ndoc_to_target: '{{text}}'\n"
                      "metric_list:\n  - metric: word_perplexity\n  - metric: bits_per_byte\n"),
    "tr_gen": (GEN, "output_type: generate_until\ndoc_to_text: '{{q}}'\ndoc_to_target: '{{a}}'\n"
                    "generation_kwargs:\n  until: ['.']\n  max_gen_toks: 8\n  do_sample: false\n"
                    "metric_list:\n  - metric: exact_match\n"),
}


def test_two_ranks_report_what_one_process_reports(run_dir: Path, tmp_path: Path) -> None:
    tasks = task_folder(tmp_path, TASKS)
    args = ["eval", str(run_dir), "--tasks", "kjv_mc,tr_roll,tr_gen", "--include-path", str(tasks),
            "--limit", "7", "--batch-size", "2", "--log-samples"]
    one = tmp_path / "one.json"
    cli_in_process(*args, "--output", str(one))
    two = tmp_path / "two.json"
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    proc = run_bounded([*TORCHRUN, "--nproc_per_node", "2", "-m", "hybridnorm.cli", *args, "--output", str(two)],
                       300, env=env, cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr[-3000:]
    # rank 0 alone prints: the results line, the samples line (naming one file a task), two kjv_mc table rows
    assert proc.stdout.count("results: ") == proc.stdout.count("samples: ") == 1
    assert proc.stdout.count("kjv_mc") == 3
    a, b = (json.loads(p.read_text())["lm_eval"] for p in (one, two))
    assert a["n-samples"] == b["n-samples"] == {t: {"original": n, "effective": 7} for t, n in
                                                (("tr_gen", 7), ("tr_roll", 7), ("kjv_mc", 200))}
    for task, metrics in a["results"].items():
        got = b["results"][task]
        assert got.keys() == metrics.keys()
        for k, v in metrics.items():
            if "stderr" not in k and isinstance(v, float):  # the bootstrap's draws differ; the values must not
                assert got[k] == pytest.approx(v, rel=1e-6), (task, k)
    assert 0 < a["results"]["kjv_mc"]["acc,none"] < 1 and a["results"]["tr_roll"]["word_perplexity,none"] > 1
    for task in ("kjv_mc", "tr_roll", "tr_gen"):  # --log-samples: rank 0 writes every rank's documents
        recs = [sorted((json.loads(line) for line in (tmp_path / f"{name}_samples_{task}.jsonl").read_text(
            encoding="utf-8").splitlines()), key=lambda r: r["doc_id"]) for name in ("one", "two")]
        assert [r["doc_id"] for r in recs[0]] == [r["doc_id"] for r in recs[1]] == list(range(7)), task
        if task == "tr_gen":  # greedy replies: the same on either rank
            assert [r["filtered_resps"] for r in recs[0]] == [r["filtered_resps"] for r in recs[1]]


def test_a_task_with_fewer_documents_than_ranks_is_one_error_line_on_every_rank(run_dir: Path, tmp_path: Path) -> None:
    """``--limit 1`` on 2 ranks: rank 1's share is empty. Before 2026-12-02 rank 1 blamed the task and rank 0
    printed a 40-line gloo traceback (its collective's peer had gone)."""
    args = ["eval", str(run_dir), "--tasks", "kjv_mc", "--limit", "1", "--batch-size", "2"]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    proc = run_bounded([*TORCHRUN, "--nproc_per_node", "2", "-m", "hybridnorm.cli", *args], 300, env=env,
                       cwd=tmp_path)
    lines = proc.stderr.splitlines()
    assert proc.returncode != 0 and not any("hybridnorm" in ln for ln in lines if ln.strip().startswith("File ")), \
        proc.stderr[-3000:]  # torchrun's own traceback (ChildFailedError) names no file of ours
    # the two ranks share one stderr: a line of one can start after the other's unfinished progress bar
    # (tqdm's "\r", no newline yet), so each message is read from where it starts
    said = [ln[min(i for i in (ln.find("error:"), ln.find("interrupted:")) if i >= 0):]
            for ln in re.split(r"[\r\n]", proc.stderr) if "error:" in ln or "interrupted:" in ln]
    errors = [ln for ln in said if ln.startswith("error:")]
    assert any("rank 1 of 2" in ln and "at least 2 documents after --limit" in ln for ln in errors), errors
    # rank 0 ends in one line too: its collective's peer went away (no --resume hint: eval just runs again),
    # or torchrun's SIGTERM came first
    zero = [ln for ln in said if ln.startswith("interrupted:") or ln.startswith("error: rank 0 of 2: a collective")]
    assert len(zero) == 1 and "--resume" not in zero[0], lines


SCRIPT = """
import json, sys
from hybridnorm.eval import run_lm_eval
res = run_lm_eval(sys.argv[1], ["kjv_mc"], limit=5, batch_size=2, include_defaults=False)
import torch.distributed as dist
print(f"rank {dist.get_rank()}: " + json.dumps(None if res is None else res["results"]["kjv_mc"]["acc,none"]))
"""


def test_lm_eval_from_a_script_under_torchrun_joins_the_ranks_itself(run_dir: Path, tmp_path: Path) -> None:
    """``run_lm_eval`` (or ``simple_evaluate(model="hybridnorm")``) in a user's script launched by torchrun: the
    adapter joins the process group as lm-eval's HF backend does through accelerate; rank 0 gets the results
    of every document, rank 1 None."""
    from hybridnorm.eval import run_lm_eval

    script = tmp_path / "evaluate.py"
    script.write_text(SCRIPT, encoding="utf-8")
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    proc = run_bounded([*TORCHRUN, "--nproc_per_node", "2", str(script), str(run_dir)], 300, env=env, cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr[-3000:]
    want = run_lm_eval(run_dir, ["kjv_mc"], limit=5, batch_size=2, include_defaults=False)
    lines = sorted(line for line in proc.stdout.splitlines() if line.startswith("rank "))
    assert lines == [f"rank 0: {json.dumps(want['results']['kjv_mc']['acc,none'])}", "rank 1: null"], lines


def _collectives_worker(rank: int, world: int, port: int, out: str) -> None:
    from train_helpers import rank_env

    rank_env(rank, world, port)
    from hybridnorm.eval.lm_eval_ranks import RankedLM
    from hybridnorm.train.distributed import init_distributed, leave

    init_distributed(torch.device("cpu"), 60)
    lm = RankedLM()
    lm.join_ranks(torch.device("cpu"))  # the group joined above
    got = {"rank": lm._rank, "world": lm._world_size,
           "scalar": lm.all_gather(torch.tensor(10 + rank)).tolist(),
           "rows": lm.all_gather(torch.full((2, 3), float(rank))).tolist(),
           "older": lm.accelerator.gather(torch.tensor(rank)).tolist(),  # earlier lm-eval 0.4 releases
           "objects": lm.gather_object({"r": rank}, dst=0)}
    lm.accelerator.wait_for_everyone()
    lm.barrier()
    leave()
    Path(out, f"{rank}.json").write_text(json.dumps(got))


def test_the_collectives_lm_eval_calls_in_a_two_rank_group(tmp_path: Path) -> None:
    spawn_ranks(_collectives_worker, 2, (str(tmp_path),), 120, "two ranks gathering")
    r0, r1 = (json.loads((tmp_path / f"{r}.json").read_text()) for r in (0, 1))
    assert (r0["rank"], r0["world"], r1["rank"], r1["world"]) == (0, 2, 1, 2)
    for r in (r0, r1):
        assert r["scalar"] == [10, 11] and r["older"] == [0, 1]
        assert r["rows"] == [[0.0] * 3] * 2 + [[1.0] * 3] * 2
    assert r0["objects"] == [{"r": 0}, {"r": 1}] and r1["objects"] is None


def test_one_process_is_rank_0_of_1_and_its_collectives_do_nothing() -> None:
    from hybridnorm.eval.lm_eval_ranks import RankedLM

    lm = RankedLM()
    lm.join_ranks(torch.device("cpu"))
    t = torch.tensor(3)
    assert (lm._rank, lm._world_size) == (0, 1) and lm.all_gather(t) is t and lm.gather_object("x") == ["x"]
    assert not hasattr(lm, "accelerator")
    lm.barrier()
