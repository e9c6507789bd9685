"""The README's multi-process commands as a new user types them, with every default (the kjv corpus, BPE,
eval every 100 steps and at the last, 16 eval batches): ``torchrun`` 2 gloo processes under FSDP and DDP,
then the same run continued by ONE process with ``hybridnorm train --size tiny --max-steps 20 --out R
--resume``, and a one-process run continued by two. The defaults split validation unevenly over 2 ranks
(checked below), which once deadlocked FSDP's first evaluation. The global batch is kept across the
change of world size by deriving the split, and TensorBoard shows the same steps as metrics.jsonl."""

from __future__ import annotations

import math

import pytest
import torch
from torchrun_helpers import hybridnorm, run, tensorboard_steps, torchrun
from train_helpers import TORCHRUN, read_metrics

pytestmark = pytest.mark.skipif(not torch.distributed.is_available(), reason="this torch has no torch.distributed")


@pytest.fixture(scope="module")
def kjv_cache(tmp_path_factory: pytest.TempPathFactory):
    """The default data prepared once (seconds), outside the user's own cache."""
    from hybridnorm.data import prepare_data
    from hybridnorm.train.config import TrainConfig

    cache = tmp_path_factory.mktemp("kjv_cache")
    cfg = TrainConfig.from_cli(None, [], size="tiny")
    data = prepare_data(cfg.data.source, tokenizer=cfg.data.tokenizer, vocab_size=cfg.data.vocab_size,
                        cache_dir=cache)
    # the premise: the default eval reads an odd number of validation batches, so 2 ranks get unequal shares
    windows = (len(data.val_tokens()) - 1) // cfg.seq_len
    batches = min(math.ceil(windows / cfg.batch_size), cfg.eval_batches * 2)
    assert batches % 2 == 1, batches
    return cache


def _history_agrees(out) -> None:
    """metrics.jsonl has each step once, and TensorBoard shows the same steps (nothing purged)."""
    train = [r["step"] for r in read_metrics(out)]
    evals = [r["step"] for r in read_metrics(out, "eval")]
    assert train == [10, 20] and evals == [10, 20]  # log_interval 10, eval at the last step of each command
    assert tensorboard_steps(out, "train/loss") == train
    assert tensorboard_steps(out, "eval/val_loss") == evals


@pytest.mark.parametrize("parallel", ["fsdp", "ddp"])
def test_torchrun_defaults_then_one_process_resume(parallel, kjv_cache, tmp_path):
    out = tmp_path / "R"
    first = run(torchrun("train", "--size", "tiny", f"--parallel={parallel}", "--max-steps", "10", "--out", str(out)),
                kjv_cache)
    assert first.returncode == 0, first.stderr[-3000:]
    assert "[eval] step 10" in first.stderr and first.stdout.count("final: step 10") == 1

    second = run(hybridnorm("train", "--size", "tiny", "--max-steps", "20", "--out", str(out), "--resume"), kjv_cache)
    assert second.returncode == 0, second.stderr[-3000:]
    # 2 x 16 sequences per step before; one process keeps the 32 by accumulating 2 micro-batches of 16
    assert "global batch 32 sequences per step = 1 process(es) x batch_size=16 x grad_accum=2" in second.stderr
    assert "final: step 20" in second.stdout
    _history_agrees(out)
    tokens = [r["tokens"] for r in read_metrics(out)]
    assert tokens == [10 * 32 * 128, 20 * 32 * 128]  # tiny's seq_len 128: the same tokens per step throughout


def test_one_process_run_resumes_on_two(kjv_cache, tmp_path):
    out, ref = tmp_path / "R", tmp_path / "ref"
    first = run(hybridnorm("train", "--size", "tiny", "--max-steps", "10", "--out", str(out)), kjv_cache)
    assert first.returncode == 0, first.stderr[-3000:]
    second = run(torchrun("train", "--size", "tiny", "--max-steps", "20", "--out", str(out), "--resume"), kjv_cache)
    assert second.returncode == 0, second.stderr[-3000:]
    # the 16 sequences of one process become 2 x 8: the same windows per step as before
    assert "global batch 16 sequences per step = 2 process(es) x batch_size=8 x grad_accum=1" in second.stderr
    _history_agrees(out)

    # against one process training all 20 steps: the same data and schedule, only the sums' order differs
    whole = run(hybridnorm("train", "--size", "tiny", "--max-steps", "20", "--out", str(ref)), kjv_cache)
    assert whole.returncode == 0, whole.stderr[-3000:]
    got, want = read_metrics(out)[-1], read_metrics(ref)[-1]
    assert got["step"] == want["step"] == 20
    assert got["loss"] == pytest.approx(want["loss"], rel=1e-4)


def test_a_global_batch_no_process_count_can_share_is_refused_naming_the_counts(kjv_cache, tmp_path):
    out = tmp_path / "R"
    proc = run(torchrun("train", "--size", "tiny", "--global_batch=7", "--max-steps", "2", "--out", str(out)),
               kjv_cache)
    assert proc.returncode != 0
    errors = [line for line in proc.stderr.splitlines() if line.startswith("error:")]
    assert errors and all("global batch 7" in e and "over 1, 7 processes" in e and "--global_batch" in e
                          for e in errors), proc.stderr[-2000:]
    frames = [line for line in proc.stderr.splitlines() if line.strip().startswith("File ")]
    assert not any("hybridnorm" in f for f in frames), proc.stderr[-3000:]  # torchrun's own traceback only


@pytest.mark.parametrize("parallel", ["fsdp", "ddp"])
def test_async_checkpoints_are_the_synchronous_ones(parallel, kjv_cache, tmp_path):
    """With ``--async_checkpoint=true`` each FSDP rank writes its shards in the background (DDP: rank 0 the
    whole checkpoint) while the steps go on; every checkpoint is byte-identical to the synchronous run's (but
    for its copy of the run's config.yaml, which records the setting) and resumes in one process."""
    from checkpoint_helpers import trained_state

    from hybridnorm.train.checkpoint import list_checkpoints, verify_checkpoint

    folders = {}
    for mode in ("false", "true"):
        out = tmp_path / mode
        done = run(torchrun("train", "--size", "tiny", f"--parallel={parallel}", "--max-steps", "10",
                            "--ckpt_interval=5", f"--async_checkpoint={mode}", "--out", str(out)), kjv_cache)
        assert done.returncode == 0, done.stderr[-3000:]
        folders[mode] = out
    names = [p.name for p in list_checkpoints(folders["true"] / "checkpoints")]
    assert names == ["step_000005", "step_000010"]
    for name in names:
        verify_checkpoint(folders["true"] / "checkpoints" / name)
        assert trained_state(folders["true"] / "checkpoints" / name) == trained_state(
            folders["false"] / "checkpoints" / name)
    assert not list((folders["true"] / "checkpoints").glob(".tmp_*"))
    resumed = run(hybridnorm("train", "--size", "tiny", "--max-steps", "15", "--out", str(folders["true"]),
                             "--resume"), kjv_cache)
    assert resumed.returncode == 0 and "resumed from" in resumed.stderr, resumed.stderr[-3000:]


def test_one_rank_torchrun_fsdp_shards_and_resumes_exactly(kjv_cache, tmp_path):
    """``torchrun --nproc_per_node 1 ... --parallel=fsdp`` joins a group of one and shards over it (it once
    ignored FSDP and saved unsharded), as a single-GPU machine runs it: a sharded checkpoint, the same
    losses as one plain process (fp32 on the CPU: FSDP over one rank changes only the order of a few sums,
    the gradient norm's among them: 1 fp32 ulp seen), and a stop at step 3 resumed to 6 equal to 6 straight
    steps, bit for bit."""
    one = [*TORCHRUN, "--standalone", "--nproc_per_node", "1", "-m", "hybridnorm.cli"]
    common = ("train", "--size", "tiny", "--parallel=fsdp", "--max-steps", "6", "--ckpt_interval=3",
              "--log_interval=1", "--eval_interval=1000")
    straight, resumed, plain = tmp_path / "straight", tmp_path / "resumed", tmp_path / "plain"
    for cmd in ([*one, *common, "--out", str(straight)],
                [*one, *common, "--stop_after_steps=3", "--out", str(resumed)],
                [*one, *common, "--out", str(resumed), "--resume"],
                hybridnorm(*common, "--out", str(plain))):
        done = run(cmd, kjv_cache)
        assert done.returncode == 0, done.stderr[-3000:]
    files = sorted(p.name for p in (resumed / "checkpoints" / "step_000003").iterdir())
    assert "model-r00000.safetensors" in files and "model.safetensors" not in files
    losses = {r: [m["loss"] for m in read_metrics(r)] for r in (straight, resumed, plain)}
    assert len(losses[straight]) == 6
    assert losses[resumed] == losses[straight]
    assert losses[straight] == pytest.approx(losses[plain], rel=1e-6, abs=0)
