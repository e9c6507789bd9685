"""``compile_head_loss`` (hybridnorm.nn.regional): the LM head + loss under torch.compile, the trainer's choice
on a GPU under ``--compile=true``. Its plain twin is the model's own eager ``_loss`` (the fused kernel, or the
plain line with ``fast_kernels=False``); the reference is a float64 head + cross-entropy written out here.

Counted with dynamo's ``CompileCounter`` (the traced graph run eagerly: it must be the plain line, bitwise),
then with inductor's generated code (the trainer's backend), forward and backward, fp32 and bf16 autocast."""

from __future__ import annotations

import os
import shutil

import pytest
import torch
import torch.nn.functional as F
from torch._dynamo.testing import CompileCounter
from torch._dynamo.utils import counters

import hybridnorm as hn
from hybridnorm.nn.regional import compile_head_loss


def _model(*, tied: bool = True) -> hn.TransformerLM:
    torch.manual_seed(0)
    cfg = hn.ModelConfig.from_preset("tiny", n_layers=2, tie_embeddings=tied)
    return hn.TransformerLM(cfg)


def _batch(seed: int = 1, rows: int = 2) -> tuple[torch.Tensor, torch.Tensor]:
    ids = torch.randint(0, 256, (rows, 25), generator=torch.Generator().manual_seed(seed))
    targets = ids[:, 1:].clone()
    targets[0, :5] = -100  # unscored positions, as padding and prompts give them
    return ids[:, :-1], targets


def _loss_and_grads(model: hn.TransformerLM, inputs: torch.Tensor, targets: torch.Tensor,
                    bf16: bool = False) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    model.zero_grad(set_to_none=True)
    with torch.autocast("cpu", torch.bfloat16, enabled=bf16):
        loss = model(inputs, targets=targets)
    loss.backward()
    return loss.detach(), {n: p.grad.clone() for n, p in model.named_parameters()}


@pytest.mark.parametrize("tied", [True, False], ids=["tied", "untied"])
def test_the_traced_graph_is_the_plain_line_bitwise(dynamo, tied):
    counter = CompileCounter()
    model = compile_head_loss(_model(tied=tied), backend=counter)
    assert list(model.state_dict()) == list(_model(tied=tied).state_dict())  # in place: the same names
    first = _loss_and_grads(model, *_batch(1))
    second = _loss_and_grads(model, *_batch(2))  # same shapes: no recompile
    assert counter.frame_count == 1 and dict(counters["graph_break"]) == {}
    # the twin: the same model (fast kernels in the eager blocks) whose head + loss is the eager plain line,
    # which is what dynamo traces (the fused kernel steps aside while compiling)
    plain = _model(tied=tied)
    plain._loss = lambda x, t: hn.lm_loss(plain.head(x), t, fast=False)
    for got, batch in ((first, _batch(1)), (second, _batch(2))):
        want = _loss_and_grads(plain, *batch)
        assert torch.equal(got[0], want[0])
        assert all(torch.equal(got[1][n], want[1][n]) for n in want[1])


def test_evaluation_runs_it_eagerly_as_the_trainer_does(dynamo):
    """train/step.py evaluates under ``set_stance("force_eager")``: a no-grad pass adds no graph."""
    counter = CompileCounter()
    model = compile_head_loss(_model(), backend=counter)
    _loss_and_grads(model, *_batch(1))
    inputs, targets = _batch(3, rows=3)  # another shape: compiled, it would be a second graph
    with torch.no_grad(), torch.compiler.set_stance("force_eager"):
        model(inputs, targets=targets)
    assert counter.frame_count == 1


@pytest.mark.skipif(shutil.which(os.environ.get("CXX", "g++")) is None and shutil.which("c++") is None,
                    reason="inductor's CPU backend needs a C++ compiler")
@pytest.mark.parametrize("bf16", [False, True], ids=["fp32", "bf16"])
def test_inductor_compiled_head_loss_gives_the_fused_kernels_loss_and_gradients(dynamo, bf16):
    """What inductor generates against the eager model with its fused kernel (the twin it replaces). fp32:
    equal to rounding (loss rel 1e-6, each gradient within 1e-5 of its largest
    entry). bf16 autocast: both may stray from the fp32 eager run, the compiled one at most twice as far as
    the eager fused kernel does (plus 1e-3 on the loss: bf16 logits are rounded in both)."""
    inputs, targets = _batch(1)
    eager = _loss_and_grads(_model(), inputs, targets, bf16)
    model = compile_head_loss(_model())
    compiled = _loss_and_grads(model, inputs, targets, bf16)
    again = _loss_and_grads(model, inputs, targets, bf16)
    assert counters["frames"]["ok"] == 1 and dict(counters["graph_break"]) == {}
    assert torch.equal(compiled[0], again[0])

    def worst(a, b):
        return max(((a[n] - b[n]).abs().max() / a[n].abs().max().clamp_min(1e-30)).item() for n in a)

    if not bf16:
        torch.testing.assert_close(compiled[0], eager[0], rtol=1e-6, atol=0)
        assert worst(eager[1], compiled[1]) < 1e-5
        return
    fp32 = _loss_and_grads(_model(), inputs, targets)
    assert abs(compiled[0] - fp32[0]) <= 2 * abs(eager[0] - fp32[0]) + 1e-3
    assert worst(fp32[1], compiled[1]) <= 2 * worst(fp32[1], eager[1])


def test_the_loss_is_the_written_out_cross_entropy(dynamo):
    """Independent of both kernels: the compiled loss equals a float64 head + cross-entropy over the scored
    rows of the model's own final hidden states (taken with a forward hook on the final norm)."""
    model = compile_head_loss(_model(), backend=CompileCounter())
    inputs, targets = _batch(4)
    seen = {}
    handle = model.final_norm.register_forward_hook(lambda m, a, out: seen.__setitem__("x", out.detach()))
    loss = model(inputs, targets=targets)
    handle.remove()
    x = seen["x"].double()  # (B, T, d)
    logits = x @ model._head_weight(seen["x"]).double().T  # (B, T, V)
    ref = F.cross_entropy(logits.flatten(0, 1), targets.flatten(), ignore_index=-100)
    torch.testing.assert_close(loss.double(), ref, rtol=1e-6, atol=0)
