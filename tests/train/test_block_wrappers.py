"""``--activation_checkpointing`` and ``--compile`` in real (tiny) training runs: the same losses and
checkpoint files as the plain run, and (compile) one graph per block structure for the whole run."""

from __future__ import annotations

import pytest
import torch
from safetensors.torch import load_file
from torch._dynamo.testing import CompileCounter
from torch._dynamo.utils import counters
from train_helpers import read_metrics

import hybridnorm.train.trainer as trainer
from hybridnorm.nn.regional import compile_blocks

MOE = ("--model.moe={num_experts: 4, top_k: 2}", "--model.ffn_hidden_size=32", "--model.tie_embeddings=false")


def _same_runs(a, b, steps: int) -> None:
    ma, mb = read_metrics(a), read_metrics(b)
    assert [r["step"] for r in ma] == [r["step"] for r in mb] == list(range(1, steps + 1))
    for key in ("loss", "grad_norm"):
        assert [r[key] for r in ma] == [r[key] for r in mb], key
    for name in ("model.safetensors", "optimizer.safetensors"):
        wa = load_file(a / "checkpoints" / f"step_{steps:06d}" / name)
        wb = load_file(b / "checkpoints" / f"step_{steps:06d}" / name)
        assert wa.keys() == wb.keys(), name  # no wrapper module: the same names in the files
        assert all(torch.equal(wa[k], wb[k]) for k in wa), name


@pytest.mark.parametrize("extra", [(), MOE], ids=["dense", "moe"])
def test_activation_checkpointing_trains_bitwise_like_the_plain_run(make_cfg, tmp_path, extra):
    common = ("--max_steps=4", "--diagnostics.every=2", *extra)
    plain = trainer.train(make_cfg(tmp_path / "plain", *common))
    ckpt = trainer.train(make_cfg(tmp_path / "ckpt", *common, "--activation_checkpointing=true"))
    assert ckpt.val_loss == plain.val_loss
    _same_runs(tmp_path / "plain", tmp_path / "ckpt", 4)
    def diag(run):
        return [{k: v for k, v in r.items() if k != "time"} for r in read_metrics(run, "diag")]

    assert diag(tmp_path / "plain") == diag(tmp_path / "ckpt")


def test_compile_flag_compiles_each_block_structure_once_for_the_run(make_cfg, tmp_path, monkeypatch, dynamo):
    counter = CompileCounter()  # records the graphs, runs them as traced (no code generation: a quick test)
    monkeypatch.setattr(trainer, "compile_blocks", lambda model: compile_blocks(model, backend=counter))
    # default placement: HybridNorm*, whose first block differs; plain math throughout (compiled blocks run
    # it anyway, the embedding and final norm outside them would otherwise take their fast kernels)
    common = ("--max_steps=6", "--eval_interval=3", "--model.fast_kernels=false")
    trainer.train(make_cfg(tmp_path / "compiled", *common, "--compile=true", "--activation_checkpointing=true"))
    # two block structures (HybridNorm*'s first block differs), training only: evaluation runs eager;
    # nothing recompiled in 6 steps and 2 evals
    assert counter.frame_count == 2
    assert dict(counters["graph_break"]) == {}
    # and the run's own metrics say so at every logged step (what a user reads to spot a recompile)
    logged = [(r["compile/frames"], r["compile/graphs"], r["compile/graph_breaks"])
              for r in read_metrics(tmp_path / "compiled") if "loss" in r]
    assert logged == [(2, 2, 0)] * 6
    # the graphs compute op for op what eager mode does: the same run, bit for bit
    trainer.train(make_cfg(tmp_path / "plain", *common))
    _same_runs(tmp_path / "plain", tmp_path / "compiled", 6)


def test_head_loss_compiled_adds_one_graph_and_trains_bitwise_like_the_plain_run(make_cfg, tmp_path, monkeypatch,
                                                                                  dynamo):
    """``--head_loss=compiled`` (what ``auto`` picks on CUDA under --compile=true) on the CPU: the blocks'
    graphs plus one for the LM head + loss, none recompiled over 6 steps and 2 evaluations, and the traced
    graphs compute what the eager plain run computes, bit for bit (losses, grad norms, checkpoint files)."""
    from hybridnorm.nn.regional import compile_head_loss

    counter = CompileCounter()
    monkeypatch.setattr(trainer, "compile_blocks", lambda model: compile_blocks(model, backend=counter))
    monkeypatch.setattr(trainer, "compile_head_loss", lambda model: compile_head_loss(model, backend=counter))
    common = ("--max_steps=6", "--eval_interval=3", "--model.fast_kernels=false")
    trainer.train(make_cfg(tmp_path / "compiled", *common, "--compile=true", "--head_loss=compiled"))
    assert counter.frame_count == 3 and dict(counters["graph_break"]) == {}
    logged = [(r["compile/frames"], r["compile/graphs"]) for r in read_metrics(tmp_path / "compiled") if "loss" in r]
    assert logged == [(3, 3)] * 6
    trainer.train(make_cfg(tmp_path / "plain", *common))
    _same_runs(tmp_path / "plain", tmp_path / "compiled", 6)


@pytest.mark.parametrize(("head_loss", "compile", "device", "compiled"), [
    ("auto", True, "cuda", True), ("auto", False, "cuda", False), ("auto", True, "cpu", False),
    ("compiled", False, "cpu", True), ("eager", True, "cuda", False)])
def test_which_runs_compile_the_head_loss(head_loss, compile, device, compiled):
    cfg = trainer.TrainConfig(head_loss=head_loss, compile=compile)
    assert cfg.compiles_head_loss(device) is compiled


def test_a_bad_head_loss_names_the_field_and_the_choices():
    with pytest.raises(trainer.ConfigError, match=r"head_loss.*'auto', 'eager', 'compiled'"):
        trainer.TrainConfig.from_dict({"head_loss": "fused"})
