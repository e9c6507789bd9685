"""Generated bad input for the one config mechanism: random values in every config field, random section
shapes, random top-level documents, random YAML files and random command lines. The promise checked:
either the config is valid (and every field then has its declared type), or ONE ConfigError / ``error:``
line names the culprit, exit 2, no traceback, and nothing on disk is touched."""

from __future__ import annotations

import dataclasses
import math
import typing
from pathlib import Path

import pytest
import yaml
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from hybridnorm import cli
from hybridnorm.config_base import Config, coerce
from hybridnorm.errors import ConfigError
from hybridnorm.train.config import TrainConfig

FUZZ = settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])


def _paths(cls: type, prefix: str = "") -> list[str]:
    """Every dotted field path of a config class (sections recursed into)."""
    out = []
    hints = typing.get_type_hints(cls)
    for f in dataclasses.fields(cls):
        tp = hints[f.name]
        section = next((a for a in (tp, *typing.get_args(tp)) if isinstance(a, type) and issubclass(a, Config)),
                       None)
        out.append(prefix + f.name)
        if section is not None:
            out += _paths(section, f"{prefix}{f.name}.")
    return out


PATHS = _paths(TrainConfig)
SECTIONS = {"model", "data", "optim", "diagnostics", "model.moe"}

scalars = st.one_of(st.none(), st.booleans(), st.integers(-10**6, 10**6), st.floats(allow_nan=True),
                    st.text(max_size=12), st.sampled_from(["", "1e-3", "inf", "nan", "-1", "0", "bf16", "pre"]))
values = st.recursive(scalars, lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=6),
                                                                                             inner, max_size=3),
                      max_leaves=6)


def _set(d: dict, path: str, value: object) -> dict:
    node = d
    *parents, leaf = path.split(".")
    for p in parents:
        node = node.setdefault(p, {}) if isinstance(node.get(p, {}), dict) else node
    node[leaf] = value
    return d


def _well_typed(cfg: Config) -> None:
    """Every field of a built config already has its declared type: re-checking changes nothing."""
    hints = typing.get_type_hints(type(cfg))
    for f in dataclasses.fields(cfg):
        value = getattr(cfg, f.name)
        assert coerce(f.name, value, hints[f.name]) == value or (isinstance(value, float) and math.isnan(value))
        if isinstance(value, Config):
            _well_typed(value)


def _leaf_named(message: str, path: str) -> bool:
    return any(part in message for part in path.split(".")) and "Traceback" not in message


@FUZZ
@given(path=st.sampled_from(PATHS), value=values)
def test_any_value_in_any_field_is_accepted_typed_or_refused_by_name(path, value):
    data = _set({}, path, value)
    try:
        cfg = TrainConfig.from_dict(data)
    except ConfigError as e:
        assert _leaf_named(str(e), path), (path, value, str(e))
        return
    _well_typed(cfg)
    if isinstance(value, float) and not math.isfinite(value):
        raise AssertionError(f"{path}={value} accepted: every float field must be finite")


@FUZZ
@given(doc=values)
def test_any_document_at_the_top_is_a_config_or_one_config_error(doc):
    try:
        TrainConfig.from_dict(doc)
    except ConfigError:
        return
    assert doc == {} or isinstance(doc, dict)


@FUZZ
@given(section=st.sampled_from(sorted(SECTIONS)), value=scalars | st.lists(scalars, max_size=2))
def test_a_scalar_or_list_where_a_section_belongs_names_the_section(section, value):
    if section == "model.moe" and value is None:
        return  # null is a valid moe: a dense model
    with pytest.raises(ConfigError, match=section.split(".")[-1]):
        TrainConfig.from_dict(_set({}, section, value))


def _one_error_line(err: str) -> str:
    lines = err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: "), err
    assert "Traceback" not in err
    return lines[0]


class _Reached(Exception):
    """Raised by the stand-in trainer: the command line held a valid config."""


@pytest.fixture
def sandbox(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    import hybridnorm.train.trainer as trainer

    def reached(*a, **k):
        raise _Reached

    monkeypatch.setattr(trainer, "train", reached)
    monkeypatch.chdir(tmp_path)
    keep = tmp_path / "runs" / "default" / "keep.txt"  # a run folder's file that nothing may delete
    keep.parent.mkdir(parents=True)
    keep.write_text("x")
    (keep.parent / "metrics.jsonl").write_text("")  # a run folder: the output-folder rule lets train in
    return keep


field_words = st.sampled_from([p.replace("_", "-") if i % 2 else p for i, p in enumerate(PATHS)])
typo_words = st.from_regex(r"zz[a-z_]{0,8}(\.[a-z_]{1,8})?", fullmatch=True)
value_words = st.one_of(st.text(max_size=10).filter(lambda t: not t.startswith("-") and "\x00" not in t),
                        st.sampled_from(["1e-3", "inf", "nan", "-1", "[1, 2]", "{a: 1}", "!!python/object:os.system",
                                         "null", "", "'", "[", "0"]))


@FUZZ
@given(key=field_words | typo_words, value=value_words, spaced=st.booleans())
def test_any_override_on_the_command_line_is_one_error_line_naming_it(sandbox, capsys, key, value, spaced):
    argv = ["train", f"--{key}", value] if spaced and value else ["train", f"--{key}={value}"]
    capsys.readouterr()
    try:
        code = cli.main(argv)
    except _Reached:
        return  # a valid config: it would train
    assert code == 2
    line = _one_error_line(capsys.readouterr().err)
    leaf = key.replace("-", "_").split(".")
    assert any(part in line.replace("-", "_") for part in leaf), (argv, line)
    assert sandbox.is_file()


@FUZZ
@given(doc=values)
def test_any_yaml_file_is_a_config_or_one_error_line_naming_the_file(sandbox, capsys, doc):
    path = sandbox.parent.parent.parent / "cfg.yaml"
    path.write_text(yaml.safe_dump(doc), encoding="utf-8")
    capsys.readouterr()
    try:
        code = cli.main(["train", str(path)])
    except _Reached:
        return
    assert code == 2
    line = _one_error_line(capsys.readouterr().err)
    assert "cfg.yaml" in line, line
    assert sandbox.is_file()


@pytest.mark.parametrize("text", ["!!python/object/apply:os.system ['touch pwned']", "a: [1, 2", "\x00\x01",
                                  "- 1\n- 2", "model: !!binary aGk="])
def test_hostile_or_broken_yaml_files(sandbox, capsys, text):
    path = sandbox.parent.parent.parent / "bad.yaml"
    path.write_text(text, encoding="utf-8")
    assert cli.main(["train", str(path)]) == 2
    assert "bad.yaml" in _one_error_line(capsys.readouterr().err)
    assert not (sandbox.parent.parent.parent / "pwned").exists()


def test_a_spaced_override_is_read_as_the_fields_value(sandbox):
    seen = {}
    import hybridnorm.train.trainer as trainer

    def record(cfg, **k):
        seen["cfg"] = cfg
        raise _Reached

    trainer.train = record  # restored by the sandbox's monkeypatch
    with pytest.raises(_Reached):
        cli.main(["train", "--optim.lr", "1e-3", "--batch-size", "3", "--max-steps", "7"])
    cfg = seen["cfg"]
    assert (cfg.optim.lr, cfg.batch_size, cfg.max_steps) == (1e-3, 3, 7)
