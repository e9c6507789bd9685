"""Each statement a report makes, checked against hand-built run folders whose true differences are known."""

import json

import pytest

from hybridnorm import placements
from hybridnorm.experiments.report import write_report
from hybridnorm.experiments.runs import read_run


def _run(root, placement, seed, val, *, lr=1e-3, init="megatron", extra=None, code=None, hardware=None,
         diverged=False, bigram=None, grad_last=3.0):
    """A finished run folder written by hand; unigram baseline 6.0, so val < 5.9 is `trained`."""
    run = root / "runs" / f"{placement}-{init}-lr{lr}-s{seed}"
    run.mkdir(parents=True)
    (run / "point.json").write_text(json.dumps({
        "point": {"placement": placement, "init": init, "knobs": {"optim.lr": lr}, "seed": seed},
        "config": {"max_steps": 10, "model": {"n_layers": 3, "init": init}, "optim": {"lr": lr},
                   **(extra or {})}}))
    meta = {"kind": "meta", "step": 0, "init": init, "unigram_entropy": 6.0,
            **({"code": code} if code else {}), **({"hardware": hardware} if hardware else {}),
            **({"bigram_entropy": bigram} if bigram is not None else {})}
    diag = {"kind": "diag", "step": 1, **{f"grad_norm/blocks.{i}": 1.0 + i for i in range(2)},
            "grad_norm/blocks.2": grad_last}
    end = (extra or {}).get("max_steps", 10)  # the trainer logs and evaluates at max_steps; 10 tokens per step
    recs = [meta, diag, {"kind": "train", "step": end, "loss": val, "tokens": 10 * end},
            {"kind": "eval", "step": end, "val_loss": val, "val_tokens": 100}]
    (run / "metrics.jsonl").write_text("\n".join(map(json.dumps, recs)) + "\n")
    if diverged:
        (run / "divergence.json").write_text(json.dumps({"step": 7}))
    (run / "done.json").write_text("{}")
    return read_run(run)


def _differs(tmp_path, runs):
    text = write_report(runs, tmp_path).read_text()
    line = next(x for x in text.splitlines() if x.startswith("**What differs between runs:**"))
    return json.loads((tmp_path / "runs.json").read_text())["differs"], line


def test_one_seed_three_placements_differ_in_placement_only(tmp_path):
    runs = [_run(tmp_path, p, 0, 5.0) for p in ("pre", "post", "hybridnorm_star")]
    differs, line = _differs(tmp_path, runs)
    assert differs == ["placement"] and line.split(". Each")[0].endswith("runs:** `placement`")


def test_a_sweep_names_the_placement_and_the_swept_field(tmp_path):
    runs = [_run(tmp_path, p, 0, 5.0, lr=lr) for p in ("pre", "post") for lr in (1e-3, 1e-2)]
    assert _differs(tmp_path, runs)[0] == ["placement", "optim.lr"]


def test_the_bigram_reference_is_stated_only_where_every_run_records_the_same_one(tmp_path):
    def setup(folder, bigrams):
        runs = [_run(tmp_path / folder, p, 0, 5.0, bigram=b) for p, b in zip(("pre", "post"), bigrams, strict=True)]
        return next(x for x in write_report(runs, tmp_path / folder).read_text().splitlines()
                    if x.startswith("Setup shared by every run"))

    assert setup("same", [4.5, 4.5]).endswith(
        "unigram baseline 6.000 nats; bigram reference (Kneser-Ney, counted on the training split) 4.500 nats.")
    for folder, bigrams in (("older", [None, None]), ("mixed", [4.5, None]), ("apart", [4.5, 4.6])):
        line = setup(folder, bigrams)
        assert line.endswith("unigram baseline 6.000 nats.") and "bigram" not in line, folder


def test_seed_init_code_and_hardware_are_named_only_when_they_differ(tmp_path):
    code_a = {"hybridnorm": "0.1.0", "torch": "2.1", "git_commit": "a" * 40, "git_dirty": False}
    code_b = {**code_a, "git_commit": "b" * 40}
    hw = {"device": "cpu", "cpu": "x"}
    runs = [_run(tmp_path, "pre", 0, 5.0, init="megatron", code=code_a, hardware=hw),
            _run(tmp_path, "pre", 1, 5.0, init="normal", code=code_b, hardware=hw)]
    assert _differs(tmp_path, runs)[0] == ["init", "seed", "code"]
    same = [_run(tmp_path / "b", "pre", 0, 5.0, code=code_a, hardware=hw)]
    differs, line = _differs(tmp_path / "b", same)
    assert differs == [] and "nothing (one configuration, one seed)" in line


def test_equations_come_from_the_placements_generator_with_overrides_and_head(tmp_path):
    runs = [_run(tmp_path, p, 0, 5.0) for p in ("pre", "hybridnorm_star")]
    text = write_report(runs, tmp_path).read_text()
    for name in ("pre", "hybridnorm_star"):
        for eq in placements.equations(placements.get(name)):
            assert f"  - {eq}" in text
    star = placements.equations(placements.get("hybridnorm_star"))
    assert star[0].startswith("block 1:") and any(e.startswith("logits =") for e in star)


def test_sweep_plot_draws_runs_that_did_not_train_at_their_real_loss(tmp_path):
    runs = [_run(tmp_path, "pre", 0, 5.0, lr=1e-3), _run(tmp_path, "pre", 1, 5.2, lr=1e-3),
            _run(tmp_path, "pre", 0, 7.6, lr=1e-2), _run(tmp_path, "pre", 1, 5.1, lr=1e-2),
            _run(tmp_path, "pre", 0, 7.8, lr=1e-1), _run(tmp_path, "pre", 1, 9.0, lr=1e-1, diverged=True)]
    write_report(runs, tmp_path)
    s = json.loads((tmp_path / "sweep_optim.lr.json").read_text())["pre"]
    assert s["x"] == [1e-3, 1e-2, 1e-1]
    assert s["y"] == [pytest.approx(5.1), pytest.approx(5.1), None]  # means of trained seeds only
    assert s["not_trained"] == [{"x": 1e-2, "seed": 0, "verdict": "stalled", "val_loss": 7.6},
                                {"x": 1e-1, "seed": 0, "verdict": "stalled", "val_loss": 7.8},
                                {"x": 1e-1, "seed": 1, "verdict": "diverged", "val_loss": None}]


def test_by_depth_plot_has_integer_block_ticks(tmp_path):
    import matplotlib.pyplot as plt
    from matplotlib.ticker import MaxNLocator

    from hybridnorm.experiments import plots

    runs = [_run(tmp_path, "pre", 0, 5.0)]
    runs[0].label = "pre"
    captured = {}
    original = plt.Figure.savefig

    def keep(fig, *a, **k):
        captured["ticks"] = [t for ax in fig.axes for t in ax.get_xticks()]
        captured["locators"] = [ax.xaxis.get_major_locator() for ax in fig.axes]
        return original(fig, *a, **k)

    plt.Figure.savefig = keep
    try:
        plots.by_depth(runs, tmp_path / "g.png", "grad_norm", [1], "g", "g")
    finally:
        plt.Figure.savefig = original
    assert all(isinstance(loc, MaxNLocator) for loc in captured["locators"])
    assert captured["ticks"] and all(float(t).is_integer() for t in captured["ticks"])


def test_a_run_far_behind_the_best_of_its_budget_is_stalled_not_trained(tmp_path):
    """Unigram 6.0; the best run gains 2.0 nats, so trained needs a gain ≥ 0.5 (25%): 5.8 (gain 0.2, above
    the absolute 0.1 margin) is stalled beside it, 5.4 (gain 0.6) is trained. Alone, 5.8 is trained."""
    from hybridnorm.experiments import verdict

    runs = [_run(tmp_path, "pre", 0, 4.0), _run(tmp_path, "post", 0, 5.8), _run(tmp_path, "hybridnorm", 0, 5.4)]
    write_report(runs, tmp_path)
    got = {r["placement"]: r for r in json.loads((tmp_path / "runs.json").read_text())["runs"]}
    assert [got[p]["verdict"] for p in ("pre", "post", "hybridnorm")] == ["trained", "stalled", "trained"]
    assert "10% of the best same-budget run's 2.000" in got["post"]["verdict_reason"]
    alone = verdict.judge(diverged=False, final_val_loss=5.8, unigram_entropy=6.0, first_train_loss=9.0,
                          final_train_loss=5.8)
    assert alone.verdict == "trained"
    # another budget (more steps) is not a peer: its better loss does not raise the bar
    other = _run(tmp_path / "b", "pre", 0, 3.0, extra={"max_steps": 50})
    lone = _run(tmp_path / "b", "post", 0, 5.8)
    write_report([other, lone], tmp_path / "b")
    got = {r["placement"]: r["verdict"] for r in json.loads((tmp_path / "b" / "runs.json").read_text())["runs"]}
    assert got == {"pre": "trained", "post": "trained"}


@pytest.mark.parametrize(("warmup", "said"), [(50, " (the whole run: lr peaks at 0.0002, never at 0.001)"),
                                              (10, ""), (2, "")])
def test_the_setup_line_says_when_the_warmup_outlasts_the_runs(tmp_path, warmup, said):
    runs = [_run(tmp_path, p, 0, 5.0, extra={"optim": {"lr": 1e-3, "warmup_steps": warmup}})
            for p in ("pre", "post")]
    text = write_report(runs, tmp_path).read_text()
    setup = next(x for x in text.splitlines() if x.startswith("Setup shared by every run"))
    assert f"warmup {warmup} steps{said}, clip" in setup


def test_a_run_just_short_of_the_margin_is_not_shown_at_it(tmp_path):
    """Unigram 6.0, val 5.9: the gain is 0.0999999999999996 in floats, under the 0.1 margin, so the run is
    stalled; its row must not read "0.100 nats below ...; trained needs ≥ 0.1 below" (a reader checks the
    verdict from the numbers in the row)."""
    text = write_report([_run(tmp_path, "pre", 0, 5.9)], tmp_path).read_text()
    row = next(x for x in text.splitlines() if x.startswith("| pre-megatron"))
    assert "| stalled |" in row and "0.100 nats below" not in row
    gain = float(row.split(" is ")[1].split(" nats below")[0])
    assert gain < 0.1


def test_the_gradient_balance_table_gives_every_seed_not_only_a_mean(tmp_path):
    """First block 1.0; last blocks 1.0, 2.0 and 3e11 (a seed whose bottom stopped learning): the mean ± std
    alone (1e11 ± 1.7e11) hid which seed it was and that the other two are near 1."""
    runs = [_run(tmp_path, "pre", s, 5.0, grad_last=g) for s, g in ((0, 1.0), (1, 2.0), (2, 3e11))]
    text = write_report(runs, tmp_path).read_text()
    section = text.split("## Gradient balance")[1].split("## ")[0]
    (row,) = [x for x in section.splitlines() if x.startswith("| `pre")]
    assert row.split(" | ")[1].endswith(" (0: 1, 1: 2, 2: 3e+11)")


def test_a_delta_says_how_many_seeds_it_pairs_and_a_missing_one_says_why(tmp_path):
    """post's seed 2 diverged: its Δ pairs seeds 0 and 1 only, and says so; at lr 1e-2 the baseline has no
    run at all, and at 1e-1 every baseline seed diverged: no Δ, and one line each says why."""
    runs = [_run(tmp_path, "pre", s, 5.0 + s / 10) for s in (0, 1, 2)]
    runs += [_run(tmp_path, "post", s, 4.9 + s / 10 + s * s / 100, diverged=s == 2) for s in (0, 1, 2)]
    runs += [_run(tmp_path, "post", 0, 4.0, lr=1e-2)]
    runs += [_run(tmp_path, "pre", 0, 5.0, lr=1e-1, diverged=True), _run(tmp_path, "post", 0, 4.0, lr=1e-1)]
    text = write_report(runs, tmp_path).read_text()
    groups = {g["label"]: g for g in json.loads((tmp_path / "runs.json").read_text())["groups"]}
    post = groups["post optim.lr=0.001"]
    assert post["diff_vs_baseline"]["n"] == 2  # seeds 0 and 1: -0.1 and -0.09
    assert post["diff_text"].endswith(" (n=2 of 3 seeds)")
    root = tmp_path / "one"  # the same grid without post's seed 1
    one = write_report([_run(root, "pre", s, 5.0 + s / 10) for s in (0, 1, 2)]
                       + [_run(root, "post", s, 4.9 + s / 10, diverged=s == 2) for s in (0, 2)], root)
    groups = {g["label"]: g for g in json.loads((root / "runs.json").read_text())["groups"]}
    # post's seeds 1 (left out) and 2 (diverged): one pair, which said "(n=1, no interval)" and not of how many
    assert groups["post optim.lr=0.001"]["diff_text"] == "-0.1000 (n=1 of 2 seeds, no interval)"
    assert "-0.1000 (n=1 of 2 seeds, no interval)" in one.read_text()
    assert f"| {post['diff_text']} |" in text
    assert ("No Δ for `post optim.lr=0.01`: no finished `pre` run at its init axis value and knob values."
            in text.splitlines())
    assert ("No Δ for `post optim.lr=0.1`: no seed with a finite final val loss in both it and `pre`."
            in text.splitlines())
    assert not any(x.startswith("No Δ for `pre") for x in text.splitlines())  # the baseline itself


def test_the_largest_value_every_seed_trained_at_counts_the_seeds_not_finished(tmp_path):
    """Seed 1 at lr 1e-2 has not finished (no done.json): "every seed trained" cannot be said of 1e-2 yet;
    the table once named 1e-2 from the one seed that had finished."""
    runs = [_run(tmp_path, "pre", s, 5.0, lr=lr) for lr in (1e-3, 1e-2) for s in (0, 1)]
    (runs[3].path / "done.json").unlink()
    runs[3] = read_run(runs[3].path)
    text = write_report(runs, tmp_path).read_text()
    section = text.split("## Largest `optim.lr` that trained")[1].split("## ")[0]
    (row,) = [x for x in section.splitlines() if x.startswith("| `pre")]
    assert row == "| `pre init=megatron` | 0.001 | 0.001: 2 trained; 0.01: 1 trained, 1 not finished |"
