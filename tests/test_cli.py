"""The ``hybridnorm`` command line: placements listing, train/generate/eval on a tiny run, and bad input
as ONE ``error: ...`` line on stderr with exit code 2 and no traceback (``--debug`` shows it)."""

from __future__ import annotations

import json
import math
import os
import random
import re
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from hybridnorm import cli, placements
from hybridnorm.config import SIZES

WORDS = ("the lord said unto moses and aaron go forth into a land of milk and honey where the people shall keep "
         "my law by day and by night behold the river ran dry and the city was built upon a hill").split()
PROMPT = "the lord said"


def _write_corpus(folder: Path) -> Path:
    rng = random.Random(0)
    folder.mkdir(parents=True, exist_ok=True)
    for i in range(6):
        lines = [" ".join(rng.choice(WORDS) for _ in range(rng.randint(4, 12))).capitalize() + "."
                 for _ in range(60)]
        (folder / f"doc{i}.txt").write_text("\n".join(lines) + "\n", encoding="utf-8")
    return folder


@pytest.fixture(scope="module")
def work(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("cli")
    _write_corpus(root / "corpus")
    (root / "empty.txt").write_text("  \n\n", encoding="utf-8")
    (root / "latin1.txt").write_bytes("café au lait, s'il vous plaît\n".encode("latin-1") * 20)
    return root


def _train_args(work: Path, out: Path, *extra: str) -> list[str]:
    return ["train", "--size", "tiny", "--out", str(out), f"--data.source={work / 'corpus'}",
            "--data.tokenizer=bytes", f"--data.cache_dir={work / 'cache'}", "--seq_len=32", "--batch_size=4",
            "--eval_interval=1000", "--eval_batches=2", "--ckpt_interval=2", "--log_interval=1",
            "--precision=fp32", "--device=cpu", *extra]


@pytest.fixture(scope="module")
def run(work: Path) -> Path:
    """A tiny run trained for 4 steps (checkpoints at 2 and 4) through the CLI."""
    import hybridnorm.train.trainer as trainer

    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(trainer, "measured_peak_flops", lambda *a, **k: 1e12)  # skip the seconds-long benchmark
        assert cli.main(_train_args(work, work / "run", "--max-steps", "4")) == 0
    return work / "run"


def _copy(run: Path, tmp_path: Path) -> Path:
    return Path(shutil.copytree(run, tmp_path / "run"))


def _into_checkpoints(run: Path, name: str) -> None:
    """The run's ``name`` copied over each checkpoint's own copy, its manifest rewritten to vouch for it (a
    hand edit that leaves every hash matching: only the loader's own checks can catch what it says)."""
    from hybridnorm.train.checkpoint import list_checkpoints
    from hybridnorm.train.checkpoint.format import sha256_of

    for ckpt in list_checkpoints(run / "checkpoints"):
        shutil.copyfile(run / name, ckpt / name)
        manifest = json.loads((ckpt / "manifest.json").read_text(encoding="utf-8"))
        manifest[name] = {"bytes": (ckpt / name).stat().st_size, "sha256": sha256_of(ckpt / name)}
        (ckpt / "manifest.json").write_text(json.dumps(manifest), encoding="utf-8")


def _vocab_mismatch(run: Path, tmp_path: Path) -> Path:
    """The run's tokenizer.json (and the checkpoints' copies) replaced by a BPE with a bigger vocabulary than
    the model's 257."""
    from hybridnorm.data import train_bpe

    copy = _copy(run, tmp_path)
    tok = train_bpe([(run.parent / "corpus" / "doc0.txt").read_text(encoding="utf-8")], vocab_size=300)
    assert tok.vocab_size > 257
    tok.save(copy)
    _into_checkpoints(copy, "tokenizer.json")
    return copy


def _smaller_tokenizer(run: Path, tmp_path: Path) -> Path:
    """The run's config.yaml (and the checkpoints' copies) claim a model vocab (300) larger than its byte
    tokenizer's 257."""
    copy = _copy(run, tmp_path)
    text = (copy / "config.yaml").read_text(encoding="utf-8")
    assert "vocab_size: 257" in text
    (copy / "config.yaml").write_text(text.replace("vocab_size: 257", "vocab_size: 300", 1), encoding="utf-8")
    _into_checkpoints(copy, "config.yaml")
    return copy


def _corrupt_step4(run: Path, tmp_path: Path) -> Path:
    copy = _copy(run, tmp_path)
    f = copy / "checkpoints" / "step_000004" / "model.safetensors"
    data = bytearray(f.read_bytes())
    data[-5] ^= 0xFF
    f.write_bytes(bytes(data))
    return copy / "checkpoints" / "step_000004"


# name -> (argv builder(work, run, tmp_path), substrings the one error line must contain)
BAD_INPUTS = {
    "missing corpus": (lambda w, r, t: _train_args(w, t / "o", f"--data.source={w / 'missing.txt'}"),
                       ["missing.txt", "does not exist"]),
    "empty corpus": (lambda w, r, t: _train_args(w, t / "o", f"--data.source={w / 'empty.txt'}"),
                     ["empty.txt", "empty"]),
    "non-utf8 corpus": (lambda w, r, t: _train_args(w, t / "o", f"--data.source={w / 'latin1.txt'}"),
                        ["latin1.txt", "not UTF-8"]),
    "config typo": (lambda w, r, t: _train_args(w, t / "o", "--optim.lrr=1"),
                    ["'lrr'", "valid fields", "lr"]),
    "bad value type": (lambda w, r, t: _train_args(w, t / "o", "--batch_size=many"),
                       ["batch_size", "int"]),
    "unknown placement": (lambda w, r, t: _train_args(w, t / "o", "--placement", "nonorm_xyz"),
                          ["nonorm_xyz", "hybridnorm_star", "qk_norm", "pre"]),
    "unknown size": (lambda w, r, t: ["train", "--size", "huge", "--out", str(t / "o")], ["huge", "tiny"]),
    "missing yaml config": (lambda w, r, t: ["train", str(t / "nope.yaml")], ["nope.yaml", "cannot read"]),
    "existing run without --resume": (lambda w, r, t: _train_args(w, r, "--max-steps", "6"),
                                      ["already has checkpoints", "--resume"]),
    "eval vocab mismatch": (lambda w, r, t: ["eval", str(_vocab_mismatch(r, t))], ["vocab mismatch", "300", "257"]),
    "generate tokenizer smaller than model": (lambda w, r, t: ["generate", str(_smaller_tokenizer(r, t))],
                                              ["vocab mismatch", "257", "300", "config.yaml"]),
    "generate vocab mismatch": (lambda w, r, t: ["generate", str(_vocab_mismatch(r, t))],
                                ["vocab mismatch", "300", "257"]),
    "corrupt checkpoint": (lambda w, r, t: ["eval", str(_corrupt_step4(r, t))],
                           ["model.safetensors", "corrupt"]),
    "no run folder": (lambda w, r, t: ["generate", str(t / "nothing")], ["nothing does not exist (expected a run"]),
    "negative temperature": (lambda w, r, t: ["generate", str(r), "--temperature=-1"], ["--temperature"]),
    "zero eval batches": (lambda w, r, t: ["eval", str(r), "--batches", "0"], ["--batches"]),
    # an empty value ("$VAR" unset) used to mean "not given" (the default placement, size, init or baseline
    # went on silently) or, for a path, the current folder (a token cache written into it)
    "empty --placement": (lambda w, r, t: _train_args(w, t / "o", "--placement", "", "--max-steps", "2"),
                          ["--placement is empty"]),
    # (each case stays a short run should the refusal ever go)
    "empty --size": (lambda w, r, t: ["train", "--size", "", *_train_args(w, t / "o")[3:], "--max-steps", "2"],
                     ["--size is empty"]),
    "empty compare --init": (lambda w, r, t: ["compare", "--placements", "pre", "--init", "", "--size", "tiny",
                                              "--max-steps", "2", "--out", str(t / "o")], ["--init is empty"]),
    "empty checkpoint path": (lambda w, r, t: ["export", "", "--to", "hf", str(t / "x")], ["checkpoint is empty"]),
    "empty data.cache_dir": (lambda w, r, t: _train_args(w, t / "o", "--data.cache_dir=", "--max-steps", "2"),
                             ["data.cache_dir", "empty"]),
    "model.vocab_size override": (lambda w, r, t: _train_args(w, t / "o", "--model.vocab_size=300", "--max-steps", "2"),
                                  ["--model.vocab_size", "tokenizer", "--data.vocab_size", "pad_vocab_multiple"]),
    "empty data.tokenizer": (lambda w, r, t: _train_args(w, t / "o", "--data.tokenizer=", "--max-steps", "2"),
                             ["data.tokenizer=''", "bpe", "bytes"]),
}


def _check_one_error_line(err: str, needles: list[str]) -> None:
    lines = err.strip().splitlines()
    assert len(lines) == 1, err
    assert lines[0].startswith("error: "), err
    assert "Traceback" not in err
    for needle in needles:
        assert needle in lines[0], (needle, lines[0])


@pytest.mark.parametrize("case", sorted(BAD_INPUTS))
def test_bad_input_is_one_error_line(case, work, run, tmp_path, capsys):
    build, needles = BAD_INPUTS[case]
    argv = build(work, run, tmp_path)
    capsys.readouterr()
    assert cli.main(argv) == 2
    _check_one_error_line(capsys.readouterr().err, needles)



def test_a_torchrun_restart_of_a_command_without_resume_says_to_add_it(work, run, tmp_path, capsys, monkeypatch):
    """torchrun --max-restarts reruns the same command: without --resume the restart finds the first attempt's
    checkpoints, and the error line says how to make restarts continue instead."""
    monkeypatch.setenv("TORCHELASTIC_RESTART_COUNT", "1")
    capsys.readouterr()
    assert cli.main(_train_args(work, run, "--max-steps", "6")) == 2
    _check_one_error_line(capsys.readouterr().err, ["already has checkpoints", "torchrun restarted this group",
                                                    "--max-restarts", "--resume"])

def _env() -> dict[str, str]:
    env = {**os.environ, "PYTHONWARNINGS": "ignore::DeprecationWarning"}
    for var in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE"):
        env.pop(var, None)
    return env


# one case per kind of failure (data, config, placement, tokenizer/checkpoint, corruption) as a real process
SUBPROCESS_CASES = ("non-utf8 corpus", "config typo", "unknown placement", "generate vocab mismatch",
                    "corrupt checkpoint")


def test_bad_input_in_a_real_process_has_no_traceback_and_debug_shows_it(work, run, tmp_path):
    """Bad input as real processes (all at once: each mostly waits on imports): one line, exit 2."""
    cases = {}
    for name in SUBPROCESS_CASES:
        (tmp_path / name.replace(" ", "_")).mkdir()
        build, needles = BAD_INPUTS[name]
        cases[name] = (build(work, run, tmp_path / name.replace(" ", "_")), needles, 2)
    typo = _train_args(work, tmp_path / "o", "--optim.lrr=1")
    cases["--debug"] = ([typo[0], "--debug", *typo[1:]], None, 1)
    procs = {name: subprocess.Popen([sys.executable, "-m", "hybridnorm.cli", *argv], stdout=subprocess.PIPE,
                                    stderr=subprocess.PIPE, text=True, env=_env())
             for name, (argv, _, _) in cases.items()}
    failures = []
    for name, proc in procs.items():
        _, err = proc.communicate(timeout=120)
        _, needles, want_rc = cases[name]
        try:
            assert proc.returncode == want_rc, f"exit code {proc.returncode}"
            if needles is None:  # --debug: the traceback of the ConfigError instead of the one line
                assert "Traceback (most recent call last)" in err and "ConfigError" in err and "lrr" in err
                assert not err.strip().splitlines()[-1].startswith("error:")
            else:
                _check_one_error_line(err, needles)
        except AssertionError as e:
            failures.append(f"{name}: {e}\nstderr: {err[-2000:]}")
    assert not failures, "\n\n".join(failures)


@pytest.mark.parametrize("where", ["before", "after"])
def test_debug_reraises_before_or_after_the_command(work, tmp_path, where, capsys):
    from hybridnorm.errors import ConfigError

    argv = _train_args(work, tmp_path / "o", "--optim.lrr=1")
    argv = ["--debug", *argv] if where == "before" else [argv[0], "--debug", *argv[1:]]
    with pytest.raises(ConfigError, match="lrr"):
        cli.main(argv)
    assert "error:" not in capsys.readouterr().err
    # and without --debug the same input is the one-line error
    assert cli.main([a for a in argv if a != "--debug"]) == 2


def test_placements_lists_every_preset_with_its_equation(capsys):
    assert cli.main(["placements"]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert len(lines) == len(placements.names())
    for name, line in zip(placements.names(), lines, strict=True):
        assert line.split()[0] == name
        assert line.endswith(placements.one_line(placements.get(name)))
        assert "=" in line
    assert not any(line.startswith("QKV-Post") for line in lines)


def test_placements_all_adds_the_paper_grammar_names(capsys):
    assert cli.main(["placements", "--all"]) == 0
    out = capsys.readouterr().out
    assert placements.GRAMMAR in out
    lines = {line.split()[0]: line for line in out.splitlines() if line.strip() and not line.startswith("Grammar")}
    for name in (*placements.names(), *placements.PAPER_NAMES):
        assert name in lines, name
    assert "QKV-Post" in placements.PAPER_NAMES
    assert lines["QKV-Post"].endswith(placements.one_line(placements.get("QKV-Post")))
    assert "MHA_QKV(X)" in lines["QKV-Post"]


def test_console_script_is_installed():
    exe = shutil.which("hybridnorm")
    if exe is None:
        pytest.skip("the hybridnorm console script is not on PATH")
    proc = subprocess.run([exe, "placements"], capture_output=True, text=True, timeout=120, env=_env())
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.split()[0] == placements.names()[0]


def test_train_wrote_a_complete_run(run, capsys):
    assert sorted(p.name for p in (run / "checkpoints").iterdir()) == ["step_000002", "step_000004"]
    for name in ("config.yaml", "metrics.jsonl", "tokenizer.json"):
        assert (run / name).is_file(), name
    cfg_text = (run / "config.yaml").read_text(encoding="utf-8")
    assert f"d_model: {SIZES['tiny']['d_model']}" in cfg_text and "vocab_size: 257" in cfg_text


def test_generate_continues_the_prompt(run, capsys):
    argv = ["generate", str(run), "--prompt", PROMPT, "--max-new-tokens", "24", "--seed", "3"]
    assert cli.main(argv) == 0
    out = capsys.readouterr().out
    assert out.startswith(PROMPT) and len(out.rstrip("\n")) > len(PROMPT)
    assert cli.main(argv) == 0
    assert capsys.readouterr().out == out  # seeded: the same text again
    assert cli.main(["generate", str(run), "--prompt", PROMPT, "--max-new-tokens", "8", "--top-k", "0",
                     "--temperature", "0"]) == 0  # greedy, no top-k
    assert capsys.readouterr().out.startswith(PROMPT)


def test_eval_prints_loss_and_perplexity(run, capsys):
    assert cli.main(["eval", str(run), "--batches", "2", "--batch-size", "2"]) == 0
    out = capsys.readouterr().out
    m = re.search(r"step_000004: val loss ([\d.]+), perplexity ([\d.]+) over ([\d,]+) tokens", out)
    assert m, out
    loss, ppl, tokens = float(m[1]), float(m[2]), int(m[3].replace(",", ""))
    assert 0 < loss < math.log(257) + 1
    assert ppl == pytest.approx(math.exp(loss), rel=1e-3, abs=0.01)
    assert tokens == 2 * 2 * 32  # 2 batches of 2 windows of seq_len 32


def test_eval_by_default_scores_what_training_validated_on(work, tmp_path, capsys):
    """``hybridnorm eval RUN`` with no options gives the loss the run's log shows for its checkpoint, over the
    same tokens: eval_batches global batches of windows, whatever batch size it scores them in. The run
    accumulates 2 micro-batches of 3, so neither the micro-batch nor eval's own old default (50 batches of 8)
    counts them right."""
    from train_helpers import read_metrics

    import hybridnorm.train.trainer as trainer

    out = tmp_path / "ga"
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(trainer, "measured_peak_flops", lambda *a, **k: 1e12)
        assert cli.main([*_train_args(work, out, "--max-steps", "2"), "--batch_size=3", "--grad_accum=2",
                         "--eval_batches=3"]) == 0
    logged = read_metrics(out, "eval")[-1]
    assert logged["step"] == 2 and logged["val_tokens"] == 3 * 6 * 32  # 3 global batches of 6 windows
    capsys.readouterr()
    # the references printed beside it are taken on the same targets: those of the loader's windows
    from hybridnorm.data import bigram_entropy, unigram_entropy, val_batches
    from hybridnorm.loading import load_run, validation_data

    data = validation_data(load_run(out))
    train, val, n = data.train_tokens(), data.val_tokens(), logged["val_tokens"]
    windows = [(x.numpy().ravel(), y.numpy().ravel()) for x, y in val_batches(val, 6, 32, 3)]
    assert np.array_equal(np.concatenate([w[0] for w in windows]), val[:n])
    targets = np.concatenate([w[1] for w in windows])
    assert np.array_equal(targets, val[1:n + 1]) and n + 1 < len(val)  # a prefix of the split
    refs = (f"on those tokens a unigram model scores {unigram_entropy(train, targets, data.vocab_size):.4f}, "
            f"a Kneser-Ney bigram {bigram_entropy(train, val[:n + 1], data.vocab_size):.4f}")
    for extra in ([], ["--batch-size", "4"]):  # 18 windows in batches of 4: the last one holds 2
        assert cli.main(["eval", str(out), *extra, "--output", str(tmp_path / "e.json")]) == 0
        printed = capsys.readouterr().out
        m = re.search(r"val loss ([\d.]+), perplexity [\d.]+ over ([\d,]+) tokens", printed)
        assert int(m[2].replace(",", "")) == logged["val_tokens"]
        assert float(m[1]) == pytest.approx(logged["val_loss"], abs=5e-5)  # printed to 4 decimals
        assert refs in printed, printed
        written = json.loads((tmp_path / "e.json").read_text())["val"]
        assert f"{written['unigram_entropy']:.4f}" in refs and f"{written['bigram_entropy']:.4f}" in refs


def test_eval_of_a_single_checkpoint_and_fallback_past_a_corrupt_one(run, tmp_path, capsys):
    assert cli.main(["eval", str(run / "checkpoints" / "step_000002"), "--batches", "1"]) == 0
    assert "step_000002: val loss" in capsys.readouterr().out
    bad = _corrupt_step4(run, tmp_path)
    with pytest.warns(UserWarning, match=r"skipping bad checkpoint.*model\.safetensors"):
        assert cli.main(["eval", str(bad.parent.parent), "--batches", "1"]) == 0
    assert "step_000002: val loss" in capsys.readouterr().out


@pytest.mark.parametrize("command", ["eval", "generate", "export"])
def test_a_runs_checkpoints_folder_is_refused_naming_what_to_pass(run, tmp_path, capsys, command):
    folder = run / "checkpoints"
    newest = sorted(folder.glob("step_*"))[-1]
    argv = {"eval": ["eval", str(folder), "--batches", "1"], "generate": ["generate", str(folder)],
            "export": ["export", str(folder), "--to", "hf", str(tmp_path / "hf")]}[command]
    capsys.readouterr()
    assert cli.main(argv) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("error:"), err
    assert f"pass the run folder {run} " in err[0] and str(newest) in err[0]
    assert cli.main([argv[0], str(newest), *argv[2:]]) == 0  # the checkpoint it names works


@pytest.mark.parametrize("command", ["eval", "generate", "export"])
def test_a_run_whose_every_checkpoint_is_corrupt_is_one_error_line_naming_the_newest_file(run, tmp_path, capsys,
                                                                                          command):
    bad = _corrupt_step4(run, tmp_path)
    older = bad.parent / "step_000002" / "optimizer.safetensors"
    older.write_bytes(older.read_bytes()[:-7])
    argv = {"eval": ["eval", str(bad.parent.parent), "--batches", "1"],
            "generate": ["generate", str(bad.parent.parent), "--max-new-tokens=2"],
            "export": ["export", str(bad.parent.parent), "--to", "hf", str(tmp_path / "hf")]}[command]
    capsys.readouterr()
    assert cli.main(argv) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("error:"), err
    assert "2 found, none verifies" in err[0] and str(bad / "model.safetensors") in err[0]


def test_resume_through_the_cli_continues_the_run(run, work, tmp_path, capsys, monkeypatch):
    import hybridnorm.train.trainer as trainer

    monkeypatch.setattr(trainer, "measured_peak_flops", lambda *a, **k: 1e12)
    copy = _copy(run, tmp_path)
    assert cli.main(_train_args(work, copy, "--max-steps", "6", "--resume")) == 0
    out = capsys.readouterr().out
    assert "final: step 6, train loss " in out and "no step to train" not in out
    assert (copy / "checkpoints" / "step_000006").is_dir()
    # the same command again: nothing left to train, said as such rather than as a NaN train loss
    assert cli.main(_train_args(work, copy, "--max-steps", "6", "--resume")) == 0
    assert "final: step 6, train loss - (no step to train)" in capsys.readouterr().out


def test_size_preset_alone_picks_a_seq_len_that_fits(work, tmp_path, capsys, monkeypatch):
    import hybridnorm.train.trainer as trainer

    monkeypatch.setattr(trainer, "measured_peak_flops", lambda *a, **k: 1e12)
    out = tmp_path / "run"
    argv = ["train", "--size", "tiny", "--out", str(out), "--max-steps", "1", f"--data.source={work / 'corpus'}",
            "--data.tokenizer=bytes", f"--data.cache_dir={work / 'cache'}", "--batch_size=2", "--eval_batches=1"]
    assert cli.main(argv) == 0  # the default seq_len 256 would exceed tiny's max_seq_len 128
    assert "\nseq_len: 128\n" in (out / "config.yaml").read_text(encoding="utf-8")
