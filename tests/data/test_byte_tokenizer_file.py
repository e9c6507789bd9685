"""A ``tokenizer.json`` marked ``"type": "hybridnorm-bytes"`` loads as the byte tokenizer only if everything else
it says is what the byte tokenizer writes: another vocab_size or eot_id, an unknown or missing key, or a value
of the wrong kind is one ConfigError naming the file and the field (it used to load as the 257-token byte
tokenizer whatever it said). The file every release has written loads unchanged."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest

from hybridnorm.data import ByteTokenizer, Corpus, get_tokenizer, load_tokenizer
from hybridnorm.errors import ConfigError

# what ByteTokenizer has written since the first release (2118d26), byte for byte
WRITTEN = '{"type": "hybridnorm-bytes", "version": 1, "vocab_size": 257, "eot_id": 256}'
FIELDS = json.loads(WRITTEN)


def write(tmp_path: Path, data: dict | str) -> Path:
    file = tmp_path / "tokenizer.json"
    file.write_text(data if isinstance(data, str) else json.dumps(data))
    return file


def test_the_file_the_byte_tokenizer_writes_loads_unchanged(tmp_path: Path) -> None:
    saved = ByteTokenizer().save(tmp_path / "run")
    assert saved.read_text() == WRITTEN  # the form, and with it the fingerprint tokenized data records
    for path in (saved, saved.parent, write(tmp_path, WRITTEN)):
        tok = load_tokenizer(path)
        assert isinstance(tok, ByteTokenizer) and tok.fingerprint == ByteTokenizer().fingerprint
    assert isinstance(load_tokenizer(saved, vocab_size=257), ByteTokenizer)
    # the same numbers in a lossless form, the keys in another order: the same file
    lossless = {"eot_id": 256.0, "vocab_size": 257, "version": 1.0, "type": "hybridnorm-bytes"}
    assert isinstance(load_tokenizer(write(tmp_path, lossless)), ByteTokenizer)


BAD = [
    ({"vocab_size": 300}, "vocab_size=300: the byte tokenizer's vocab_size is 257"),
    ({"vocab_size": 256}, "vocab_size=256: the byte tokenizer's vocab_size is 257"),
    ({"eot_id": 0}, "eot_id=0: the byte tokenizer's eot_id is 256"),
    ({"version": 2}, "version=2: this release reads version 1 only"),
    ({"vocab_size": "257"}, "vocab_size='257' must be an integer (the byte tokenizer writes vocab_size=257)"),
    ({"vocab_size": True}, "vocab_size=True must be an integer"),
    ({"eot_id": None}, "eot_id=None must be an integer"),
    ({"eot_id": [256]}, "eot_id=[256] must be an integer"),
    ({"version": 1.5}, "version=1.5 must be an integer"),
    ({"merges": []}, "unknown field 'merges'; the byte tokenizer writes only type, version, vocab_size, eot_id"),
    ({"model": {}, "added_tokens": []}, "unknown fields 'model', 'added_tokens'"),
]


@pytest.mark.parametrize(("change", "said"), BAD, ids=[f"{next(iter(c))}-{i}" for i, (c, _) in enumerate(BAD)])
def test_a_field_the_byte_tokenizer_does_not_write_is_one_error_naming_file_and_field(
        tmp_path: Path, change: dict, said: str) -> None:
    file = write(tmp_path, {**FIELDS, **change})
    with pytest.raises(ConfigError) as e:
        load_tokenizer(file)
    assert str(e.value).startswith(f"tokenizer file {file}, marked as the byte tokenizer's (\"type\": "
                                   f"\"hybridnorm-bytes\"): {said}"), str(e.value)
    assert "\n" not in str(e.value)


@pytest.mark.parametrize("missing", ["version", "vocab_size", "eot_id"])
def test_a_missing_field_is_named(tmp_path: Path, missing: str) -> None:
    file = write(tmp_path, {k: v for k, v in FIELDS.items() if k != missing})
    said = f"field {missing} is missing (the byte tokenizer writes {missing}={FIELDS[missing]})"
    with pytest.raises(ConfigError, match=re.escape(f"{file}, marked as the byte tokenizer's") + ".*"
                       + re.escape(said)):
        load_tokenizer(file)


def test_many_or_long_unknown_keys_are_named_by_the_first_few_cut_short(tmp_path: Path) -> None:
    file = write(tmp_path, {**FIELDS, **{f"k{i}": i for i in range(40)}, "x" * 10_000: 1})
    with pytest.raises(ConfigError, match=r"unknown fields 'k0', 'k1', 'k2', 'k3', 'k4' \(and 36 more\)") as e:
        load_tokenizer(file)
    assert len(str(e.value)) < 600
    file = write(tmp_path, {**FIELDS, "x" * 10_000: 1})
    with pytest.raises(ConfigError, match=r"unknown field 'xxx+ \.\.\.;") as e:
        load_tokenizer(file)
    assert len(str(e.value)) < 600


def test_a_data_tokenizer_path_is_checked_as_well(tmp_path: Path) -> None:
    """``--data.tokenizer=PATH`` (get_tokenizer) reads the file through the same loader."""
    file = write(tmp_path, {**FIELDS, "vocab_size": 512})
    corpus = Corpus("toy", ["a b c."] * 4, ["a b."] * 2)
    with pytest.raises(ConfigError, match=re.escape(f"tokenizer file {file}, marked") + ".*vocab_size=512"):
        get_tokenizer(corpus, str(file))
    assert isinstance(get_tokenizer(corpus, str(write(tmp_path, WRITTEN))), ByteTokenizer)
