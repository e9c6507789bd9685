"""The single cases of issue 24 that are not a generated class: values a preset replaces, a device that is
not there, a plan where nothing fits, a size that cannot be allocated, text that is not UTF-8. Each goes
through the real command line: exit 2, one ``error:`` line naming the option or field, no traceback."""

from __future__ import annotations

import os
import re
from pathlib import Path

import pytest
import torch
from bad_input_helpers import assert_refused, make_hf_and_run
from hypothesis import given
from test_config_fuzz import FUZZ, values

from hybridnorm.cli import main
from hybridnorm.errors import ERROR_CHARS
from hybridnorm.train.config import TrainConfig

pytest.importorskip("transformers", reason="the hf extra (transformers) is not installed")


@pytest.fixture(scope="module")
def run(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_hf_and_run(tmp_path_factory.mktemp("cases"))[1]


@pytest.mark.parametrize(("text", "needle"), [
    ("model: 5\n", "model=5 must be a section"),
    ("model:\n  d_model: abc\n", "model.d_model='abc' must be an integer"),
    ("model:\n  n_layers: -3\n", "model.n_layers=-3 must be >= 1"),
    ("model:\n  colour: red\n", "unknown field 'colour'"),
    ("model:\n  moe:\n    top_k: x\n", "model.moe.top_k='x'"),
])
def test_file_values_are_checked_even_when_size_replaces_the_section(tmp_path, capsys, text, needle) -> None:
    f = tmp_path / "cfg.yaml"
    f.write_text(text)
    assert_refused(["train", str(f), "--size", "tiny", "--out", str(tmp_path / "out")], capsys,
                   [str(f), needle], tmp_path)


@FUZZ
@given(value=values)
def test_a_size_never_makes_a_wrong_model_section_right(tmp_path_factory, value) -> None:
    """--size may replace the file's model values but never makes a wrong one right."""
    f = tmp_path_factory.mktemp("cfg") / "cfg.yaml"
    import yaml
    f.write_text(yaml.safe_dump({"model": value}))
    from hybridnorm.errors import ConfigError
    from hybridnorm.train.config import check_types
    try:
        check_types(TrainConfig, {"model": value}, "")
        typed = True
    except ConfigError:
        typed = False
    try:
        TrainConfig.from_cli(f, [], size="tiny")
        assert typed, value
    except ConfigError as e:
        assert not typed or "model" in str(e)  # a typed section can still break a cross-field rule


@pytest.mark.skipif(torch.cuda.is_available(), reason="needs a machine without CUDA")
@pytest.mark.parametrize("extra", [[], ["--text", "kjv"], ["--mc", "nowhere.jsonl"]])
@pytest.mark.parametrize("device", ["cuda", "cuda:1", "meta", "nonsense"])
def test_eval_device_that_is_not_there_is_refused_before_any_work(run, tmp_path, capsys, device, extra) -> None:
    assert_refused(["eval", str(run), "--device", device, *extra], capsys, [f"--device={device!r}"], tmp_path)


@pytest.mark.skipif(torch.cuda.is_available(), reason="needs a machine without CUDA")
@pytest.mark.parametrize("device", ["cuda", "cuda:1", "meta", "nonsense"])
def test_generate_device_that_is_not_there_is_refused_before_any_work(run, tmp_path, capsys, device) -> None:
    assert_refused(["generate", str(run), "--device", device], capsys, [f"--device={device!r}"], tmp_path)


@pytest.mark.parametrize(("argv", "needles"), [
    (["--gpu-mem", "0.001"], ["nothing fits", "--gpu-mem=0.001", "--seq-len=4096"]),
    (["--size", "tiny", "--seq-len", "128", "--gpu-mem", "0.0000001"], ["nothing fits", "--gpu-mem="]),
    (["--micro-batch", "100000"], ["--micro-batch=100000 does not fit", "largest micro-batch that fits is"]),
])
def test_plan_says_when_nothing_or_the_given_micro_batch_does_not_fit(tmp_path, capsys, argv, needles) -> None:
    assert_refused(["plan", *argv], capsys, needles, tmp_path)


@pytest.mark.parametrize("argv", [[], ["--micro-batch", "20"], ["--gpu-mem", "20"], ["--size", "tiny", "--seq-len",
                                                                                     "128", "--micro-batch", "9999"]])
def test_plan_table_columns_never_run_together(capsys, argv) -> None:
    assert main(["plan", *argv]) == 0
    out = capsys.readouterr().out.splitlines()
    assert any(line.startswith("micro-batch") and "fits under" in line for line in out)
    header = next(i for i, line in enumerate(out) if line.startswith("GiB per GPU"))
    cells = [re.split(r"\s{2,}", line.strip()) for line in out[header:header + 3]]
    assert [len(c) for c in cells] == [11, 11, 11], cells  # every column apart, however large its numbers


@pytest.mark.parametrize("value", ["1000000000000", "10000000000000000000000000"])
def test_a_size_that_cannot_be_allocated_names_its_field(tmp_path, capsys, corpus, cache_dir, value) -> None:
    argv = ["train", "--size", "tiny", "--max-steps", "1", "--data.tokenizer=bytes", f"--data.source={corpus}",
            f"--data.cache_dir={cache_dir}", "--device=cpu", f"--model.max_seq_len={value}",
            "--out", str(tmp_path / "out")]
    assert_refused(argv, capsys, [f"model.max_seq_len={value}", "RoPE tables"], tmp_path)


def test_a_prompt_or_a_config_string_that_is_not_utf8_is_named(run, tmp_path, capsys) -> None:
    bad = b"in the \xff beginning".decode("utf-8", "surrogateescape")  # how Python passes such argv bytes
    assert_refused(["generate", str(run), "--prompt", bad], capsys, ["--prompt=", "not valid UTF-8"], tmp_path)
    assert_refused(["train", "--size", "tiny", f"--data.source={bad}", "--out", str(tmp_path / "o")], capsys,
                   ["data.source=", "not valid UTF-8"], tmp_path)


def test_in_a_real_process_raw_bytes_and_a_lying_file_are_one_line(run, tmp_path) -> None:
    """The same promises from a real ``python -m hybridnorm.cli`` (argv bytes as a shell passes them, the
    interpreter's own stderr encoding): exit 2, one ``error:`` line, no traceback."""
    import os
    import subprocess
    import sys

    cases = [[b"generate", os.fsencode(run), b"--prompt", b"in the \xff beginning"],
             [b"import", os.fsencode(run), b"--out", os.fsencode(run)],  # a run is no HF folder: named first
             [b"plan", b"--gpu-mem", b"0.001"]]
    for argv in cases:
        p = subprocess.run([sys.executable, "-m", "hybridnorm.cli", *argv], capture_output=True, timeout=600)
        err = p.stderr.decode("utf-8", "replace")
        lines = [ln for ln in err.splitlines() if ln.strip()]
        assert p.returncode == 2 and len(lines) == 1 and lines[0].startswith("error:"), (argv, err)
        assert "Traceback" not in err


def _wordlevel_without_unk(path: Path) -> Path:
    from tokenizers import Tokenizer
    from tokenizers.models import WordLevel
    from tokenizers.pre_tokenizers import Whitespace

    tok = Tokenizer(WordLevel({"<|endoftext|>": 0, "a": 1}, unk_token=None))
    tok.pre_tokenizer = Whitespace()
    tok.save(str(path))
    return path


@pytest.mark.parametrize(("case", "needles"), [
    ("a list as a yaml key", ["cfg.yaml", "a key must be a name, not ['a']"]),
    ("a list as a key in an override", ["model.moe="]),
    ("a seed past 64 bits", ["seed=18446744073709551616", "<= 18446744073709551615"]),
    ("a tokenizer that cannot encode the corpus", ["wl.json", "cannot encode", "Missing [UNK]"]),
    ("a corpus too small to split", ["too small to split", "give a longer data.source"]),
    ("a plan for more memory than it can count", ["--gpu-mem=1e+300", "<="]),
    ("gradprofile into a folder", ["--out", "is a folder", "gradprofile.json"]),  # was: after the profiles
    ("a path of 100,000 characters", ["--data.source: File name too long", "characters left out", "aaaa"]),
    ("a FIFO as the data", ["data.source", "fifo.txt", "not a regular file"]),  # was: waited forever
    ("a batch whose activations cannot fit", ["batch_size=10000000 x seq_len=", "activations one micro-batch"]),
    ("the root folder as data", ["--out", "inside the input folder data.source=/:"]),  # hypothesis found it
])
def test_found_by_the_2026_12_probe_each_is_one_error_line(tmp_path: Path, capsys, corpus: Path, case: str,
                                                           needles: list[str]) -> None:
    """Each was a traceback (or an error naming a field that does not exist, a wait without end, the OOM
    killer's kill without a word) before 2026-12-02."""
    out = ["--size", "tiny", "--max-steps", "1", "--out", str(tmp_path / "out"), "--data.tokenizer=bytes",
           f"--data.source={corpus}"]
    (tmp_path / "cfg.yaml").write_text("? [a]\n: 1\n")
    (tmp_path / "small").mkdir()
    (tmp_path / "small" / "a.txt").write_text("x")
    os.mkfifo(tmp_path / "fifo.txt")
    argv = {"a list as a yaml key": ["train", str(tmp_path / "cfg.yaml"), *out],
            "a list as a key in an override": ["train", *out, "--model.moe={? [a]: 1}"],
            "a seed past 64 bits": ["train", *out, "--seed=18446744073709551616"],
            "a tokenizer that cannot encode the corpus":
                ["train", *out, f"--data.tokenizer={_wordlevel_without_unk(tmp_path / 'wl.json')}"],
            "a corpus too small to split": ["train", *out, f"--data.source={tmp_path / 'small'}"],
            "a plan for more memory than it can count": ["plan", "--size", "1.2b", "--gpu-mem", "1e300"],
            "gradprofile into a folder": ["gradprofile", "--out", str(tmp_path / "small"), "--sizes", "tiny",
                                          "--placements", "pre", "--seeds", "0", "--seq-len", "16"],
            "a path of 100,000 characters": ["train", *out, f"--data.source={tmp_path / ('a' * 100_000)}"],
            "a FIFO as the data": ["train", *out, f"--data.source={tmp_path / 'fifo.txt'}"],
            "a batch whose activations cannot fit": ["train", *out, "--batch_size=10000000"],
            "the root folder as data": ["train", *out, "--data.source=/"]}[case]
    line = assert_refused(argv, capsys, needles, tmp_path)
    assert "val_fraction" not in line and len(line) <= len("error: ") + ERROR_CHARS
    assert not (tmp_path / "out").exists()  # nothing made for a command refused before it starts


def test_a_run_whose_checkpoints_folder_is_a_file_is_refused_not_restarted(tmp_path: Path, capsys, corpus: Path,
                                                                          cache_dir: Path) -> None:
    """Before 2026-12-02 `--resume` found no checkpoint there, moved the log aside and trained from step 0."""
    import shutil

    from train_helpers import cli_in_process, tiny_overrides

    run = tmp_path / "run"
    cli_in_process("train", *tiny_overrides(corpus, cache_dir, run), "--max-steps", "2", "--ckpt_interval=2")
    shutil.rmtree(run / "checkpoints")
    (run / "checkpoints").write_text("x")
    assert_refused(["train", *tiny_overrides(corpus, cache_dir, run), "--resume", "--max-steps", "4"], capsys,
                   [str(run / "checkpoints"), "is a file"], tmp_path)
    assert not (run / "metrics.stale.jsonl").exists()


@pytest.mark.parametrize("where", ["--out", "--data.source", "run", "--prompt-file"])
def test_a_name_too_long_for_the_file_system_names_the_option_that_holds_it(run, tmp_path, capsys, corpus,
                                                                             where) -> None:
    """The OS's ``File name too long`` said which path, not which option, before 2026-12-02."""
    long = tmp_path / ("n" * 300)
    argv = {"--out": ["train", "--size", "tiny", "--max-steps", "1", "--data.tokenizer=bytes",
                      f"--data.source={corpus}", "--out", str(long / "run")],
            "--data.source": ["train", "--size", "tiny", "--max-steps", "1", "--data.tokenizer=bytes",
                              f"--data.source={long}.txt", "--out", str(tmp_path / "out")],
            "run": ["generate", str(long), "--prompt", "In"],
            "--prompt-file": ["generate", str(run), "--prompt-file", str(long)]}[where]
    name = "checkpoint" if where == "run" else where  # generate's positional argument
    line = assert_refused(argv, capsys, [f"{name}: File name too long: {long}"], tmp_path)
    assert line.count(str(long)) == 1, line


@pytest.mark.parametrize(("case", "needles"), [
    ("--model=1, then --placement", ["option --model.placement: model=1 is a value, not a section"]),
    ("model: 5 in the file, then --model.d_model", ["config file", "model=5 must be a section with fields"]),
    ("a sweep axis over the model section", ["--axis model: model is a section of fields", "not one value"]),
])
def test_a_value_where_a_section_goes_is_refused_not_replaced_by_defaults(tmp_path: Path, capsys, corpus: Path,
                                                                          cache_dir: Path, case: str,
                                                                          needles: list[str]) -> None:
    """A dotted override into a section given as a plain value replaced the value by the section's defaults
    before 2026-12-02: ``--model=1 --placement pre --size tiny`` trained the default 6-layer d=256 model, and
    ``sweep --axis model=1,2`` trained two identical ones and reported 'the largest model that trained'."""
    (tmp_path / "m5.yaml").write_text("model: 5\n")
    common = ["--max-steps", "1", "--data.tokenizer=bytes", f"--data.source={corpus}",
              f"--data.cache_dir={cache_dir}", "--device=cpu", "--out", str(tmp_path / "out")]
    argv = {"--model=1, then --placement": ["train", "--size", "tiny", "--model=1", "--placement", "pre", *common],
            "model: 5 in the file, then --model.d_model": ["train", str(tmp_path / "m5.yaml"), "--model.d_model=64",
                                                           *common],
            "a sweep axis over the model section": ["sweep", "--placements", "pre", "--axis", "model=1,2",
                                                    "--size", "tiny", *common]}[case]
    assert_refused(argv, capsys, needles, tmp_path)
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize("file_text", ["model: {placement: pre}\n", "seq_len: 512\nmodel: {placement: pre}\n"])
def test_a_mistyped_option_beside_a_config_file_and_a_size_is_named_not_the_file(tmp_path: Path, capsys, corpus: Path,
                                                                                 file_text: str) -> None:
    """``train FILE --size tiny --seq_len=32 --checkpoint_interval=2`` said ``config file FILE: seq_len=256 exceeds
    model.max_seq_len=128``: the file (with the preset, but without the options) was checked to see whose fault
    the error was, failed on a seq_len the options set, and its error replaced the typo's."""
    (tmp_path / "c.yaml").write_text(file_text)
    argv = ["train", str(tmp_path / "c.yaml"), "--size", "tiny", "--seq_len=32", "--checkpoint_interval=2",
            "--max-steps", "1", "--data.tokenizer=bytes", f"--data.source={corpus}", "--out", str(tmp_path / "out")]
    line = assert_refused(argv, capsys, ["option --checkpoint_interval", "unknown field 'checkpoint_interval'",
                                         "ckpt_interval"], tmp_path)
    assert "config file" not in line and "seq_len" not in line.split("valid fields")[0]
    assert not (tmp_path / "out").exists()
