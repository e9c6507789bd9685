"""Batches: deterministic in the seed, shifted targets, exact resume, and DDP ranks = one big batch."""

from __future__ import annotations

import itertools

import numpy as np
import pytest
import torch

from hybridnorm.data import TokenBatches, val_batches
from hybridnorm.errors import ConfigError

TOKENS = np.random.default_rng(0).integers(0, 1000, size=5_003).astype(np.uint16)
B, T = 4, 16


def _take(it, n):
    return [tuple(t.clone() for t in b) for b in itertools.islice(it, n)]


def _same(a, b) -> bool:
    return len(a) == len(b) and all(torch.equal(x, y) for p, q in zip(a, b, strict=True) for x, y in zip(p, q,
                                                                                                         strict=True))


def test_shapes_dtype_and_shifted_targets():
    x, y = next(TokenBatches(TOKENS, B, T, seed=1))
    assert x.shape == y.shape == (B, T) and x.dtype == y.dtype == torch.int64
    assert torch.equal(x[:, 1:], y[:, :-1])
    flat = TOKENS.astype(np.int64)
    for row_x, row_y in zip(x, y, strict=True):  # each row is a real window of the data
        start = next(s for s in range(len(flat) - T) if (flat[s:s + T] == row_x.numpy()).all())
        assert (flat[start + 1:start + T + 1] == row_y.numpy()).all()


def test_deterministic_in_seed_and_different_across_seeds():
    a = _take(TokenBatches(TOKENS, B, T, seed=3), 10)
    assert _same(a, _take(TokenBatches(TOKENS, B, T, seed=3), 10))
    assert not _same(a, _take(TokenBatches(TOKENS, B, T, seed=4), 10))


def test_epoch_covers_each_window_once_then_reshuffles():
    it = TokenBatches(TOKENS, B, T, seed=0)
    assert it.n_windows == (len(TOKENS) - 1) // T and it.steps_per_epoch == it.n_windows // B
    epoch0 = _take(it, it.steps_per_epoch)
    rows = {tuple(r.tolist()) for x, _ in epoch0 for r in x}
    assert len(rows) == it.steps_per_epoch * B  # no window repeats within an epoch
    assert it.state_dict()["epoch"] == 1 and it.state_dict()["step"] == 0
    assert not _same(epoch0[:3], _take(it, 3))  # next epoch: another order


@pytest.mark.parametrize("stop", [5, 77])  # inside the first epoch, and past an epoch boundary
def test_state_dict_resume_gives_identical_batches(stop):
    ref = TokenBatches(TOKENS, B, T, seed=7)
    expected = _take(ref, stop + 12)[stop:]
    run = TokenBatches(TOKENS, B, T, seed=7)
    _take(run, stop)
    state = run.state_dict()
    resumed = TokenBatches(TOKENS, B, T, seed=7)
    resumed.load_state_dict(state)
    assert _same(_take(resumed, 12), expected)


def test_ranks_together_equal_one_process_with_the_global_batch():
    single = _take(TokenBatches(TOKENS, 2 * B, T, seed=5), 80)  # > 1 epoch (39 steps)
    ranks = [_take(TokenBatches(TOKENS, B, T, seed=5, rank=r, world_size=2), 80) for r in range(2)]
    for s in range(80):
        assert torch.equal(torch.cat([ranks[0][s][0], ranks[1][s][0]]), single[s][0])
        assert torch.equal(torch.cat([ranks[0][s][1], ranks[1][s][1]]), single[s][1])
    # and a checkpoint from the 2-rank run resumes in one process (same global batch)
    two = TokenBatches(TOKENS, B, T, seed=5, rank=0, world_size=2)
    _take(two, 10)
    one = TokenBatches(TOKENS, 2 * B, T, seed=5)
    one.load_state_dict(two.state_dict())
    assert _same(_take(one, 1), single[10:11])


def test_resume_refuses_a_different_setup_and_bad_sizes():
    state = TokenBatches(TOKENS, B, T, seed=7).state_dict()
    with pytest.raises(ConfigError, match="checkpoint has seed=7, this run 8"):
        TokenBatches(TOKENS, B, T, seed=8).load_state_dict(state)
    with pytest.raises(ConfigError, match="checkpoint has global_batch=4, this run 8"):
        TokenBatches(TOKENS, B, T, seed=7, world_size=2).load_state_dict(state)
    with pytest.raises(ConfigError, match="fewer than one global batch"):
        TokenBatches(TOKENS[:50], B, T)  # 3 windows
    with pytest.raises(ConfigError, match="fewer than one window"):
        TokenBatches(TOKENS[:10], 1, T)
    with pytest.raises(ConfigError, match="need 0 <= rank < world_size"):
        TokenBatches(TOKENS, B, T, rank=2, world_size=2)


def test_val_batches_are_sequential_and_repeatable():
    batches = list(val_batches(TOKENS, B, T))
    assert _same(batches, list(val_batches(TOKENS, B, T)))
    n_windows = (len(TOKENS) - 1) // T
    assert sum(x.shape[0] for x, _ in batches) == n_windows
    assert batches[-1][0].shape[0] == n_windows % B or n_windows % B == 0
    assert batches[0][0][0].tolist() == TOKENS[:T].tolist()
    assert batches[0][1][1].tolist() == TOKENS[T + 1:2 * T + 1].tolist()
    assert len(list(val_batches(TOKENS, B, T, max_batches=3))) == 3
    r0, r1 = list(val_batches(TOKENS, B, T, 6, 0, 2)), list(val_batches(TOKENS, B, T, 6, 1, 2))
    assert _same([r0[0], r1[0], r0[1], r1[1], r0[2], r1[2]], batches[:6])
