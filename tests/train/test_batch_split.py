"""The global batch as a run's invariant: how it is re-split over another number of processes, what is
refused (naming what would work), and that the data order depends on the global batch alone."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from hybridnorm.data import TokenBatches
from hybridnorm.errors import ConfigError
from hybridnorm.train.batch_split import per_step_state, resolve_split, split_global_batch

TOKENS = np.random.default_rng(0).integers(0, 1000, size=20_003).astype(np.uint16)
T = 16


@pytest.mark.parametrize(("glob", "world", "batch", "accum", "want"), [
    (32, 2, 16, 1, (16, 1, False)),   # as asked
    (32, 1, 16, 1, (16, 2, True)),    # 2 processes -> 1: accumulate
    (16, 2, 16, 1, (8, 1, True)),     # 1 -> 2: never a larger micro-batch than asked
    (24, 2, 16, 1, (12, 1, True)),    # the largest batch size <= 16 that divides the share of 12
    (32, 1, 4, 8, (4, 8, False)),     # any batch x accumulation that multiplies to it is kept
    (30, 2, 4, 1, (3, 5, True)),      # share 15: 3 x 5
])
def test_split(glob, world, batch, accum, want):
    s = split_global_batch(glob, world, batch, accum, "test")
    assert (s.batch_size, s.grad_accum, s.changed) == want
    assert s.batch_size * s.grad_accum * world == glob


def test_no_split_is_refused_naming_the_process_counts_that_work():
    with pytest.raises(ConfigError, match=r"global batch 12 .* over 5 processes; it can over 1, 2, 3, 4, 6, 12 "
                                          r"processes .*--global_batch that is a multiple of 5"):
        split_global_batch(12, 5, 4, 1, "the checkpoint being resumed")
    with pytest.raises(ConfigError, match=r"it can over 1, 13 processes"):  # all of them, nothing elided
        split_global_batch(13, 2, 4, 1, "test")
    with pytest.raises(ConfigError, match=r"it can over 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 12, 14, \.\.\. processes"):
        split_global_batch(5040, 11, 4, 1, "test")  # 60 process counts work: the first twelve, then "..."


def test_resume_keeps_the_checkpoints_global_batch_and_refuses_another():
    assert resolve_split(0, 32, 1, 16, 1).grad_accum == 2
    assert resolve_split(32, 32, 4, 16, 1).batch_size == 8
    with pytest.raises(ConfigError, match="global_batch=64, but the run being resumed has global batch 32"):
        resolve_split(64, 32, 1, 16, 1)
    assert resolve_split(64, None, 2, 16, 1).grad_accum == 2  # --global_batch starts a run
    assert resolve_split(0, None, 2, 16, 3).global_batch == 96  # default: processes x batch x accumulation


def _steps(it: TokenBatches, n: int) -> list[torch.Tensor]:
    """The windows of each of ``n`` optimizer steps (all micro-batches and ranks together, sorted)."""
    out = []
    for _ in range(n):
        rows = torch.cat([next(it)[0] for _ in range(it.grad_accum)])
        out.append(rows[torch.argsort(rows[:, 0] * 10_000 + rows[:, 1])])
    return out


@pytest.mark.parametrize(("batch", "accum"), [(8, 1), (4, 2), (2, 4), (1, 8)])
def test_every_split_of_a_global_batch_reads_the_same_windows_per_step_across_epochs(batch, accum):
    ref = TokenBatches(TOKENS, 8, T, seed=3)
    split = TokenBatches(TOKENS, batch, T, seed=3, grad_accum=accum)
    n = ref.steps_per_epoch + 5  # past an epoch boundary
    assert all(torch.equal(a, b) for a, b in zip(_steps(ref, n), _steps(split, n), strict=True))


def test_an_old_micro_batch_position_resumes_at_the_same_windows():
    """A state written before grad_accum was part of the order counted micro-batches; converted, it
    continues with exactly the windows the old loader would have read next (first epoch)."""
    old = TokenBatches(TOKENS, 4, T, seed=1)  # the old loader: one micro-batch per item, no accumulation
    for _ in range(6):
        next(old)  # 3 steps of grad_accum=2
    state = {k: v for k, v in old.state_dict().items() if k != "per_step"}
    new = TokenBatches(TOKENS, 4, T, seed=1, grad_accum=2)
    new.load_state_dict(per_step_state(state, 2))
    assert all(torch.equal(next(new)[0], next(old)[0]) for _ in range(6))
    with pytest.raises(ConfigError, match="grad_accum=4"):
        per_step_state(state, 4)


@pytest.mark.parametrize(("batch", "accum"), [(4, 2), (2, 4), (1, 8)])
def test_every_split_of_a_global_batch_is_validated_on_the_same_windows(batch, accum):
    """The trainer's evaluation scores eval_batches global batches of windows: one process with a batch
    of 8, or 8 sequences per step as batch x micro-batches, gives the same tokens and loss. Before, it
    scored eval_batches micro-batches, so a run resumed in one process after two (batch 16 x 2 micro-batches,
    the README's torchrun sequence) was validated on half the windows it had been."""
    from dataclasses import replace

    from hybridnorm import ModelConfig
    from hybridnorm.train.config import TrainConfig
    from hybridnorm.train.distributed import Dist
    from hybridnorm.train.step import evaluate

    torch.manual_seed(0)
    model = ModelConfig(vocab_size=1000, d_model=32, n_layers=1, n_heads=2, ffn_hidden_size=32, max_seq_len=T).build()
    base = TrainConfig.from_dict({"seq_len": T, "batch_size": 8, "eval_batches": 3, "precision": "fp32"})
    want = evaluate(model, TOKENS, base, torch.device("cpu"), Dist())
    assert want[1] == 3 * 8 * T
    got = evaluate(model, TOKENS, replace(base, batch_size=batch, grad_accum=accum), torch.device("cpu"), Dist())
    assert got[1] == want[1] and got[0] == pytest.approx(want[0], rel=1e-6)
