"""Deeply nested JSON (and YAML) at every entry point of the command line that reads one: one reader with a
depth limit (``hybridnorm.plain_data``) answers all of them the same way, one ``error:`` line naming the
file, exit 2, no RecursionError traceback, nothing changed. Generated: the depth (just past the limit up to
far past the interpreter's recursion limit), the bracket kinds, and where in the file the deep value sits."""

from __future__ import annotations

import json
import tempfile
from pathlib import Path

import pytest
from bad_input_helpers import PROPS, assert_refused, copy_tree, make_hf_and_run
from hypothesis import given
from hypothesis import strategies as st

from hybridnorm import plain_data
from hybridnorm.config_text import parse_text
from hybridnorm.errors import ConfigError

pytest.importorskip("transformers", reason="the hf extra (transformers) is not installed")


@pytest.fixture(scope="module")
def folders(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    return make_hf_and_run(tmp_path_factory.mktemp("nested"))


def _deep(kinds: list[str], depth: int) -> str:
    """A JSON value nested ``depth`` deep, cycling through the bracket ``kinds`` ("[" or "{")."""
    opens = [("[", "]") if kinds[i % len(kinds)] == "[" else ('{"k": ', "}") for i in range(depth)]
    return "".join(o for o, _ in opens) + "0" + "".join(c for _, c in reversed(opens))


deep_values = st.builds(_deep, st.lists(st.sampled_from(["[", "{"]), min_size=1, max_size=3),
                        st.integers(plain_data.MAX_DEPTH + 1, 3000))


def _hf_copy(hf: Path, root: Path) -> Path:
    return copy_tree(hf, root / "hf")


# entry point -> (files it writes into root given the deep value, argv, the file the error must name)
def _mc(root, deep, hf, run, corpus, cache):
    f = root / "mc.jsonl"
    f.write_text('{"context": "a", "endings": ["b", "c"], "label": 0}\n{"context": ' + deep + "}\n")
    return ["eval", str(run), "--mc", str(f)], f


def _text(root, deep, hf, run, corpus, cache):
    f = root / "docs.jsonl"
    f.write_text('{"text": "in the beginning"}\n{"text": "x", "meta": ' + deep + "}\n")
    return ["eval", str(run), "--text", str(f)], f


def _import_tokenizer(root, deep, hf, run, corpus, cache):
    h = _hf_copy(hf, root)
    (h / "tokenizer.json").write_text(deep)
    return ["import", str(h), "--out", str(root / "out")], h / "tokenizer.json"


def _generate_tokenizer(root, deep, hf, run, corpus, cache):
    h = _hf_copy(hf, root)
    (h / "tokenizer.json").write_text('{"model": ' + deep + "}")
    return ["generate", str(h), "--max-new-tokens", "1"], h / "tokenizer.json"


def _config_json(root, deep, hf, run, corpus, cache):
    h = _hf_copy(hf, root)
    cfg = json.loads((h / "config.json").read_text())
    (h / "config.json").write_text(json.dumps(cfg)[:-1] + ', "extra": ' + deep + "}")
    return ["generate", str(h), "--max-new-tokens", "1"], h / "config.json"


def _generation_config(root, deep, hf, run, corpus, cache):
    h = _hf_copy(hf, root)
    (h / "generation_config.json").write_text('{"a": ' + deep + "}")
    return ["import", str(h), "--out", str(root / "out")], h / "generation_config.json"


def _declared_eos(root, deep, hf, run, corpus, cache):
    """A tokenizer with none of the end-of-text aliases reads the eos_token its tokenizer_config.json declares."""
    h = _hf_copy(hf, root)
    tok = h / "tokenizer.json"
    tok.write_text(tok.read_text(encoding="utf-8").replace("<|endoftext|>", "<｜end▁of▁sentence｜>"),
                   encoding="utf-8")
    (h / "tokenizer_config.json").write_text('{"eos_token": ' + deep + "}")
    return ["generate", str(h), "--max-new-tokens", "1"], h / "tokenizer_config.json"


def _shard_index(root, deep, hf, run, corpus, cache):
    h = _hf_copy(hf, root)
    (h / "model.safetensors").rename(h / "model-00001-of-00001.safetensors")
    (h / "model.safetensors.index.json").write_text('{"weight_map": ' + deep + "}")
    return ["generate", str(h), "--max-new-tokens", "1"], h / "model.safetensors.index.json"


def _train_args(root, cache):
    return ["--size", "tiny", "--max-steps", "1", "--data.tokenizer=bytes", f"--data.cache_dir={cache}",
            "--device=cpu", "--out", str(root / "out")]


def _train_corpus(root, deep, hf, run, corpus, cache):
    f = root / "corpus.jsonl"
    f.write_text('{"text": "in the beginning"}\n' + deep + "\n")
    return ["train", *_train_args(root, cache), f"--data.source={f}"], f


def _train_tokenizer(root, deep, hf, run, corpus, cache):
    f = root / "tok.json"
    f.write_text(deep)
    return ["train", *_train_args(root, cache), f"--data.source={corpus}", f"--data.tokenizer={f}"], f


def _yaml_config(root, deep, hf, run, corpus, cache):
    f = root / "cfg.yaml"
    f.write_text("optim:\n  lr: 0.001\nmodel: " + deep + "\n")
    return ["train", str(f), *_train_args(root, cache), f"--data.source={corpus}"], f


def _json_config(root, deep, hf, run, corpus, cache):
    f = root / "cfg.json"
    f.write_text('{"optim": ' + deep + "}")
    return ["train", str(f), *_train_args(root, cache), f"--data.source={corpus}"], f


ENTRY_POINTS = {"eval --mc": _mc, "eval --text": _text, "import tokenizer.json": _import_tokenizer,
                "generate tokenizer.json": _generate_tokenizer, "config.json": _config_json,
                "generation_config.json": _generation_config, "tokenizer_config.json": _declared_eos,
                "shard index": _shard_index,
                "train corpus": _train_corpus, "train --data.tokenizer": _train_tokenizer,
                "YAML config": _yaml_config, "JSON config": _json_config}


@pytest.mark.parametrize("entry", sorted(ENTRY_POINTS))
@PROPS
@given(deep=deep_values)
def test_deep_json_at_every_entry_point_is_one_error_line_naming_the_file(folders, corpus, cache_dir, tmp_path,
                                                                          capsys, entry, deep) -> None:
    hf, run = folders
    root = Path(tempfile.mkdtemp(dir=tmp_path))
    argv, culprit = ENTRY_POINTS[entry](root, deep, hf, run, corpus, cache_dir)
    line = assert_refused(argv, capsys, [str(culprit)], root)
    assert f"nested deeper than {plain_data.MAX_DEPTH} levels" in line
    assert not (root / "out" / "config.yaml").exists()  # nothing was made of the bad input


@PROPS
@given(kinds=st.lists(st.sampled_from(["[", "{"]), min_size=1, max_size=3),
       depth=st.integers(1, plain_data.MAX_DEPTH))
def test_nesting_up_to_the_limit_reads_and_past_it_is_refused(kinds, depth) -> None:
    assert plain_data.loads(_deep(kinds, depth)) is not None
    with pytest.raises(ValueError, match="nested deeper than"):
        plain_data.loads(_deep(kinds, depth + plain_data.MAX_DEPTH))


def test_a_yaml_alias_cycle_is_refused_not_recursed_forever(tmp_path, capsys) -> None:
    f = tmp_path / "cycle.yaml"
    f.write_text("model: &a [*a]\n")
    assert_refused(["train", str(f)], capsys, [str(f), "nested deeper than"], tmp_path)


def _alias_bomb(levels: int, fan: int = 10) -> str:
    """A YAML list whose anchors each hold ``fan`` aliases of the one before: ``fan ** levels`` leaves,
    ``sum(fan ** i for i in range(levels + 1))`` values with the containers, from a few lines of text."""
    items = ["&a0 [" + ", ".join(['"x"'] * fan) + "]"]
    items += [f"&a{i} [" + ", ".join([f"*a{i - 1}"] * fan) + "]" for i in range(1, levels)]
    return "[" + ", ".join(items) + "]"


def _expanded(levels: int, fan: int = 10) -> int:
    """The hand count of :func:`_alias_bomb`'s values: the outer list, and anchor i's subtree for each i."""
    sub = [1 + fan]  # a0: the list and its fan leaves
    for _ in range(1, levels):
        sub.append(1 + fan * sub[-1])
    return 1 + sum(sub)


@pytest.mark.parametrize("where", ["optim:\n  lr: {bomb}\n", "model:\n  placement:\n    junk: {bomb}\n",
                                   "model:\n  d_model: {bomb}\n"])
def test_a_yaml_alias_bomb_is_refused_before_anything_walks_or_prints_it(tmp_path, capsys, where) -> None:
    """Nine levels of ten aliases: ~1.1e9 values from one line. Before the size rule, an error message's
    repr of it ran out of memory after ~50 s; now the reader counts distinct nodes and refuses it."""
    f = tmp_path / "bomb.yaml"
    f.write_text(where.format(bomb=_alias_bomb(9)))
    line = assert_refused(["train", str(f), "--out", str(tmp_path / "out")], capsys, [str(f)], tmp_path)
    assert f"expands to more than {plain_data.MAX_VALUES:,} values" in line
    with pytest.raises(ConfigError, match="expands to more than"):  # an override is read by the same reader
        parse_text(_alias_bomb(9), "yaml")


@pytest.mark.parametrize("levels", [2, 3, 4])
def test_the_size_rule_counts_every_alias_use_as_a_copy(levels) -> None:
    n = _expanded(levels)
    data = parse_text(_alias_bomb(levels), "yaml")
    plain_data.check_size(data, limit=n)  # exactly at the limit: read
    with pytest.raises(ValueError, match=f"more than {n - 1:,} values"):
        plain_data.check_size(data, limit=n - 1)


def test_a_big_value_under_the_limit_is_named_in_a_short_error_line(tmp_path, capsys) -> None:
    f = tmp_path / "big.yaml"
    f.write_text(f"optim:\n  lr: {_alias_bomb(4)}\n")  # 11,111 leaves: read, then refused as no number
    line = assert_refused(["train", str(f), "--out", str(tmp_path / "out")], capsys,
                          [str(f), "optim.lr=[", "must be a finite number"], tmp_path)
    assert len(line) < 2000
