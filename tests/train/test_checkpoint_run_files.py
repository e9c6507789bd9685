"""A checkpoint keeps copies of its run's ``config.yaml`` and ``tokenizer.json`` as they were when it was
written (``RUN_FILES``, hashed in its manifest): a ``checkpoints/step_*`` folder copied out of its run opens
on its own in ``generate``, ``eval`` and ``export``; a run's ``config.yaml`` rewritten by a later resume does
not change what an older checkpoint is read as; a damaged or stray copy is one error naming it; a checkpoint
written before the copies existed still opens with its run folder's files."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from checkpoint_helpers import as_older_checkpoint, flip_byte, model_and_optimizer, write_checkpoint
from train_helpers import cli_in_process

from hybridnorm import cli
from hybridnorm.loading import evaluate_run, load_run
from hybridnorm.train.checkpoint import (
    RUN_FILES,
    CheckpointError,
    TrainState,
    checked_run_file,
    list_checkpoints,
    verify_checkpoint,
)
from hybridnorm.train.checkpoint.save import save_checkpoint
from hybridnorm.train.config import TrainConfig
from hybridnorm.train.trainer import train


@pytest.fixture(scope="module")
def run(tmp_path_factory: pytest.TempPathFactory, corpus: Path, cache_dir: Path) -> Path:
    """4 steps, a checkpoint every 2, then resumed to 6 steps with another learning rate (config.yaml rewritten)."""
    from train_helpers import tiny_overrides

    import hybridnorm.train.trainer as trainer
    from hybridnorm.train.config import apply_overrides

    out = tmp_path_factory.mktemp("run_files") / "run"

    def cfg(*extra: str) -> TrainConfig:
        return TrainConfig.from_dict(apply_overrides({}, [*tiny_overrides(corpus, cache_dir, out), "--keep_last=0",
                                                          "--ckpt_interval=2", *extra]))

    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(trainer, "measured_peak_flops", lambda *a, **k: 1e12)
        train(cfg("--max_steps=4", "--optim.lr=0.002"), quiet=True)
        train(cfg("--max_steps=6", "--optim.lr=0.001"), resume=True, quiet=True)
    return out


def _cli_out(*argv: str) -> str:
    return cli_in_process(*argv).stdout


def test_every_checkpoint_holds_the_run_files_it_was_written_with(run: Path) -> None:
    ckpts = {p.name: p for p in list_checkpoints(run / "checkpoints")}
    assert list(ckpts) == ["step_000002", "step_000004", "step_000006"]
    lrs = {}
    for name, ckpt in ckpts.items():
        # hashed in the manifest like the weights; tokenizer_config.json is only a declared eos's (the bytes
        # tokenizer has its own: tests/hf/test_hf_declared_eos.py)
        assert set(verify_checkpoint(ckpt)) & set(RUN_FILES) == {"config.yaml", "tokenizer.json"}
        assert (ckpt / "tokenizer.json").read_bytes() == (run / "tokenizer.json").read_bytes()
        lrs[name] = TrainConfig.load(ckpt / "config.yaml").optim.lr
        assert load_run(ckpt).config.optim.lr == lrs[name]  # what opening the checkpoint reads
    assert lrs == {"step_000002": 0.002, "step_000004": 0.002, "step_000006": 0.001}
    assert (ckpts["step_000006"] / "config.yaml").read_bytes() == (run / "config.yaml").read_bytes()


def test_a_checkpoint_copied_out_of_its_run_opens_on_its_own(run: Path, tmp_path: Path) -> None:
    alone = tmp_path / "elsewhere" / "step_000006"
    shutil.copytree(run / "checkpoints" / "step_000006", alone)
    prompt = ["--prompt", "and the", "--temperature", "0", "--max-new-tokens", "12"]
    assert _cli_out("generate", str(alone), *prompt) == _cli_out("generate", str(run), *prompt)
    ours, from_run = load_run(alone), load_run(run)
    assert ours.tokenizer_file == alone / "tokenizer.json" and ours.checkpoint == alone
    assert evaluate_run(ours) == evaluate_run(from_run)  # same windows, same loss
    _cli_out("export", str(alone), "--to", "hf", str(tmp_path / "hf"))
    assert json.loads((tmp_path / "hf" / "config.json").read_text(encoding="utf-8"))["architectures"] == [
        "HybridNormForCausalLM"]


@pytest.mark.parametrize("name", ["config.yaml", "tokenizer.json"])
def test_a_damaged_copy_is_a_corrupt_checkpoint_named_by_its_file(run: Path, tmp_path: Path, name: str) -> None:
    ckpt = tmp_path / "step_000006"
    shutil.copytree(run / "checkpoints" / "step_000006", ckpt)
    flip_byte(ckpt / name, 10)
    with pytest.raises(CheckpointError, match=rf"step_000006/{name} is corrupt \(sha256 differs"):
        verify_checkpoint(ckpt)
    with pytest.raises(CheckpointError, match=rf"step_000006/{name} is corrupt"):
        load_run(ckpt)


def test_a_checkpoint_without_copies_reads_its_runs_files_and_refuses_a_stray_one(tmp_path: Path) -> None:
    """Written by a caller that passes no run files (as every checkpoint before the copies existed): the run
    folder's are the ones read. A config.yaml dropped into it later is not what it was written with."""
    ckpt = write_checkpoint(tmp_path / "run" / "checkpoints", 3)
    assert not any((ckpt / n).exists() for n in RUN_FILES)
    assert [checked_run_file(ckpt, n) for n in RUN_FILES] == [tmp_path / "run" / n for n in RUN_FILES]
    verify_checkpoint(ckpt)
    (ckpt / "config.yaml").write_text("model: {}\n", encoding="utf-8")
    for check in (verify_checkpoint, lambda c: checked_run_file(c, "config.yaml")):
        with pytest.raises(CheckpointError, match=r"step_000003/config\.yaml is not recorded in .*manifest\.json"):
            check(ckpt)


def test_a_recorded_copy_that_is_gone_is_named_never_replaced_by_another_folders(run: Path, tmp_path: Path,
                                                                                  capsys) -> None:
    """A checkpoint copied out without its tokenizer.json must not read whatever tokenizer.json lies two
    folders up: its manifest says it had one."""
    alone = tmp_path / "a" / "b" / "step_000006"
    shutil.copytree(run / "checkpoints" / "step_000006", alone)
    (alone / "tokenizer.json").unlink()
    (tmp_path / "a" / "tokenizer.json").write_text("{}", encoding="utf-8")  # a stranger's, two folders up
    with pytest.raises(CheckpointError, match=r"step_000006/tokenizer\.json is missing"):
        load_run(alone)
    capsys.readouterr()
    assert cli.main(["generate", str(alone), "--prompt", "x"]) == 2
    (line,) = capsys.readouterr().err.strip().splitlines()
    assert line.startswith("error: ") and "step_000006/tokenizer.json is missing" in line


def test_older_checkpoint_of_a_trained_run_reads_the_run_folder(run: Path, tmp_path: Path) -> None:
    copy = tmp_path / "run"
    shutil.copytree(run, copy)
    ckpt = copy / "checkpoints" / "step_000002"
    as_older_checkpoint(ckpt)
    opened = load_run(ckpt)
    assert opened.tokenizer_file == copy / "tokenizer.json"
    assert opened.config.optim.lr == 0.001  # the run's config.yaml, rewritten by the resume: all there is
    for a, b in zip(opened.model.state_dict().values(), load_run(run / "checkpoints" / "step_000002").model
                    .state_dict().values(), strict=True):
        assert torch.equal(a, b)


def test_unknown_run_file_names_are_refused_before_anything_is_written(tmp_path: Path) -> None:
    model, opt = model_and_optimizer()
    with pytest.raises(ValueError, match="run_files may hold"):
        save_checkpoint(tmp_path / "checkpoints", model, opt, TrainState(step=1), run_files={"notes.txt": b"x"})
    assert not (tmp_path / "checkpoints").exists() or not list((tmp_path / "checkpoints").iterdir())
