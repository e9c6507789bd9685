"""ResiDual (arXiv 2304.14802): the second stream, seen from outside the block code. Its logits against the
float64 oracle, cached decoding, gradients, activation checkpointing, regional compile and the memory plan
are covered with every other preset (test_placement_oracle, test_model_properties, test_regional,
test_plan); here: what the stream holds, what diagnostics report of it, and where it cannot go."""

from __future__ import annotations

import oracle  # tests/oracle.py
import torch

import hybridnorm as hn
from hybridnorm.diagnostics import Diagnostics, DiagnosticsConfig
from hybridnorm.hf import stock


def _model(n_layers: int = 3) -> hn.TransformerLM:
    torch.manual_seed(0)
    mc = hn.ModelConfig(vocab_size=97, d_model=32, n_layers=n_layers, n_heads=4, n_kv_heads=2, ffn_hidden_size=48,
                        max_seq_len=64, placement="ResiDual")
    return oracle.randomize_(hn.TransformerLM(mc).eval())


def rms(t: torch.Tensor) -> float:
    return t.detach().double().square().mean().sqrt().item()


def _ids() -> torch.Tensor:
    return torch.randint(0, 97, (2, 9), generator=torch.Generator().manual_seed(1))


@torch.no_grad()
def test_the_second_stream_is_block_ones_input_plus_every_branch_output() -> None:
    """Hooks on the attention and FFN modules see each branch; the stream each block hands on is block 1's
    input plus all branches so far, and the trunk's output is the last block's own stream + N(that sum)."""
    model = _model()
    branches: list[torch.Tensor] = []
    seen: list[tuple[torch.Tensor, torch.Tensor]] = []
    hooks = [m.register_forward_hook(lambda mod, a, out: branches.append(out)) for b in model.blocks
             for m in (b.attn, b.ffn)]
    hooks += [b.register_forward_hook(lambda mod, a, out: seen.append(out)) for b in model.blocks]
    x1 = model.embed(_ids())
    out = model.trunk(x1, model.rope_cos[:9], model.rope_sin[:9])
    for h in hooks:
        h.remove()
    assert len(branches) == 6 and len(seen) == 3
    for i, (_, dual) in enumerate(seen):
        want = x1 + sum(branches[: 2 * (i + 1)])
        assert (dual - want).abs().max() < 1e-5, i
    last, dual = seen[-1]
    assert torch.allclose(out, last + model.dual_norm(dual), atol=1e-6)


def test_diagnostics_report_each_blocks_own_stream_and_the_second_streams_rms() -> None:
    model = _model()
    seen: list[tuple[torch.Tensor, torch.Tensor]] = []
    hooks = [b.register_forward_hook(lambda mod, a, out: seen.append(out)) for b in model.blocks]
    diag = Diagnostics(model, DiagnosticsConfig(every=1))
    with diag.capture(1):
        logits = model(_ids())
        hn.lm_loss(logits[:, :-1], _ids()[:, 1:]).backward()
    diag.after_backward()
    metrics = diag.pop_metrics()
    for h in hooks:
        h.remove()
    for i, (stream, dual) in enumerate(seen):
        assert abs(metrics[f"act_rms/blocks.{i}"] - rms(stream)) < 1e-5 * rms(stream)
        assert abs(metrics[f"dual_act_rms/blocks.{i}"] - rms(dual)) < 1e-5 * rms(dual)
    assert metrics["dual_act_rms/blocks.2"] > metrics["act_rms/blocks.2"] > 0  # sums of branches vs normed


def test_no_stock_class_computes_it() -> None:
    arch, why = stock.match_stock(_model().config)
    assert arch is None and "second stream" in why
