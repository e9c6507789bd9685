"""Grid options as the commands read them. `hybridnorm compare`'s one init for all placements is the user's,
wherever the user gave it: `--model.init` on the command line or `model.init` in the config file (before
2026-12-02 the file's was dropped for megatron, silently), else megatron; `--init` overrides both. Checked on
the runs' own records, through the command. `--values` without `--knob` is refused (it was dropped), and a
knob that is no config field is named as the user typed it (`--knob nope`)."""

import json
from pathlib import Path

import pytest
from train_helpers import cli_in_process, read_metrics, tiny_overrides


@pytest.mark.parametrize(("given", "expected"), [
    ({"file": "normal"}, "normal"),
    ({"flag": "depth_scaled"}, "depth_scaled"),
    ({"file": "normal", "init_axis": "deepnorm"}, "deepnorm"),
    ({}, "megatron"),
])
def test_the_grid_runs_the_users_init_from_the_file_or_the_flag(tmp_path: Path, corpus: Path, cache_dir: Path,
                                                                 no_peak_measure: None, given: dict,
                                                                 expected: str) -> None:
    config = tmp_path / "c.yaml"
    config.write_text(f"model:\n  init: {given['file']}\n" if "file" in given else "{}\n")
    out = tmp_path / "cmp"
    args = ["compare", str(config), "--placements", "pre", "--seeds", "0", "--max-steps", "2",
            *tiny_overrides(corpus, cache_dir, tmp_path / "unused"), "--out", str(out)]
    args = [a for a in args if not a.startswith("--out_dir=")]
    args += [f"--model.init={given['flag']}"] if "flag" in given else []
    args += ["--init", given["init_axis"]] if "init_axis" in given else []
    cli_in_process(*args)
    (run,) = (out / "runs").iterdir()
    assert json.loads((run / "point.json").read_text())["point"]["init"] == expected
    assert read_metrics(run, "meta")[0]["init"] == expected  # what the run itself drew its weights with


def test_values_without_a_knob_is_refused_not_dropped(tmp_path: Path) -> None:
    r = cli_in_process("sweep", "--placements", "pre", "--values", "1,2", "--out", str(tmp_path / "s"), ok=False)
    assert r.returncode == 2 and r.stderr.strip().splitlines() == [
        "error: --values needs --knob KEY (the field the values are for), or give --axis KEY=v1,v2"]
    assert not (tmp_path / "s").exists()


@pytest.mark.parametrize(("option", "said", "valid"), [
    (["--knob", "nope", "--values", "1,2"], "--knob nope: train config: unknown field 'nope'", "max_steps"),
    (["--axis", "nope=1,2"], "--axis nope: train config: unknown field 'nope'", "max_steps"),
    (["--knob", "optim.lrr", "--values", "1,2"], "--knob optim.lrr: optim: unknown field 'lrr'", "warmup_steps"),
])
def test_a_knob_that_is_no_field_is_named_as_typed_with_the_valid_ones(tmp_path: Path, option: list[str], said: str,
                                                                       valid: str) -> None:
    """It was named as the override the knob becomes (`option --nope`), an option the user never typed."""
    r = cli_in_process("sweep", "--placements", "pre", *option, "--out", str(tmp_path / "s"), ok=False)
    (line,) = r.stderr.strip().splitlines()
    assert r.returncode == 2 and line.startswith(f"error: {said}; valid fields: ") and valid in line, line
    assert "or a short name: lr (optim.lr)" in line and "option --" not in line
    assert not (tmp_path / "s").exists()


@pytest.mark.parametrize(("option", "said"), [
    (["--axis", "model=1,2"], "--axis model: model is a section of fields (vocab_size, d_model,"),
    (["--knob", "optim", "--values", "1,2"], "--knob optim: optim is a section of fields (lr, betas,"),
])
def test_a_knob_naming_a_config_section_is_refused_as_typed(tmp_path: Path, option: list[str], said: str) -> None:
    """A section is no value to sweep: the error named `option --model.placement` (the override the grid adds to
    the point), an option the user never typed, and did not say a field was wanted."""
    r = cli_in_process("sweep", "--placements", "pre", *option, "--out", str(tmp_path / "s"), ok=False)
    (line,) = r.stderr.strip().splitlines()
    assert r.returncode == 2 and line.startswith(f"error: {said}") and "not one value; name one of its fields" in line
    assert "option --" not in line, line
    assert not (tmp_path / "s").exists()


def test_the_placement_field_as_an_axis_points_to_placements_not_to_its_spec_fields(tmp_path: Path) -> None:
    """``model.placement`` takes a name (or a spec): the section refusal named it "a section of fields (name,
    block, ...)" and sent the user to ``model.placement.name``, where the grid's own rule says --placements."""
    for option, typed in ((["--axis", "model.placement=pre,post"], "--axis model.placement"),
                          (["--knob", "placement", "--values", "pre,post"], "--knob placement"),  # was "--axis ..."
                          (["--knob", "seed", "--values", "1,2"], "--knob seed")):
        r = cli_in_process("sweep", "--placements", "pre", *option, "--out", str(tmp_path / "s"), ok=False)
        assert r.returncode == 2 and r.stderr.strip().splitlines() == [
            f"error: {typed}: use --placements / --init / --seeds / --out instead"], r.stderr
        assert not (tmp_path / "s").exists()
