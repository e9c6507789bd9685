"""``hybridnorm generate DIR`` takes its sampling defaults from the folder's ``generation_config.json`` as
transformers' ``generate()`` does (``hybridnorm.nn.sampling_defaults``). Oracle: transformers itself,
``AutoModelForCausalLM.from_pretrained(DIR).generate(ids, max_new_tokens=N)`` with no sampling argument (so
it resolves the file against its own defaults) after ``torch.manual_seed(s)``, against the command with no
sampling option and ``--seed s``: the same text. Then options over the file, a file without ``do_sample``
(the command's own defaults, the file's fields where set), and bad or unapplied fields."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch

pytest.importorskip("transformers", reason="the hf extra (transformers) is not installed")

from train_helpers import cli_in_process  # tests/

import hybridnorm.hf  # noqa: F401  (registers the Auto classes)

PROMPT, NEW, SEEDS = "And God said", 30, (3, 11)


def with_generation_config(exported: Path, tmp_path: Path, **fields) -> Path:
    """A copy of the export whose generation_config.json also sets ``fields`` (eos and bos kept)."""
    out = tmp_path / "hf"
    shutil.copytree(exported, out)
    file = out / "generation_config.json"
    file.write_text(json.dumps({**json.loads(file.read_text()), **fields}))
    return out


def transformers_text(folder: Path, seed: int, **kw) -> str:
    """What transformers' generate() of the folder prints after ``torch.manual_seed(seed)``, decoded as
    ``hybridnorm generate`` prints it (everything after the start token)."""
    import transformers

    tok = transformers.AutoTokenizer.from_pretrained(folder)
    model = transformers.AutoModelForCausalLM.from_pretrained(folder).eval()
    torch.manual_seed(seed)
    with torch.no_grad():
        out = model.generate(tok(PROMPT, return_tensors="pt").input_ids, max_new_tokens=NEW, **kw)[0].tolist()
    return tok.decode(out[1:]) + "\n"  # print's newline


def command(folder: Path, seed: int, *options: str, ok: bool = True):
    return cli_in_process("generate", str(folder), "--prompt", PROMPT, f"--max-new-tokens={NEW}", f"--seed={seed}",
                          *options, ok=ok)


FILES = [
    dict(do_sample=True, temperature=0.7, top_k=20, top_p=0.9, repetition_penalty=1.2),
    dict(do_sample=True),                                   # transformers' defaults: T = 1, top-k 50
    dict(do_sample=True, temperature=1.3, top_k=0, min_p=0.1),
    dict(do_sample=True, temperature=0.9, top_k=None),      # null: unset, so transformers' 50
    dict(do_sample=False, repetition_penalty=1.4),          # greedy with the penalty
    dict(do_sample=False, temperature=0.6, top_p=0.5),      # greedy: the sampling fields unused
]


@pytest.mark.parametrize("fields", FILES, ids=lambda f: ",".join(f"{k}={v}" for k, v in f.items()))
def test_the_folders_defaults_are_followed_as_transformers_follows_them(exported: Path, tmp_path: Path,
                                                                        fields: dict) -> None:
    folder = with_generation_config(exported, tmp_path, **fields)
    changed = False
    for seed in SEEDS:
        got = command(folder, seed)
        assert got.stdout == transformers_text(folder, seed), (seed, fields)
        assert f"decoding defaults from {folder / 'generation_config.json'}: do_sample=" in got.stderr
        changed |= got.stdout != command(exported, seed).stdout  # the command's own defaults
    assert changed, "the file never changed the text: the comparison would not see it ignored"


def test_options_override_the_file_field_by_field(exported: Path, tmp_path: Path) -> None:
    folder = with_generation_config(exported, tmp_path, do_sample=True, temperature=0.7, top_p=0.9)
    got = {seed: command(folder, seed, "--temperature=1.2", "--top-k=0").stdout for seed in (5, 6, 7)}
    for seed, text in got.items():
        assert text == transformers_text(folder, seed, temperature=1.2, top_k=0)  # top_p 0.9 still the file's
    # top_p 1.0 draws other text from some seed (not every one: a draw can fall inside the top 0.9 either way;
    # seed 5 alone did, on torch 2.11's weights of the same run)
    assert any(text != transformers_text(folder, seed, temperature=1.2, top_k=0, top_p=1.0)
               for seed, text in got.items())
    # a temperature given samples even where the file says greedy (the command has no --do-sample)
    greedy = with_generation_config(exported, tmp_path / "g", do_sample=False)
    assert command(greedy, 5, "--temperature=0.9").stdout == transformers_text(greedy, 5, do_sample=True,
                                                                             temperature=0.9)
    moot = command(greedy, 5, "--top-p=0.5")
    assert moot.stdout == transformers_text(greedy, 5)
    assert "greedy, so --top-p has no effect without --temperature T > 0" in moot.stderr


def test_without_do_sample_the_commands_defaults_stand_with_the_files_fields(trained_run: Path, exported: Path,
                                                                             tmp_path: Path) -> None:
    for seed in SEEDS:  # hybridnorm's exports write no do_sample: temperature 0.8, top-k 50, as for the run
        plain = command(exported, seed)
        assert plain.stdout == transformers_text(exported, seed, do_sample=True, temperature=0.8, top_k=50)
        assert plain.stdout == command(trained_run, seed).stdout
        assert "decoding defaults" not in plain.stderr
    folder = with_generation_config(exported, tmp_path, temperature=0.5, top_p=0.8)
    got = command(folder, 3)
    assert got.stdout == transformers_text(folder, 3, do_sample=True, temperature=0.5, top_k=50, top_p=0.8)
    assert "temperature=0.5, top_p=0.8 (options override them)" in got.stderr


@pytest.mark.parametrize(("fields", "says"), [
    (dict(do_sample=True, top_p=1.5), "top_p=1.5 must be a number in (0, 1] (1: no limit); --top-p overrides it"),
    (dict(do_sample=True, temperature=-1), "temperature=-1 must be a finite number >= 0"),
    (dict(do_sample=True, top_k=2.5), "top_k=2.5 must be an integer >= 0"),
    (dict(repetition_penalty="1.2"), "repetition_penalty='1.2' must be a finite number > 0"),
    (dict(do_sample="yes"), "do_sample='yes' must be true or false"),
])
def test_a_bad_field_is_one_error_naming_the_file(exported: Path, tmp_path: Path, fields: dict, says: str) -> None:
    folder = with_generation_config(exported, tmp_path, **fields)
    bad = command(folder, 0, ok=False)
    assert bad.stdout == ""
    lines = bad.stderr.strip().splitlines()
    assert lines == [f"error: {folder / 'generation_config.json'}: {says}" + lines[0].split(says, 1)[1]], lines
    if "top_p" in fields:  # the option that overrides a bad field is the way out
        assert command(folder, 0, "--top-p=0.9").stdout


def test_fields_the_command_does_not_apply_are_named(exported: Path, tmp_path: Path) -> None:
    folder = with_generation_config(exported, tmp_path, do_sample=True, typical_p=0.9, num_beams=4,
                                    no_repeat_ngram_size=0)  # 0: off, not named
    got = command(folder, 1)
    assert got.stdout
    assert got.stderr.strip().endswith("not applied by this command: typical_p=0.9, num_beams=4")


def test_import_fine_tuning_and_export_keep_the_folders_defaults(exported: Path, tmp_path: Path, corpus: Path,
                                                                 no_peak_measure: None) -> None:
    """`import` keeps the fields in the run (generation_defaults.json, in every checkpoint's manifest), the
    README's fine-tune command carries them on, and `export` writes them back into generation_config.json:
    the exported folder then decodes, under transformers and the command alike, as the folder did."""
    from eos_helpers import fine_tune  # tests/hf/

    from hybridnorm.nn.sampling_defaults import FILE

    fields = dict(do_sample=True, temperature=0.7, top_p=0.9, typical_p=0.95)
    folder = with_generation_config(exported, tmp_path / "instruct", **fields)
    run = tmp_path / "run"
    cli_in_process("import", str(folder), "--out", str(run))
    assert json.loads((run / FILE).read_text()) == fields
    imported = command(run, 4)
    assert imported.stdout == command(folder, 4).stdout
    assert f"decoding defaults from {run / 'checkpoints' / 'step_000000' / FILE}: do_sample=true" in imported.stderr
    fine_tune(run, corpus, tmp_path / "cache", "--max_steps=2", "--ckpt_interval=1")
    for step in (1, 2):  # the first resumed checkpoint and the one after it (carried on, not re-imported)
        assert FILE in json.loads((run / "checkpoints" / f"step_{step:06d}" / "manifest.json").read_text())
    shutil.copytree(run / "checkpoints" / "step_000002", tmp_path / "alone")
    out = tmp_path / "exported"
    cli_in_process("export", str(tmp_path / "alone"), "--to", "hf", str(out))
    written = json.loads((out / "generation_config.json").read_text())
    assert {k: written.get(k) for k in fields} == fields
    for seed in SEEDS:  # typical_p: transformers applies it, the command does not (it says so)
        assert command(out, seed).stdout == transformers_text(out, seed, typical_p=1.0)
    # a folder that chooses nothing: no file in the run, nothing more in the export's generation_config.json
    cli_in_process("import", str(exported), "--out", str(tmp_path / "plain"))
    assert not (tmp_path / "plain" / FILE).exists()
    cli_in_process("export", str(tmp_path / "plain"), "--to", "hf", str(tmp_path / "plain-out"))
    assert (json.loads((tmp_path / "plain-out" / "generation_config.json").read_text()).keys()
            == json.loads((exported / "generation_config.json").read_text()).keys())


@pytest.mark.parametrize(("content", "says"), [
    (b"[1, 2]", "expected a JSON object, got list"),
    (b'{"do_sample": tru', "not valid JSON"),
    (b"{}" + b" " * (16 << 20), "bytes; a model's JSON file is at most 16,777,216"),
])
def test_a_bad_generation_config_file_is_one_error_naming_it(exported: Path, tmp_path: Path, content: bytes,
                                                             says: str) -> None:
    folder = with_generation_config(exported, tmp_path)
    (folder / "generation_config.json").write_bytes(content)
    bad = command(folder, 0, ok=False)
    lines = bad.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith(f"error: {folder / 'generation_config.json'}") and says in lines[0]


@pytest.mark.parametrize("fields", [dict(temperature=0.5, top_p=0.8), dict(do_sample=False, temperature=0.6,
                                                                        repetition_penalty=1.3)],
                         ids=["sampling-fields-without-do_sample", "greedy-with-a-temperature"])
def test_a_card_transformers_would_not_save_still_round_trips(exported: Path, tmp_path: Path, fields: dict) -> None:
    """Sampling fields without do_sample=true: transformers loads such a file (with a warning) but refuses to
    save one (`GenerationConfig is invalid`); `export` of the imported run writes the fields as the folder had
    them, and the export decodes as the folder does, under the command and under transformers."""
    folder = with_generation_config(exported, tmp_path / "card", **fields)
    run, out = tmp_path / "run", tmp_path / "exported"
    cli_in_process("import", str(folder), "--out", str(run))
    cli_in_process("export", str(run), "--to", "hf", str(out))
    written = json.loads((out / "generation_config.json").read_text())
    assert {k: written.get(k) for k in fields} == fields
    for seed in SEEDS:
        assert command(out, seed).stdout == command(run, seed).stdout == command(folder, seed).stdout
        assert transformers_text(out, seed) == transformers_text(folder, seed)
