"""A checkpoint records its format version, and what it holds beyond the weights is held to the weights' rules.

Each test trains a tiny run with the real trainer (``hybridnorm train`` through the CLI's own ``main``), edits
one of its checkpoints as a person (or a buggy tool) with write access would — the manifest re-signed, so only
the checks of the content can tell — and reads it back through the CLI:

- a checkpoint of a newer format is one error naming it, the version found and the version this code reads,
  and nothing is moved; one without a version (written before it was recorded) resumes as before;
- optimizer state of the wrong dtype or not finite is refused, as a weight of the wrong dtype or not finite is;
- an absurd counter (data-loader epoch, tokens) makes the checkpoint corrupt: set aside, never deleted, and the
  run resumes from the one before, as with a tensor shaped unlike its weight.
"""

from __future__ import annotations

import hashlib
import json
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file
from train_helpers import cli_in_process, read_metrics, tiny_overrides


@pytest.fixture(scope="module")
def trained(tmp_path_factory: pytest.TempPathFactory, corpus: Path, cache_dir: Path) -> Path:
    """A run of 2 steps with a checkpoint at each (step_000001, step_000002); each test edits a copy."""
    import hybridnorm.train.trainer as trainer

    out = tmp_path_factory.mktemp("format") / "run"
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(trainer, "measured_peak_flops", lambda *a, **k: 1e12)  # the MFU display's seconds-long matmul
        cli_in_process("train", *tiny_overrides(corpus, cache_dir, out), "--max_steps=2", "--ckpt_interval=1")
    return out


@pytest.fixture
def run(trained: Path, tmp_path: Path, no_peak_measure: None) -> Path:
    return Path(shutil.copytree(trained, tmp_path / "run"))


def _last(run: Path) -> Path:
    return run / "checkpoints" / "step_000002"


def _resign(ckpt: Path, name: str) -> None:
    """Record ``ckpt/name``'s new size and hash in the manifest: the edit passes the hash check."""
    manifest = json.loads((ckpt / "manifest.json").read_text(encoding="utf-8"))
    data = (ckpt / name).read_bytes()
    manifest[name] = {"bytes": len(data), "sha256": hashlib.sha256(data).hexdigest()}
    (ckpt / "manifest.json").write_text(json.dumps(manifest), encoding="utf-8")


def _edit_state(ckpt: Path, edit) -> dict:
    body = json.loads((ckpt / "state.json").read_text(encoding="utf-8"))
    edit(body)
    (ckpt / "state.json").write_text(json.dumps(body), encoding="utf-8")
    _resign(ckpt, "state.json")
    return body


def _edit_tensors(ckpt: Path, name: str, edit) -> None:
    tensors = load_file(str(ckpt / name))  # safetensors: nothing unpickled
    edit(tensors)
    save_file(tensors, str(ckpt / name))
    _resign(ckpt, name)


def _snapshot(root: Path) -> dict[str, bytes]:
    return {str(p.relative_to(root)): p.read_bytes() for p in sorted(root.rglob("*")) if p.is_file()}


def _resume(run: Path, *, ok: bool, max_steps: int = 3) -> str:
    """``train --resume`` of ``run``; its one error line when it fails (and then every checkpoint file unchanged)."""
    before = _snapshot(run / "checkpoints")
    r = cli_in_process("train", str(run / "config.yaml"), "--out", str(run), "--resume", f"--max_steps={max_steps}",
                       ok=ok)
    if ok:
        return ""
    return _refused(r.stderr, before, run)


def _refused(stderr: str, before: dict[str, bytes], run: Path) -> str:
    lines = [ln for ln in stderr.splitlines() if ln.strip() and not ln.startswith("warning:")]
    assert len(lines) == 1 and lines[0].startswith("error:"), stderr
    assert "Traceback" not in stderr
    assert _snapshot(run / "checkpoints") == before  # nothing moved, rewritten or deleted
    assert not (run / "checkpoints" / "corrupt").exists()
    return lines[0]


def test_a_checkpoint_records_its_format_and_one_written_before_the_version_resumes_as_before(run: Path) -> None:
    ckpt = _last(run)
    version = json.loads((ckpt / "state.json").read_text(encoding="utf-8")).get("format")
    assert isinstance(version, int) and version >= 2  # 1: every checkpoint written before it was recorded
    _edit_state(ckpt, lambda body: body.pop("format"))  # as today's code wrote it before the version existed
    _resume(run, ok=True)
    assert [r["step"] for r in read_metrics(run)][-1] == 3
    assert not (run / "checkpoints" / "corrupt").exists()
    assert json.loads((run / "checkpoints" / "step_000003" / "state.json").read_text())["format"] == version


def test_a_checkpoint_of_a_newer_format_is_refused_naming_both_versions_and_never_set_aside(run: Path) -> None:
    ckpt = _last(run)
    ours = json.loads((ckpt / "state.json").read_text(encoding="utf-8")).get("format", 1)
    _edit_state(ckpt, lambda body: body.update(format=ours + 1))
    line = _resume(run, ok=False)
    for needle in (str(ckpt), f"checkpoint format {ours + 1}", f"newer than this hybridnorm reads ({ours})",
                   "upgrade hybridnorm"):
        assert needle in line, (needle, line)
    # a newer layout may change every other file too: still the version is what is reported, not a corruption
    (ckpt / "model.safetensors").rename(ckpt / "weights-v3.bin")
    assert "upgrade hybridnorm" in _resume(run, ok=False)
    # the readers of a finished run say the same, and do not fall back to the older checkpoint
    before = _snapshot(run / "checkpoints")
    r = cli_in_process("generate", str(run), "--max-new-tokens", "2", ok=False)
    assert "upgrade hybridnorm" in _refused(r.stderr, before, run)


def _to_half(picked):
    """An edit that stores the tensors whose names ``picked`` accepts as float16 (the values rounded to it)."""
    def edit(tensors: dict[str, torch.Tensor]) -> None:
        for key in [k for k in tensors if picked(k)]:
            tensors[key] = tensors[key].half()
    return edit


@pytest.mark.parametrize("which", ["moments", "step count"])
def test_optimizer_state_stored_as_float16_is_refused_as_a_float16_weight_is(run: Path, which: str) -> None:
    control = Path(shutil.copytree(run, run.parent / "control"))  # the comparable weight problem
    _edit_tensors(_last(control), "model.safetensors", _to_half(lambda k: True))
    weights_line = _resume(control, ok=False)
    assert str(_last(control) / "model.safetensors") in weights_line and "stored as F16" in weights_line

    ckpt = _last(run)
    is_step = which == "step count"
    _edit_tensors(ckpt, "optimizer.safetensors", _to_half(lambda k: k.endswith(".step") == is_step))
    line = _resume(run, ok=False)  # the same outcome: one error naming the file and the tensor, nothing moved
    assert str(ckpt / "optimizer.safetensors") in line and "stored as F16" in line, line


@pytest.mark.parametrize(("key", "value"), [("exp_avg_sq", float("nan")), ("exp_avg", float("inf"))])
def test_a_nonfinite_optimizer_moment_is_refused_naming_file_and_tensor(run: Path, key: str, value: float) -> None:
    ckpt = _last(run)
    name = sorted(k for k in load_file(str(ckpt / "optimizer.safetensors")) if k.endswith(f".{key}"))[0]

    def poison(tensors: dict[str, torch.Tensor]) -> None:
        tensors[name].view(-1)[0] = value

    _edit_tensors(ckpt, "optimizer.safetensors", poison)
    line = _resume(run, ok=False)
    for needle in (str(ckpt / "optimizer.safetensors"), repr(name), "non-finite"):
        assert needle in line, (needle, line)


@pytest.mark.parametrize("count", [10**9, -1.0, 1.5])
def test_an_optimizer_step_count_beyond_the_checkpoints_step_is_refused(run: Path, count: float) -> None:
    ckpt = _last(run)

    def recount(tensors: dict[str, torch.Tensor]) -> None:
        for key in [k for k in tensors if k.endswith(".step")]:
            tensors[key] = torch.tensor(float(count))

    _edit_tensors(ckpt, "optimizer.safetensors", recount)
    line = _resume(run, ok=False)
    assert str(ckpt / "optimizer.safetensors") in line and "optimizer steps" in line, line


def _set_aside_and_resumed_from_step_1(run: Path) -> str:
    """``train --resume`` moves the last checkpoint into corrupt/ (all its files kept) and resumes from step 1;
    returns why it was set aside."""
    before = _snapshot(_last(run))
    _resume(run, ok=True)
    moved = run / "checkpoints" / "corrupt" / "step_000002"
    assert _snapshot(moved) == before  # moved whole, nothing lost
    (event,) = [e for e in read_metrics(run, "event") if e["event"] == "corrupt_checkpoint_set_aside"]
    assert [r["step"] for r in read_metrics(run)][-2:] == [2, 3]  # steps 2 and 3 trained again after step 1
    return event["reason"]


@pytest.mark.parametrize(("field", "value"), [("epoch", 10**20), ("tokens", 10**20), ("epoch", 10**4)])
def test_an_absurd_counter_sets_the_checkpoint_aside_as_a_misshapen_tensor_does(run: Path, field: str,
                                                                                value: int) -> None:
    control = Path(shutil.copytree(run, run.parent / "control"))  # the comparable tensor problem

    def misshape(tensors: dict[str, torch.Tensor]) -> None:  # an optimizer moment shaped unlike its weight
        key = next(k for k in sorted(tensors) if k.endswith(".exp_avg") and tensors[k].dim() == 2)
        tensors[key] = tensors[key][:1].contiguous()

    _edit_tensors(_last(control), "optimizer.safetensors", misshape)
    assert "optimizer.safetensors" in _set_aside_and_resumed_from_step_1(control)

    def absurd(body: dict) -> None:
        (body["data"] if field == "epoch" else body)[field] = value

    _edit_state(_last(run), absurd)
    reason = _set_aside_and_resumed_from_step_1(run)
    assert str(_last(run) / "state.json") in reason and field in reason, reason
