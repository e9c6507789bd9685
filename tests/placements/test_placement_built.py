"""``Placement.built(L)`` says two placements build the same model exactly when the models say so.

The oracle is the model itself: two placements equal as built must make models whose parameters load into each
other (strict: the same names and shapes) and whose logits are then identical; unequal ones must not. A resume
(train/resume_guard.py) and ``from_pretrained(placement=...)`` trust this comparison to accept a placement written
otherwise (an override equal to the block it replaces, ``first_fraction`` vs ``first_n``, a field a block ignores),
so a false "equal" would continue a run as another model."""

from __future__ import annotations

import dataclasses

import pytest
import torch

import hybridnorm as hn
from hybridnorm import placements
from hybridnorm.placements import BlockSpec, Override, Placement, SublayerSpec

L = 2  # the tiny preset's depth
PRE = placements.get("pre")
NONE, IN = SublayerSpec(), SublayerSpec(in_norm=True)


def _p(block: BlockSpec, *overrides: Override, name: str = "mine") -> Placement:
    return Placement(name, block, overrides=overrides)


SAME = {
    "an-override-equal-to-its-block": (PRE, _p(PRE.block, Override(PRE.block, first_n=1))),
    "mix_ln-at-2-layers-is-pre": (placements.get("mix_ln"), PRE),  # ⌊0.25·2⌋ = 0 Post-Norm blocks
    "first_fraction-as-first_n": (_p(PRE.block, Override(BlockSpec(qkv_norm="QK"), first_fraction=0.5)),
                                  _p(PRE.block, Override(BlockSpec(qkv_norm="QK"), first_n=1))),
    "first_n-past-the-depth": (_p(PRE.block, Override(BlockSpec(qkv_norm="V"), first_n=9)),
                               _p(BlockSpec(qkv_norm="V"))),
    "scope-with-no-attention-norm": (PRE, _p(dataclasses.replace(PRE.block, qkv_norm_scope="full"))),
    "order-with-no-q-or-k-norm": (_p(BlockSpec(qkv_norm="VC")),
                                  _p(BlockSpec(qkv_norm="VC", qkv_norm_order="after_rope"))),
    "depth-scaling-in-block-1": (_p(PRE.block, Override(dataclasses.replace(PRE.block, depth_scaled_norms=True),
                                                        first_n=1)), PRE),
    "depth-scaling-in-a-block-with-no-norm": (_p(BlockSpec(attn=NONE, ffn=NONE)),
                                              _p(BlockSpec(attn=NONE, ffn=NONE, depth_scaled_norms=True))),
    "deepnorm-as-its-alpha": (_p(BlockSpec(residual_scale="deepnorm")), _p(BlockSpec(residual_scale=(2 * L) ** 0.25))),
    "another-name-and-init": (PRE, dataclasses.replace(PRE, name="x", summary="y", source="z", init="megatron")),
}
OTHER = {
    "mix_ln-at-4-layers-is-not-pre": (placements.get("mix_ln"), PRE, 4),
    "first_fraction-covering-more": (_p(PRE.block, Override(BlockSpec(qkv_norm="QK"), first_fraction=1.0)),
                                     _p(PRE.block, Override(BlockSpec(qkv_norm="QK"), first_n=1)), L),
    "scope-of-a-v-norm": (_p(BlockSpec(qkv_norm="V")), _p(BlockSpec(qkv_norm="V", qkv_norm_scope="full")), L),
    "order-of-a-k-norm": (_p(BlockSpec(qkv_norm="K")), _p(BlockSpec(qkv_norm="K", qkv_norm_order="after_rope")), L),
    "depth-scaling-in-block-2": (PRE, _p(PRE.block, Override(dataclasses.replace(PRE.block, depth_scaled_norms=True),
                                                             first_n=2)), L),
    "final-norm": (PRE, dataclasses.replace(PRE, final_norm=False), L),
}


def _logits(placement: Placement, n_layers: int, state: dict | None) -> tuple[torch.Tensor, dict]:
    torch.manual_seed(0)
    model = hn.TransformerLM(hn.ModelConfig.from_preset("tiny", placement=placement, n_layers=n_layers)).eval()
    if state is None:  # every weight off its init (norm gains of 1 hide a norm's order around RoPE)
        with torch.no_grad():
            for p in model.parameters():
                p.add_(0.3 * torch.randn_like(p))
    else:
        model.load_state_dict(state, strict=True)
    ids = torch.randint(0, 256, (2, 12), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        return model(ids), model.state_dict()


@pytest.mark.parametrize(("a", "b"), SAME.values(), ids=SAME.keys())
def test_placements_equal_as_built_make_one_model(a: Placement, b: Placement):
    assert a.validate().built(L) == b.validate().built(L)
    assert a.to_dict() != b.to_dict()  # written otherwise: what the spec fields alone told apart
    logits, state = _logits(a, L, None)
    assert torch.equal(_logits(b, L, state)[0], logits)


@pytest.mark.parametrize(("a", "b", "n_layers"), OTHER.values(), ids=OTHER.keys())
def test_placements_unequal_as_built_make_other_models(a: Placement, b: Placement, n_layers: int):
    assert a.validate().built(n_layers) != b.validate().built(n_layers)
    logits, state = _logits(a, n_layers, None)
    try:
        other = _logits(b, n_layers, state)[0]
    except RuntimeError:  # other parameters: load_state_dict(strict=True) refuses
        return
    assert not torch.allclose(other, logits)
