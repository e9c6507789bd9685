"""``TransformerLM.generate`` of prompts of several lengths, left-padded with an ``attention_mask`` (what
``hybridnorm generate --prompt A --prompt B`` runs). Oracle: each prompt generated alone, without padding, in
float64 so that no near-tie can flip: greedy, with a repetition penalty and with stop tokens, over placements
whose blocks differ (a second residual stream, an MoE whose padding is routed to experts). Sampled batches
are checked against transformers' ``generate`` in tests/hf/test_hf_generate_prompts.py."""

from __future__ import annotations

import pytest
import torch

import hybridnorm as hn
from hybridnorm.errors import ConfigError

PAD = 7  # any token: what a padding position holds must change nothing
N = 12


def _model(placement: str, **extra: object) -> hn.TransformerLM:
    torch.manual_seed(0)
    model = hn.TransformerLM(hn.ModelConfig.from_preset("tiny", placement=placement, n_layers=2, **extra))
    with torch.no_grad():
        for p in model.parameters():  # spread the logits: a fresh tiny model repeats one token
            p.add_(torch.randn_like(p) * 0.5)
    return model.double().eval()


def _prompts() -> list[list[int]]:
    g = torch.Generator().manual_seed(4)
    return [torch.randint(0, 256, (n,), generator=g).tolist() for n in (5, 1, 9, 3)]


def _batch(prompts: list[list[int]], pad: int = PAD) -> tuple[torch.Tensor, torch.Tensor]:
    width = max(map(len, prompts))
    ids = torch.tensor([[pad] * (width - len(p)) + p for p in prompts])  # (B, P)
    mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompts])  # (B, P)
    return ids, mask


def _alone(model: hn.TransformerLM, prompt: list[int], **kw: object) -> list[int]:
    return model.generate(torch.tensor([prompt]), N, **kw)[0, len(prompt):].tolist()


def _cut(new: list[int], stops: tuple[int, ...]) -> list[int]:
    """A batch row's new tokens up to its first stop token (the batch fed it that token after)."""
    end = next((j for j, t in enumerate(new) if t in stops), None)
    return new if end is None else new[:end + 1]


@pytest.mark.parametrize("placement,extra", [("hybridnorm_star", {}), ("post", {}), ("resi_dual", {}),
                                             ("peri", {}), ("pre", {"moe": {"num_experts": 4, "top_k": 2}})])
def test_each_left_padded_row_generates_what_its_prompt_generates_alone(placement: str, extra: dict) -> None:
    model, prompts = _model(placement, **extra), _prompts()
    ids, mask = _batch(prompts)
    for kw in ({"temperature": 0.0}, {"temperature": 0.0, "repetition_penalty": 1.4}):
        out = model.generate(ids, N, attention_mask=mask, **kw)
        for b, p in enumerate(prompts):
            assert out[b, ids.shape[1]:].tolist() == _alone(model, p, **kw), (placement, kw, b)
        P = ids.shape[1]
        other_pad = model.generate(_batch(prompts, pad=200)[0], N, attention_mask=mask, **kw)
        assert torch.equal(out[:, P:], other_pad[:, P:])
        assert not torch.equal(out, model.generate(ids, N, **kw)), "the mask was used"


def test_stop_tokens_end_each_row_where_it_ends_alone() -> None:
    model, prompts = _model("hybridnorm_star"), _prompts()
    alone = [_alone(model, p, temperature=0.0) for p in prompts]
    stops = (alone[0][3], alone[2][6])  # tokens that end rows 0 and 2 early (and maybe others)
    ids, mask = _batch(prompts)
    out = model.generate(ids, N, temperature=0.0, stop_ids=stops, attention_mask=mask)
    for b, p in enumerate(prompts):
        assert _cut(out[b, ids.shape[1]:].tolist(), stops) == _alone(model, p, temperature=0.0, stop_ids=stops)
    assert out.shape[1] - ids.shape[1] <= N


def test_an_all_ones_mask_is_no_mask_and_bad_masks_are_one_error() -> None:
    model = _model("pre")
    ids = torch.tensor(_prompts()[:1])
    assert torch.equal(model.generate(ids, 4, temperature=0.0, attention_mask=torch.ones_like(ids)),
                       model.generate(ids, 4, temperature=0.0))
    ids, mask = _batch(_prompts())
    for bad, why in ((mask[:, 1:], "shape"), (mask.flip(1), "left padding"), (mask * 2, "left padding"),
                     (torch.zeros_like(mask), "left padding")):
        with pytest.raises(ConfigError, match=why):
            model.generate(ids, 4, attention_mask=bad)
