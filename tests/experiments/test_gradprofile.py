"""Figure 2's measurement (``experiments.gradprofile``), its plot and its claim rows."""

import json
import math

import pytest

from hybridnorm.experiments import claims, figure2, gradprofile


def test_profiles_are_consistent_resumable_and_seeded(corpus, cache_dir, tmp_path):
    out = tmp_path / "step1.json"
    over = [f"--data.source={corpus}", "--data.tokenizer=bytes", f"--data.cache_dir={cache_dir}"]
    first = gradprofile.run(out, ["tiny"], ["pre", "hybridnorm_star"], ["default"], [0, 1], 2, 32, over)
    assert [(p["placement"], p["seed"]) for p in first] == [("pre", 0), ("hybridnorm_star", 0), ("pre", 1),
                                                            ("hybridnorm_star", 1)]
    for p in first:
        assert len(p["attn"]) == len(p["ffn"]) == len(p["block"]) == p["n_layers"] == 2
        for a, f, b in zip(p["attn"], p["ffn"], p["block"], strict=True):  # a block is its attn and its ffn
            assert b == pytest.approx(math.sqrt(a * a + f * f), rel=1e-6) and a > 0 and f > 0
    assert first[0]["attn"] != first[2]["attn"]  # another seed: another init and batch
    again = gradprofile.profile("tiny", "pre", "default", 0, 2, 32, over)
    assert again["block"] == pytest.approx(first[0]["block"], rel=1e-6)  # the seed fixes init and batch
    before = out.read_text()
    assert len(gradprofile.run(out, ["tiny"], ["pre", "hybridnorm_star"], ["default"], [0, 1], 2, 32, over)) == 4
    assert out.read_text() == before  # nothing re-measured
    png = figure2.plot(first, tmp_path / "step1.png")
    assert png.stat().st_size > 1000


def _profile(placement, seed, first, last):
    return {"size": "550m", "init": "default", "placement": placement, "seed": seed, "resolved_init": "x",
            "block": [first, 1.0, last], "attn": [first, 1.0, last], "ffn": [0.0, 0.0, 0.0]}


def test_claim_rows_from_hand_built_profiles(tmp_path):
    """Pre-Norm's last block has 10× the first block's gradient (imbalance 1); HybridNorm's 1.1–1.3×
    (imbalance ≤ 0.12): supported for every seed; Post-Norm's 0.01× (imbalance 2): contradicted."""
    profiles = [_profile("pre", s, 1.0, 10.0 + s) for s in range(3)]
    profiles += [_profile("hybridnorm", s, 1.0, 1.1 + 0.1 * s) for s in range(3)]
    profiles += [_profile("post", s, 1.0, 0.01 * (1 + s / 10)) for s in range(3)]
    (tmp_path / "figure2").mkdir()
    (tmp_path / "figure2" / "step1.json").write_text(json.dumps({"profiles": profiles}))
    rows = claims.claim_figure2(tmp_path)
    hyb = next(r for r in rows if r.startswith("| hybridnorm's"))
    post = next(r for r in rows if r.startswith("| post's"))
    assert "(550m, init default) | **supported** |" in hyb
    assert "hybridnorm 1.10/1.20/1.30 vs pre 10.00/11.00/12.00" in hyb
    assert "| **contradicted** |" in post
    assert figure2.imbalance(profiles[0]) == pytest.approx(1.0)


def test_the_second_measure_leaves_the_first_two_blocks_out(tmp_path):
    """HybridNorm's first block carries 20× the gradient of a flat rest, Pre-Norm's falls 2× per block:
    last/first calls HybridNorm less balanced, last/third (blocks 3-5 only) more."""
    def prof(placement, seed, blocks):
        return {"size": "550m", "init": "default", "placement": placement, "seed": seed, "resolved_init": "x",
                "block": blocks, "attn": blocks, "ffn": [0.0] * len(blocks)}

    profiles = [prof("pre", s, [16.0, 8.0, 4.0, 2.0, 1.0 + 0.01 * s]) for s in range(3)]
    profiles += [prof("hybridnorm", s, [20.0, 1.0, 1.0, 1.0, 0.95 - 0.01 * s]) for s in range(3)]
    (tmp_path / "figure2").mkdir()
    (tmp_path / "figure2" / "step1.json").write_text(json.dumps({"profiles": profiles}))
    first, past = claims.claim_figure2(tmp_path)
    assert "depth than Pre-Norm's (550m, init default) | **contradicted** | last/first" in first
    assert "depth past the first two blocks than Pre-Norm's (550m, init default) | **supported** |" in past
    assert "last/third block grad ratio per seed hybridnorm 0.95/0.94/0.93 vs pre 0.25/0.25/0.26" in past
    assert figure2.imbalance(profiles[3], skip=2) == pytest.approx(-math.log10(0.95))


TINY = ["--sizes", "tiny", "--inits", "megatron", "--batch-size", "1", "--seq-len", "16"]


@pytest.mark.parametrize("args, names", [
    (["--sizes", "551m"], ["551m"]),
    (["--placements", "pre,prenorm"], ["prenorm"]),
    # one model under two names, or one name twice, was measured and drawn as two placements (tiny: what the
    # old code measured instead of refusing, quickly)
    (["--placements", "pre,Pre-Pre", *TINY], ["--placements lists 'pre' and 'Pre-Pre', two names of one placement"]),
    (["--placements", "hybridnorm,pre_ln,QKV-Post", *TINY], ["'hybridnorm' and 'QKV-Post'"]),
    (["--placements", "pre,pre", *TINY], ["--placements lists 'pre' twice"]),
    (["--seeds", "0,1,0", "--placements", "pre", *TINY], ["--seeds lists 0 twice"]),
    (["--inits", "gaussian"], ["gaussian"]),
    (["--seeds", "0,x"], ["--seeds"]),
])
def test_bad_options_are_one_error_before_any_work(args, names, tmp_path, capsys):
    out = tmp_path / "step1.json"
    assert gradprofile.main(["--out", str(out), *args]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: ") and err.count("\n") == 1, err
    assert all(n in err for n in names) and "Traceback" not in err
    assert not out.exists()  # nothing measured, nothing written


def test_a_file_continued_under_another_name_of_its_placement_is_refused(tmp_path, capsys):
    """The file measured 'pre'; continued with '--placements Pre-Pre' (one model, another name) it measured the
    same profiles again under the new name, which figure2 drew as a second placement. Now refused before any
    work, naming the file's name of it; the same name continues the file as before."""
    out = tmp_path / "step1.json"
    assert gradprofile.main(["--out", str(out), "--placements", "pre", "--seeds", "0", *TINY]) == 0
    before = out.read_bytes()
    capsys.readouterr()
    assert gradprofile.main(["--out", str(out), "--placements", "Pre-Pre", "--seeds", "0,1", *TINY]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "'Pre-Pre'" in err and f"--out {out} holds that placement as 'pre'" in err, err
    assert out.read_bytes() == before
    assert gradprofile.main(["--out", str(out), "--placements", "pre,post", "--seeds", "0", *TINY]) == 0
    profiles = json.loads(out.read_text(encoding="utf-8"))["profiles"]
    assert [p["placement"] for p in profiles] == ["pre", "post"]


@pytest.mark.parametrize("text, says", [
    ("[" * 5000 + "]" * 5000, "nested deeper"),
    ('{"profiles": [1, 2]}', "not a gradprofile file"),
    ("\xff{", "not UTF-8"),
    ('{"profiles": ', "not valid JSON"),
])
def test_a_bad_out_file_is_named_and_kept(text, says, tmp_path, capsys):
    out = tmp_path / "step1.json"
    out.write_bytes(text.encode("latin-1"))
    assert gradprofile.main(["--out", str(out), "--sizes", "tiny", "--seeds", "0"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: --out ") and str(out) in err and says in err and err.count("\n") == 1
    assert out.read_bytes() == text.encode("latin-1")


def test_step_n_profiles_come_from_the_runs_diagnostics(corpus, cache_dir, tmp_path):
    """Two tiny training runs with diagnostics every 3 steps: the step-3 profile of each is its diag record
    (attention, FFN and whole-block norms in block order), size/placement/init/seed from its config; a run
    short of the step is left out; the plot and the claim rows read the collected JSON."""
    from train_helpers import tiny_overrides

    import hybridnorm.train.trainer as trainer
    from hybridnorm.train.config import TrainConfig, apply_overrides

    runs = tmp_path / "step3"
    for placement, steps in (("pre", 3), ("hybridnorm", 3), ("post", 2)):
        cfg = TrainConfig.from_dict(apply_overrides({}, [*tiny_overrides(corpus, cache_dir, runs / placement),
                                                         f"--model.placement={placement}", f"--max_steps={steps}",
                                                         "--diagnostics.every=3"]))
        trainer.train(cfg, quiet=True)
    found = figure2.from_runs(runs, 3)
    assert [(p["placement"], p["size"], p["seed"], p["step"]) for p in found] == [
        ("hybridnorm", "tiny", 0, 3), ("pre", "tiny", 0, 3)]  # post stopped at step 2
    diag = next(json.loads(line) for line in (runs / "pre" / "metrics.jsonl").read_text().splitlines()
                if '"diag"' in line and json.loads(line)["step"] == 3)
    pre = found[1]
    assert pre["attn"] == [diag["grad_norm/blocks.0.attn"], diag["grad_norm/blocks.1.attn"]]
    assert pre["block"] == [diag["grad_norm/blocks.0"], diag["grad_norm/blocks.1"]]
    out = tmp_path / "results" / "figure2" / "step100.json"
    assert figure2.main(["--from-runs", str(runs), "--step", "3", str(out)]) == 0
    assert out.with_suffix(".png").stat().st_size > 1000
    rows = claims.claim_figure2(tmp_path / "results")  # read as step100.json: the file name sets the step
    # 2 blocks: the whole-depth row only (nothing is left past the first two blocks)
    assert len(rows) == 1 and "hybridnorm's step-100 gradient norms are more balanced across depth than" in rows[0]
    assert "(1 seed)" in rows[0], rows


@pytest.mark.parametrize("config, says", [("model: [\n", "not valid yaml"),
                                          ("model: 5\n", "model=5 must be a section")])
def test_from_runs_names_a_bad_run_config_and_writes_nothing(config, says, tmp_path, capsys):
    run = tmp_path / "runs" / "a"
    run.mkdir(parents=True)
    (run / "metrics.jsonl").write_text('{"kind": "diag", "step": 3, "grad_norm/blocks.0": 1.0}\n')
    (run / "config.yaml").write_text(config)
    out = tmp_path / "step3.json"
    assert figure2.main(["--from-runs", str(tmp_path / "runs"), "--step", "3", str(out)]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: ") and str(run / "config.yaml") in err and says in err and err.count("\n") == 1
    assert not out.exists()


@pytest.mark.parametrize("argv, says", [
    ([], "the following arguments are required: --out"),
    (["--out", "x.json", "--bogus"], "unrecognized arguments: --bogus"),
    (["--out", "x.json", "--seeds", "a"], "--seeds: comma-separated integers, got 'a'"),
    (["--out", "x.json", "--batch-size", "two"], "argument --batch-size: invalid int value"),
])
def test_bad_arguments_through_the_cli_are_one_error_line(argv, says, tmp_path, capsys, monkeypatch):
    """``hybridnorm gradprofile`` as the user runs it: exit 2 with one ``error:`` line, no usage block."""
    from hybridnorm.cli import main

    monkeypatch.chdir(tmp_path)
    assert main(["gradprofile", *argv]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: hybridnorm gradprofile: ") and says in err and err.count("\n") == 1, err
    assert not (tmp_path / "x.json").exists()


@pytest.mark.parametrize("size", ["550m", "543m-deep", "moe-1b-7b", "moe-1b-2b", "tiny-moe"])
def test_a_run_is_labelled_with_the_preset_it_was_built_from(size):
    from hybridnorm.config import ModelConfig
    from hybridnorm.train.config import TrainConfig

    cfg = TrainConfig(model=ModelConfig.from_preset(size, placement="pre"), seq_len=64)
    assert figure2.size_of(cfg) == size  # the two 16-layer MoEs differ only in their expert count
    wider = TrainConfig(model=ModelConfig.from_preset(size, placement="pre", ffn_hidden_size=96), seq_len=64)
    assert figure2.size_of(wider) == "custom"


@pytest.mark.parametrize("other", [["--seq-len", "8"], ["--batch-size", "3"]])
def test_a_file_of_another_batch_shape_is_refused_not_silently_resumed(other, tmp_path, capsys):
    """Before 2026-12-02 a resume with another --seq-len or --batch-size skipped every cell the file had,
    exit 0, so the file kept the old shape while the command line said the new one."""
    from hybridnorm.cli import main

    out = tmp_path / "step1.json"
    record = {"size": "tiny", "placement": "pre", "init": "default", "seed": 0, "block": [1.0, 1.0],
              "batch_size": 2, "seq_len": 16}
    out.write_text(json.dumps({"profiles": [record]}))
    before = out.read_bytes()
    argv = ["gradprofile", "--out", str(out), "--sizes", "tiny", "--placements", "pre", "--inits", "default",
            "--seeds", "0", "--batch-size", "2", "--seq-len", "16"]
    same = list(argv)
    argv[argv.index(other[0]) + 1] = other[1]
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"error: --out {out} holds profiles measured with --batch-size 2 --seq-len 16") and \
        err.count("\n") == 1, err
    assert out.read_bytes() == before
    assert main(same) == 0  # the same shape: its one cell is there, nothing measured again
    assert out.read_bytes() == before


@pytest.mark.parametrize("where", ["before", "after"])
def test_debug_shows_the_traceback_before_or_after_the_command(where, tmp_path, capsys):
    """As for every other command: before 2026-12-02 ``gradprofile --debug`` was an unknown argument and
    ``hybridnorm --debug gradprofile`` still printed the one line."""
    from hybridnorm.cli import main
    from hybridnorm.errors import ConfigError

    argv = ["gradprofile", "--out", str(tmp_path / "p.json"), "--sizes", "huge"]
    with pytest.raises(ConfigError, match="size 'huge'"):
        main(["--debug", *argv] if where == "before" else [*argv, "--debug"])
    assert "error:" not in capsys.readouterr().err
    assert main(argv) == 2 and capsys.readouterr().err.startswith("error: size 'huge'")
