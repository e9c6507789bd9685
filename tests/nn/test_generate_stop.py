"""XX Oracle: the continuation without a stop (greedy: a loop of
full forwards without the cache; sampled: the same generator seed), cut and filled by hand."""

from __future__ import annotations

import itertools
import re

import pytest
import torch

import hybridnorm as hn
from hybridnorm.errors import ConfigError

T, N = 5, 10  # prompt length, max_new_tokens


def _model(placement: str) -> hn.TransformerLM:
    torch.manual_seed(0)
    model = hn.TransformerLM(hn.ModelConfig.from_preset("tiny", placement=placement, n_layers=2))
    with torch.no_grad():
        for p in model.parameters():  # spread the logits: a fresh tiny model repeats one token
            p.add_(torch.randn_like(p) * 0.5)
    return model.eval()


def _prompt(B: int = 3) -> torch.Tensor:
    return torch.randint(0, 256, (B, T), generator=torch.Generator().manual_seed(4))


def _greedy_full(model: hn.TransformerLM, ids: torch.Tensor, n: int) -> torch.Tensor:
    with torch.no_grad():
        for _ in range(n):
            ids = torch.cat([ids, model(ids)[:, -1, : model.config.vocab_size].argmax(-1, keepdim=True)], dim=1)
    return ids


def _stopped(full: torch.Tensor, *stops: int) -> torch.Tensor:
    """(B, T + N) continuations -> what stopping at ``stops`` returns: after a row's first stop only the first
    of ``stops``; cut after the step where the last row stopped (all N if one never does)."""
    rows, ends = [], []
    for row in full.tolist():
        new = row[T:]
        k = next((i for i, t in enumerate(new) if t in stops), len(new) - 1)
        rows.append(row[:T] + new[: k + 1] + [stops[0]] * (len(new) - k - 1))
        ends.append(k + 1)
    return torch.tensor(rows)[:, : T + max(ends)]


@pytest.mark.parametrize("placement", ["pre", "hybridnorm_star", "post"])
def test_greedy_generation_stops_where_the_loop_without_a_stop_is_cut(placement: str) -> None:
    model, lengths = _model(placement), set()
    for prompt in (_prompt(3), _prompt(1)):  # three rows that stop at different steps, or not at all; one row
        full = _greedy_full(model, prompt, N)
        for stop in dict.fromkeys(full[0, T:].tolist()):  # each token the first row emits
            got = model.generate(prompt, N, temperature=0, stop_ids=stop)
            assert torch.equal(got, _stopped(full, stop)), stop
            lengths.add(got.shape[1])
        absent = next(i for i in range(model.config.vocab_size) if i not in full[:, T:])
        assert torch.equal(model.generate(prompt, N, temperature=0, stop_ids=absent), full)
    assert min(lengths) < T + N  # some stops end it early


def test_sampled_generation_stops_on_the_same_draws() -> None:
    model, prompt = _model("hybridnorm_star"), _prompt()

    def sample(stop: int | None) -> torch.Tensor:
        return model.generate(prompt, N, temperature=0.9, top_k=0, generator=torch.Generator().manual_seed(7),
                              stop_ids=stop)

    full = sample(None)
    for stop in dict.fromkeys(full[1, T:].tolist()):
        assert torch.equal(sample(stop), _stopped(full, stop)), stop


def test_several_stop_ids_stop_at_whichever_comes_first() -> None:
    model, prompt = _model("hybridnorm_star"), _prompt()
    full = _greedy_full(model, prompt, N)
    emitted = list(dict.fromkeys(full[:, T:].flatten().tolist()))
    for a, b in itertools.pairwise(emitted):  # rows stop on either; finished rows repeat the first listed
        got = model.generate(prompt, N, temperature=0, stop_ids=[b, a])
        assert torch.equal(got, _stopped(full, b, a)), (b, a)
        assert torch.equal(model.generate(prompt, N, temperature=0, stop_ids=(a,)), _stopped(full, a))


@pytest.mark.parametrize("stop", [-1, 256, True, 1.0, "0", [], [3, 256], [3, None], {3}])
def test_a_stop_id_outside_the_vocabulary_is_refused(stop: object) -> None:
    model = _model("pre")
    with pytest.raises(ConfigError, match=rf"stop_ids={re.escape(repr(stop))} must be token ids from 0 to 255"):
        model.generate(_prompt(), N, temperature=0, stop_ids=stop)
