"""The report compares runs by what each one logged it did, not only by its config: tokens per step and
validation tokens as trained, the data read, the code of every session, the step of every loss shown. Run
folders are written by hand, so the true differences are known; one tiny training run checks that the
trainer logs the figures the report reads."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from hybridnorm.errors import ConfigError
from hybridnorm.experiments.compare import run_compare
from hybridnorm.experiments.report import write_report
from hybridnorm.experiments.runs import read_run

CODE_A = {"hybridnorm": "0.1.0", "torch": "2.13", "git_commit": "a" * 40, "git_dirty": False}
CODE_B = {**CODE_A, "git_commit": "b" * 40}
KJV = {"unigram_entropy": 6.0, "train_tokens_available": 9000, "val_tokens_available": 1000}


def _run(root: Path, placement: str, seed: int, val: float, *, tps: int = 32, steps: int = 10,
         config: dict | None = None, metas: list[dict] | None = None, knobs: dict | None = None,
         evals: list[tuple[int, float]] | None = None, done: bool = True, divergence: dict | None = None):
    """A run folder as the grid and the trainer write it: config 4 × 8 tokens per step, unless the meta
    records (``tokens_per_step``) say it ran otherwise; train and eval records at every step given."""
    run = root / "runs" / f"{placement}-{json.dumps(knobs or {}, sort_keys=True)}-s{seed}".replace('"', "")
    run.mkdir(parents=True)
    cfg = {"max_steps": steps, "batch_size": 4, "seq_len": 8, "global_batch": 0, "model": {"n_layers": 2},
           "optim": {"lr": 1e-3, "warmup_steps": 2}, "data": {"source": "kjv", "tokenizer": "bpe"},
           **(config or {})}
    (run / "point.json").write_text(json.dumps({
        "point": {"placement": placement, "init": "megatron", "knobs": knobs or {}, "seed": seed}, "config": cfg}))
    metas = metas or [{"step": 0, "tokens_per_step": tps}]
    recs = [{"kind": "meta", "init": "megatron", **KJV, **m} for m in metas]
    for step, loss in [(steps, val)] if evals is None else evals:
        recs += [{"kind": "train", "step": step, "loss": loss, "tokens": step * tps},
                 {"kind": "eval", "step": step, "val_loss": loss, "val_tokens": 2 * tps}]
    (run / "metrics.jsonl").write_text("\n".join(map(json.dumps, recs)) + "\n")
    if divergence is not None:
        (run / "divergence.json").write_text(json.dumps(divergence))
    if done:
        (run / "done.json").write_text("{}")
    return read_run(run)


def _report(root: Path, runs: list) -> tuple[dict, str]:
    text = write_report(runs, root, baseline="pre").read_text()
    return json.loads((root / "runs.json").read_text()), text


def _line(text: str, start: str) -> str:
    return next(x for x in text.splitlines() if x.startswith(start))


def test_runs_alike_in_config_that_trained_other_tokens_per_step_are_named_and_kept_apart(tmp_path):
    """A grid continued under torchrun with 2 processes: seed 1 trained 64 tokens per step where seed 0
    trained 32, with identical configs. Once 'placement, seed' differed and both seeds were pooled."""
    runs = [_run(tmp_path, p, s, v, tps=tps) for s, tps in ((0, 32), (1, 64))
            for p, v in (("pre", 5.0 + s / 10), ("post", 5.3 + s / 10))]
    data, text = _report(tmp_path, runs)
    assert data["differs"] == ["placement", "seed", "tokens per step", "validation tokens"]
    setup = _line(text, "Setup shared by every run")
    assert "10 steps × 32 tokens (2 runs) / 64 tokens (2 runs) per step" in setup
    assert "validation on 64 tokens (2 runs) / 128 tokens (2 runs)" in setup
    groups = {g["label"]: g for g in data["groups"]}
    assert set(groups) == {"pre [32 tokens/step]", "pre [64 tokens/step]", "post [32 tokens/step]",
                           "post [64 tokens/step]"}
    assert groups["post [64 tokens/step]"]["val_loss_by_seed"] == {"1": pytest.approx(5.4)}  # not pooled
    assert groups["post [64 tokens/step]"]["diff_vs_baseline"]["mean"] == pytest.approx(5.4 - 5.1)
    assert [r["tokens_per_step"] for r in data["runs"]] == [32, 32, 64, 64]


def test_tokens_per_step_of_older_runs_come_from_their_train_records(tmp_path):
    """Without the meta field (runs before it was logged): the cumulative token count over the step."""
    old = _run(tmp_path, "pre", 0, 5.0, tps=128, metas=[{"step": 0}])
    assert _report(tmp_path, [old])[0]["runs"][0]["tokens_per_step"] == 128  # the config says 4 × 8 = 32


def test_a_data_file_changed_under_the_same_path_is_named(tmp_path):
    other = {"step": 0, "tokens_per_step": 32, "train_tokens_available": 9100, "unigram_entropy": 5.9}
    runs = [_run(tmp_path, "pre", 0, 5.0), _run(tmp_path, "post", 0, 5.1),
            _run(tmp_path, "pre", 1, 5.0, metas=[other]), _run(tmp_path, "post", 1, 5.1, metas=[other])]
    data, text = _report(tmp_path, runs)
    assert data["differs"] == ["placement", "seed", "data content"]
    setup = _line(text, "Setup shared by every run")
    assert "data kjv (content differs: 9,000 train / 1,000 val tokens, unigram 6 (2 runs) / 9,100 train" in setup
    assert "unigram baseline 5.900 nats (2 runs) / 6.000 nats (2 runs)" in setup
    assert {r["data"] for r in data["runs"]} == {"9,000 train / 1,000 val tokens, unigram 6",
                                                 "9,100 train / 1,000 val tokens, unigram 5.9"}


def test_a_data_hash_first_recorded_on_resume_is_not_a_change_of_data(tmp_path):
    """A run trained before data_sha256 was logged and resumed by code that logs it, beside a run of the new
    code: the data is the same (the counts agree) and one hash unknown is not a difference. A key holding the
    hash named the run "resumed on other data" and put the two runs in different budgets."""
    sha = {"data_sha256": "c" * 64}
    resumed = [{"step": 0, "tokens_per_step": 32}, {"step": 5, "tokens_per_step": 32, **sha}]
    runs = [_run(tmp_path, "pre", 0, 5.0, metas=resumed), _run(tmp_path, "post", 0, 5.1, metas=[
        {"step": 0, "tokens_per_step": 32, **sha}])]
    data, text = _report(tmp_path, runs)
    assert data["differs"] == ["placement"]
    assert "Resumed across data" not in text and "content differs" not in text
    assert runs[0].budget == runs[1].budget


def test_a_same_count_edit_of_the_data_is_named_by_its_hash(tmp_path):
    """Two runs whose data files differ with every count alike (a same-size typo fix under the byte
    tokenizer): only data_sha256 tells them apart."""
    runs = [_run(tmp_path, p, s, v, metas=[{"step": 0, "tokens_per_step": 32, "data_sha256": h * 64}])
            for s, h in ((0, "a"), (1, "b")) for p, v in (("pre", 5.0), ("post", 5.1))]
    data, text = _report(tmp_path, runs)
    assert data["differs"] == ["placement", "seed", "data files"]
    assert "(files differ: sha256 aaaaaaaaaaaaaaaa (2 runs) / bbbbbbbbbbbbbbbb (2 runs))" in \
        _line(text, "Setup shared by every run")
    assert {g["label"] for g in data["groups"]} == {f"{p} [data files {h * 16}]" for p in ("pre", "post")
                                                   for h in "ab"}


def test_a_run_resumed_after_a_code_change_reports_every_session(tmp_path):
    resumed = [{"step": 0, "tokens_per_step": 32, "code": CODE_A}, {"step": 5, "tokens_per_step": 32, "code": CODE_B}]
    runs = [_run(tmp_path, "pre", 0, 5.0, metas=resumed),
            _run(tmp_path, "post", 0, 5.1, metas=[{"step": 0, "tokens_per_step": 32, "code": CODE_B}])]
    data, text = _report(tmp_path, runs)
    assert data["differs"] == ["placement", "code"]
    assert [s["code"]["git_commit"][0] for s in data["runs"][0]["sessions"]] == ["a", "b"]
    assert [s["from_step"] for s in data["runs"][0]["sessions"]] == [0, 5]
    line = _line(text, "**Resumed across code versions:**")
    assert runs[0].path.name in line and "@ aaaaaaaa, torch 2.13 from step 0" in line and "@ bbbbbbbb" in line
    assert "hybridnorm 0.1.0 @ aaaaaaaa, torch 2.13 → hybridnorm 0.1.0 @ bbbbbbbb, torch 2.13 (1 run)" in \
        _line(text, "Code that made the runs:")


def test_pause_options_and_the_grids_own_diagnostics_cadence_are_not_differences(tmp_path):
    runs = [_run(tmp_path, "pre", 0, 5.0, config={"stop_after_steps": 5, "diagnostics": {"every": 10}}),
            _run(tmp_path, "pre", 1, 5.1, config={"stop_after_steps": 0, "diagnostics": {"every": 50}})]
    data, text = _report(tmp_path, runs)
    assert data["differs"] == ["seed"] and data["varying"] == []
    assert "per-layer diagnostics every 10 (1 run) / 50 (1 run) steps (measuring only)" in text
    # an axis over the cadence is a knob, and named
    axis = [_run(tmp_path / "b", "pre", 0, 5.0, knobs={"diagnostics.every": e}, config={"diagnostics": {"every": e}})
            for e in (10, 50)]
    assert _report(tmp_path / "b", axis)[0]["differs"] == ["diagnostics.every"]


def test_the_warmup_note_is_stated_for_each_warmup(tmp_path):
    runs = [_run(tmp_path, "pre", 0, 5.0, knobs={"w": w}, config={"optim": {"lr": 1e-3, "warmup_steps": w}})
            for w in (50, 2)]
    setup = _line(_report(tmp_path, runs)[1], "Setup shared by every run")
    assert "warmup 50 steps (the whole run: lr peaks at 0.0002, never at 0.001) (1 run) / 2 steps (1 run)," in setup


@pytest.mark.parametrize("differ", [
    {"config": {"global_batch": 16}, "tps": 128},                   # --axis global_batch=4,16 (same batch_size)
    {"config": {"data": {"source": "kjv", "tokenizer": "bytes"}}},  # nats per byte vs nats per BPE token
])
def test_the_relative_stall_rule_compares_only_runs_of_one_budget(tmp_path, differ):
    """Unigram 6.0: the far run gains 2.0 nats; the near one 0.2 (10%, under the relative rule's 25%). They
    are other budgets (tokens per step as trained; tokenizer), so the near run is judged alone: trained."""
    far = _run(tmp_path, "pre", 0, 4.0, knobs={"k": 1}, config=differ["config"], tps=differ.get("tps", 32))
    near = _run(tmp_path, "pre", 0, 5.8, knobs={"k": 0})
    data = _report(tmp_path, [far, near])[0]
    assert [r["verdict"] for r in data["runs"]] == ["trained", "trained"]
    same = _run(tmp_path / "b", "pre", 0, 4.0, knobs={"k": 1})  # the same budget: near is stalled beside it
    assert _report(tmp_path / "b", [same, _run(tmp_path / "b", "pre", 0, 5.8, knobs={"k": 0})])[0][
        "runs"][1]["verdict"] == "stalled"


def test_losses_not_at_the_last_step_carry_their_step_and_a_diverged_run_its_tokens(tmp_path):
    """Diverged at step 7 (6 steps completed) after an eval at step 5; an unfinished run at step 4."""
    diverged = _run(tmp_path, "pre", 0, 5.5, evals=[(5, 5.5)], divergence={"step": 7, "completed_steps": 6})
    early = _run(tmp_path, "post", 0, 9.0, evals=[], divergence={"step": 1, "completed_steps": 0})
    paused = _run(tmp_path, "hybridnorm", 0, 6.5, evals=[(4, 6.5)], done=False)
    data, text = _report(tmp_path, [diverged, early, paused])
    d, e, p = data["runs"]
    assert (d["verdict"], d["final_val_loss"], d["last_val_loss"], d["last_val_step"]) == ("diverged", None, 5.5, 5)
    assert d["tokens_seen"] == 6 * 32 and e["tokens_seen"] == 0 and p["tokens_seen"] == 4 * 32
    rows = {r.path.name: _line(text, f"| {r.path.name} ") for r in (diverged, paused)}
    assert "| diverged | 5.5000 (step 5) | 5.5000 (step 5) | 192 | non-finite loss or gradient at step 7 |" in \
        rows[diverged.path.name]
    assert "| *unfinished* | 6.5000 (step 4) | 6.5000 (step 4) | 128 | unfinished: step 4 of 10 |" in \
        rows[paused.path.name]
    # a run that diverged before its first train record: the steps it completed, from its divergence report
    late = _run(tmp_path / "b", "pre", 0, 9.0, evals=[], divergence={"step": 4, "completed_steps": 3})
    assert _report(tmp_path / "b", [late])[0]["runs"][0]["tokens_seen"] == 3 * 32


def test_a_finished_run_whose_log_lost_its_final_eval_is_not_judged_on_an_earlier_one(tmp_path):
    run = _run(tmp_path, "pre", 0, 5.0, evals=[(5, 5.5), (10, 5.0)]).path
    lines = (run / "metrics.jsonl").read_text().splitlines()
    (run / "metrics.jsonl").write_text("\n".join(lines[:-1]) + "\n" + lines[-1][:20])  # the last line cut
    with pytest.raises(ConfigError, match="its last eval is at step 5, yet the run is marked finished at step 10"):
        read_run(run)


def test_the_trainer_logs_the_tokens_per_step_it_trained(make_cfg, tmp_path):
    """--global_batch=8 with batch_size 4 × seq_len 32: 256 tokens per step, not the 128 of batch_size ×
    seq_len; the report's setup line states the run's own figure (its train record's tokens over its step)."""
    base = make_cfg(tmp_path / "u", "--max_steps=2", "--global_batch=8", "--eval_interval=2")
    summary = run_compare(base, ["pre"], [0], tmp_path / "cmp")
    run = read_run(tmp_path / "cmp" / "runs" / "pre-init=megatron-seed0")
    assert run.meta["tokens_per_step"] == run.train[-1]["tokens"] // run.train[-1]["step"] == 256
    setup = _line(summary.read_text(), "Setup shared by every run")
    assert "2 steps × 256 tokens per step" in setup and f"validation on {run.eval[-1]['val_tokens']:,} tokens" in setup
