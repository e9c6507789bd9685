"""Malformed checkpoint files, generated rather than listed: whatever a manifest, ``state.json``, the RNG or
the optimizer file holds, checking or loading the checkpoint either succeeds (the bytes happen to be valid)
or raises ConfigError naming that exact file, on one line — never another exception type — and changes
nothing on disk."""

from __future__ import annotations

import functools
import json
import re
import shutil
import tempfile
from pathlib import Path

import pytest
import torch
from checkpoint_helpers import model_and_optimizer, rewrite, snapshot, tiny_model, write_checkpoint
from fuzz_helpers import SETTINGS, json_values
from hypothesis import given
from hypothesis import strategies as st
from safetensors.torch import save

from hybridnorm.errors import ConfigError
from hybridnorm.train.checkpoint import check_checkpoint, load_checkpoint, load_weights
from hybridnorm.train.optim import OptimConfig, build_optimizer


@pytest.fixture(scope="module")
def base(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """One good checkpoint (AdamW state after a step); each example works on a copy of it."""
    return write_checkpoint(tmp_path_factory.mktemp("base"), 3)


def _paths(value: object, prefix: tuple = ()) -> list[tuple]:
    """Every path (keys / indices) to a node of a JSON value, the root excluded."""
    out = []
    items = value.items() if isinstance(value, dict) else enumerate(value) if isinstance(value, list) else ()
    for key, child in items:
        out.append((*prefix, key))
        out += _paths(child, (*prefix, key))
    return out


def _mutate(body: object, path: tuple, delete: bool, new: object) -> None:
    parent = body
    for key in path[:-1]:
        parent = parent[key]
    if delete and isinstance(parent, dict):
        del parent[path[-1]]
    else:
        parent[path[-1]] = new


@functools.cache
def _models() -> tuple[torch.nn.Module, torch.nn.Module]:
    """The models the checkpoints load into, built once: each load overwrites every weight it reads, or is
    refused, and what the model held before decides neither."""
    return model_and_optimizer(steps=0, seed=7)[0], tiny_model()


def _refused_or_loaded(ckpt: Path, culprit: str) -> None:
    """Check and load ``ckpt`` three ways; each must succeed or raise ConfigError naming ``ckpt/culprit``."""
    before = snapshot(ckpt)
    model, plain = _models()
    calls = (lambda: check_checkpoint(ckpt), lambda: load_weights(ckpt, plain),
             lambda: load_checkpoint(ckpt, model, build_optimizer(model, OptimConfig())))
    for call in calls:
        try:
            call()
        except ConfigError as e:
            assert str(ckpt / culprit) in str(e), str(e)
            assert "\n" not in str(e)
    assert snapshot(ckpt) == before  # nothing deleted, moved or rewritten


def _copy(base: Path, tmp: str) -> Path:
    return Path(shutil.copytree(base, Path(tmp) / base.name))


def _rewritten_is_refused(base: Path, name: str, raw: bytes, fix: bool, checked: bool = True) -> None:
    """A copy of ``base`` with ``name`` rewritten to ``raw`` (the manifest's hash of it fixed or not): the
    check refuses it naming that file (with ``checked``), and every reader loads it or refuses it naming that
    file, changing nothing on disk (:func:`_refused_or_loaded`)."""
    with tempfile.TemporaryDirectory() as tmp:
        ckpt = _copy(base, tmp)
        rewrite(ckpt, name, raw, fix_manifest=fix)
        if checked:
            with pytest.raises(ConfigError, match=re.escape(name)):
                check_checkpoint(ckpt)
        _refused_or_loaded(ckpt, name)


@SETTINGS
@given(data=st.data())
def test_state_json_with_a_node_replaced_or_deleted(base, data):
    body = json.loads((base / "state.json").read_text(encoding="utf-8"))
    path = data.draw(st.sampled_from(_paths(body)))
    _mutate(body, path, data.draw(st.booleans()), data.draw(json_values))
    fix = data.draw(st.booleans())
    _rewritten_is_refused(base, "state.json", json.dumps(body).encode(), fix, checked=False)


@pytest.mark.parametrize("value", [None, [], {}, "x", 0])
def test_every_state_json_node_set_to_a_plain_value(base, tmp_path, value):
    """Each node in turn (not a random sample of them), set to each of a few plain values of other types."""
    body = json.loads((base / "state.json").read_text(encoding="utf-8"))
    for i, path in enumerate(_paths(body)):
        mutated = json.loads(json.dumps(body))
        _mutate(mutated, path, False, value)
        ckpt = _copy(base, str(tmp_path / str(i)))
        rewrite(ckpt, "state.json", json.dumps(mutated).encode())
        _refused_or_loaded(ckpt, "state.json")
        shutil.rmtree(ckpt)


@pytest.mark.parametrize("value", [None, [], {}, "x", -1, True, 1.5])
def test_every_manifest_node_set_to_a_plain_value_or_deleted(base, tmp_path, value):
    manifest = json.loads((base / "manifest.json").read_text(encoding="utf-8"))
    for i, path in enumerate(_paths(manifest)):
        for delete in (False, True):
            mutated = json.loads(json.dumps(manifest))
            _mutate(mutated, path, delete, value)
            ckpt = _copy(base, str(tmp_path / f"{i}{delete}"))
            (ckpt / "manifest.json").write_text(json.dumps(mutated), encoding="utf-8")
            with pytest.raises(ConfigError, match=r"manifest\.json"):
                check_checkpoint(ckpt)
            _refused_or_loaded(ckpt, "manifest.json")
            shutil.rmtree(ckpt)


@SETTINGS
@given(value=json_values, fix=st.booleans())
def test_state_json_replaced_by_any_json_value(base, value, fix):
    _rewritten_is_refused(base, "state.json", json.dumps(value).encode(), fix)


@SETTINGS
@given(data=st.data())
def test_state_json_garbage_or_truncated_bytes(base, data):
    text = (base / "state.json").read_bytes()
    raw = data.draw(st.binary(max_size=300) | st.integers(0, len(text) - 1).map(lambda n: text[:n])
                    | st.just(b"[" * 100_000))  # nesting deeper than the JSON parser's recursion limit
    _rewritten_is_refused(base, "state.json", raw, data.draw(st.booleans()))


@SETTINGS
@given(data=st.data())
def test_manifest_malformed(base, data):
    manifest = json.loads((base / "manifest.json").read_text(encoding="utf-8"))
    kind = data.draw(st.sampled_from(["whole", "node", "garbage"]))
    if kind == "whole":  # a list, a number, a string, an object of anything ...
        raw = json.dumps(data.draw(json_values)).encode()
    elif kind == "node":  # an entry or one of its fields of the wrong type, or missing
        _mutate(manifest, data.draw(st.sampled_from(_paths(manifest))), data.draw(st.booleans()),
                data.draw(json_values))
        raw = json.dumps(manifest).encode()
    else:
        raw = data.draw(st.binary(max_size=300))
    with tempfile.TemporaryDirectory() as tmp:
        ckpt = _copy(base, tmp)
        (ckpt / "manifest.json").write_bytes(raw)
        _refused_or_loaded(ckpt, "manifest.json")


_DTYPES = [torch.uint8, torch.float32, torch.int64]
tensors = st.tuples(st.sampled_from(_DTYPES), st.lists(st.integers(0, 6), max_size=2)).map(
    lambda t: torch.zeros(t[1], dtype=t[0]))


@SETTINGS
@given(content=st.dictionaries(st.sampled_from(["torch", "cuda.0", "cuda.x", "state", "rng"])
                               | st.text(min_size=1, max_size=5), tensors, max_size=3), fix=st.booleans())
def test_rng_file_without_its_tensor_or_with_others(base, content, fix):
    _rewritten_is_refused(base, "rng.safetensors", save(content), fix)


def _opt_tensors(base: Path) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    return load_file(str(base / "optimizer.safetensors"))


@SETTINGS
@given(data=st.data())
def test_optimizer_file_cut_down_reshaped_or_renamed(base, data):
    tensors_ = _opt_tensors(base)
    keys = sorted(tensors_)
    kind = data.draw(st.sampled_from(["drop", "reshape", "rename", "extra"]))
    if kind == "drop":  # down to none at all: an emptied file would otherwise reset AdamW silently
        for k in data.draw(st.lists(st.sampled_from(keys), min_size=1, unique=True)):
            del tensors_[k]
    elif kind == "reshape":
        k = data.draw(st.sampled_from(keys))
        tensors_[k] = torch.zeros(tensors_[k].numel() + 1)
    elif kind == "rename":
        k = data.draw(st.sampled_from(keys))
        tensors_[data.draw(st.text(min_size=1, max_size=12).filter(lambda s: s not in tensors_))] = tensors_.pop(k)
    else:
        tensors_[data.draw(st.sampled_from(["state.0.momentum", "state.999.exp_avg", "junk"]))] = torch.zeros(1)
    _rewritten_is_refused(base, "optimizer.safetensors", save(tensors_), data.draw(st.booleans()))


@pytest.mark.parametrize("name", ["optimizer.safetensors", "model.safetensors", "rng.safetensors"])
@pytest.mark.parametrize("how", ["empty", "truncated", "header_only"])
def test_safetensors_file_empty_or_truncated(base, tmp_path, name, how):
    ckpt = _copy(base, str(tmp_path))
    raw = (ckpt / name).read_bytes()
    new = {"empty": b"", "truncated": raw[: len(raw) // 2], "header_only": raw[:64]}[how]
    for fix in (False, True):
        rewrite(ckpt, name, new, fix_manifest=fix)
        with pytest.raises(ConfigError, match=name.replace(".", r"\.")):
            check_checkpoint(ckpt)
        _refused_or_loaded(ckpt, name)


def test_empty_optimizer_file_is_refused_even_with_a_matching_manifest(base, tmp_path):
    """The silent AdamW reset: a valid safetensors file holding no tensors, vouched for by the manifest."""
    ckpt = _copy(base, str(tmp_path))
    rewrite(ckpt, "optimizer.safetensors", save({}))
    with pytest.raises(ConfigError, match=r"optimizer\.safetensors.*0 of \d+ tensors"):
        check_checkpoint(ckpt)


def test_a_fresh_optimizer_with_no_state_is_fine(tmp_path):
    """Step 0 of an imported model: AdamW has no state yet, and the checkpoint says so."""
    ckpt = write_checkpoint(tmp_path, 0, model_opt=model_and_optimizer(steps=0))
    check_checkpoint(ckpt)
    model, _ = model_and_optimizer(steps=0, seed=3)
    load_checkpoint(ckpt, model, build_optimizer(model, OptimConfig()))


@pytest.mark.parametrize("name", ["state.json", "rng.safetensors", "optimizer.safetensors", "manifest.json"])
def test_explicit_checkpoint_with_a_malformed_file_is_one_error_line(corpus, cache_dir, tmp_path, capsys, name,
                                                                      no_peak_measure):
    """generate / eval / export of a given checkpoint folder: exit 2, one error line naming the file; the run
    folder itself falls back to the newest good checkpoint and leaves the bad one where it is."""
    from train_helpers import tiny_overrides

    from hybridnorm import cli

    run = tmp_path / "run"
    assert cli.main(["train", *tiny_overrides(corpus, cache_dir, run), "--max_steps=4", "--ckpt_interval=2"]) == 0
    ckpt = run / "checkpoints" / "step_000004"
    if name == "manifest.json":
        (ckpt / name).write_text("[]", encoding="utf-8")
    elif name == "state.json":
        rewrite(ckpt, name, b'{"step": 4, "tokens": null}')
    else:
        rewrite(ckpt, name, save({"junk": torch.zeros(2)}))
    before = snapshot(run)
    capsys.readouterr()
    commands = [["generate", str(ckpt), "--max-new-tokens=2"], ["eval", str(ckpt), "--batches=1"]]
    try:
        import transformers  # noqa: F401

        commands.append(["export", str(ckpt), "--to", "hf", str(tmp_path / "hf")])
    except ImportError:
        pass
    for command in commands:
        rc = cli.main(command)
        err = capsys.readouterr().err
        lines = [line for line in err.splitlines() if line.startswith("error:")]
        assert rc == 2 and len(lines) == 1 and str(ckpt / name) in lines[0], (command, err)
        assert "Traceback" not in err
    with pytest.warns(UserWarning, match=f"skipping bad checkpoint: checkpoint file {ckpt / name}"):
        assert cli.main(["generate", str(run), "--max-new-tokens=2"]) == 0
    assert snapshot(run) == before


@pytest.mark.cuda
def test_a_cuda_generator_state_of_the_wrong_length_is_refused_before_anything_is_loaded(base, tmp_path):
    """torch refuses it only when applied, after the weights and optimizer state were loaded, with its own
    RuntimeError; now the throwaway-generator check the CPU state gets, naming the file."""
    from safetensors.torch import load_file

    ckpt = _copy(base, str(tmp_path))
    rng = load_file(str(ckpt / "rng.safetensors"))
    rewrite(ckpt, "rng.safetensors", save({**rng, "cuda.0": torch.zeros(3, dtype=torch.uint8)}))
    model, optimizer = model_and_optimizer(steps=0, seed=5)
    before = {k: v.clone() for k, v in model.state_dict().items()}
    with pytest.raises(ConfigError, match=r"rng\.safetensors holds an invalid RNG state"):
        load_checkpoint(ckpt, model, optimizer)
    assert all(torch.equal(before[k], v) for k, v in model.state_dict().items())
