"""``TransformerLM.forward`` refuses inputs it would otherwise misread without a word, and what it accepts
means what the (B, T) convention says: checked against the model's own answer for the canonical form."""

from __future__ import annotations

import pytest
import torch

import hybridnorm as hn


@pytest.fixture(scope="module")
def model() -> hn.TransformerLM:
    torch.manual_seed(0)
    return hn.TransformerLM(hn.ModelConfig.from_preset("tiny")).eval()


IDS = torch.randint(0, 256, (2, 16), generator=torch.Generator().manual_seed(0))


@pytest.mark.parametrize("kwargs, message", [
    ({"targets": IDS.T.reshape(2, 16)[:, :8]}, r"targets must be integer ids of the input_ids' shape \(2, 16\)"),
    ({"targets": IDS.flatten()}, r"targets .* got \(32,\)"),  # the fused loss flattened both: accepted before
    ({"targets": IDS.float()}, r"targets .* torch\.float32"),
    ({"attention_mask": torch.ones(2, 10)}, r"attention_mask has shape \(2, 10\); expected \(2, 16\)"),
    ({"attention_mask": torch.ones(16)}, r"attention_mask has shape \(16,\)"),  # all ones: was ignored
    ({"position_ids": torch.arange(10)}, r"position_ids of shape \(10,\) do not fit input_ids \(2, 16\)"),
    ({"position_ids": torch.arange(16) - 5}, r"position_ids must be >= 0, got -5"),  # read the tables' end
])
def test_a_misfit_input_is_one_error_naming_it(model, kwargs, message):
    with pytest.raises(ValueError, match=message):
        model(IDS, **kwargs)


@pytest.mark.parametrize("ids", [IDS[0], IDS[None], IDS.float()])
def test_ids_that_are_not_a_batch_of_integer_rows_are_refused(model, ids):
    with pytest.raises(ValueError, match=r"input_ids must be \(batch, seq\) integer token ids"):
        model(ids)


def test_the_accepted_forms_mean_the_same_as_the_canonical_one(model):
    with torch.no_grad():
        plain = model(IDS)
        assert torch.equal(model(IDS, attention_mask=torch.ones(2, 16, dtype=torch.long)), plain)
        for positions in (torch.arange(16), torch.arange(16)[None], torch.arange(16).expand(2, 16)):
            torch.testing.assert_close(model(IDS, position_ids=positions), plain, rtol=0, atol=1e-6)
        loss = torch.nn.functional.cross_entropy(plain.flatten(0, 1).float(), IDS.flatten())
        torch.testing.assert_close(model(IDS, targets=IDS), loss, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("fast", [True, False])
def test_lm_loss_refuses_targets_that_do_not_fit_the_logits(fast):
    logits = torch.randn(2, 3, 10)
    with pytest.raises(ValueError, match=r"targets of shape \(3, 2\) do not fit logits \(2, 3, 10\)"):
        hn.lm_loss(logits, torch.randint(0, 10, (3, 2)), fast=fast)  # same count: was scored, pairs mixed up
