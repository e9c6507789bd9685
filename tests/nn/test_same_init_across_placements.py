"""Like with like at step 0: a compare/sweep grid seeds each run (``torch.manual_seed(cfg.seed)``) and builds
its model, and docs/results says its runs share "the init generator per seed". That holds as a comparison
only if every weight two placements share (same name and shape: embeddings, attention and FFN projections,
experts, routers) is drawn identically, whatever norms one of them adds. A placement that drew its norm
gains or any other extra tensor from the generator before a shared weight would shift every later draw, and
its comparison with Pre-Norm would mix the placement with another random init. Checked for every preset,
dense and MoE, under both init schemes (the preset's default init is a named factor of the grids)."""

from __future__ import annotations

import pytest
import torch

import hybridnorm as hn
from hybridnorm.placements.registry import names

MOE = {"num_experts": 4, "top_k": 2}


def _weights(placement: str, init: str, moe: dict | None) -> dict[str, torch.Tensor]:
    torch.manual_seed(0)  # as the trainer does before building the model
    config = hn.ModelConfig.from_preset("tiny", placement=placement, init=init, **({"moe": moe} if moe else {}))
    return {k: v.detach() for k, v in hn.TransformerLM(config).named_parameters()}


@pytest.mark.parametrize("moe", [None, MOE], ids=["dense", "moe"])
@pytest.mark.parametrize("init", ["normal", "megatron"])
def test_every_shared_weight_is_drawn_as_pre_norms(init: str, moe: dict | None) -> None:
    base = _weights("pre", init, moe)
    for placement in names():
        other = _weights(placement, init, moe)
        shared = [k for k in base if k in other and base[k].shape == other[k].shape]
        # the embedding, and per block the attention and FFN weights (a placement may add norms, not remove these)
        assert len(shared) >= 1 + 4 * len([k for k in base if k.endswith("attn.w_o.weight")]), (placement, shared)
        differ = [k for k in shared if not torch.equal(base[k], other[k])]
        assert not differ, (placement, init, differ)
    # and the check can fail: another seed draws other weights
    torch.manual_seed(1)
    config = hn.ModelConfig.from_preset("tiny", placement="pre", init=init, **({"moe": moe} if moe else {}))
    reseeded = dict(hn.TransformerLM(config).named_parameters())
    assert not torch.equal(reseeded["embed.weight"], base["embed.weight"])
