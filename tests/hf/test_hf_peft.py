"""PEFT adapters (LoRA, LN tuning, IA3) on ``HybridNormForCausalLM`` through PEFT's own entry points
(``get_peft_model``, ``Trainer``, ``save_pretrained`` / ``PeftModel.from_pretrained``, ``merge_and_unload``),
the way users adapt an exported model, and an adapter folder handed to our commands. The LoRA oracle is its
equation: a wrapped linear computes W x + (α/r)·B A x, so
the adapted model must equal our plain model whose every targeted weight is W + (α/r)·B A, merged by hand.
That fails if any forward reads a weight past its module (a fused path calling ``F.linear`` on
``.weight`` directly would leave the adapter silently unused)."""

from __future__ import annotations

import copy
from pathlib import Path

import pytest
import torch

pytest.importorskip("transformers", reason="the hf extra (transformers) is not installed")
pytest.importorskip("peft", reason="peft is in the dev extra")
from peft import IA3Config, LNTuningConfig, LoraConfig, PeftModel, get_peft_model
from test_hf_tools import NEW, cli_generate
from test_hf_trainer import collate, make
from transformers import AutoModelForCausalLM, AutoTokenizer, Trainer, TrainingArguments

import hybridnorm.hf  # noqa: F401  (registers the Auto classes)
from hybridnorm.config import MoEConfig
from hybridnorm.hf.export import export_run

PROMPT = "And God said unto Moses"
LINEARS = {"w_qkv", "w_o", "w_in", "w_out"}  # a dense block's linear layers; the tied head is no target


def lora_layers(model: torch.nn.Module) -> dict[str, torch.nn.Module]:
    """Every module PEFT wrapped, by the base model's own name for it."""
    return {name.removeprefix("base_model.model."): mod for name, mod in model.named_modules()
            if hasattr(mod, "lora_A") and "default" in mod.lora_A}


def hand_merged(base: torch.nn.Module, adapted: torch.nn.Module, alpha: float, r: int) -> torch.nn.Module:
    """``base`` with W + (α/r)·B A written into each wrapped linear: LoRA's equation, not PEFT's merge."""
    merged = copy.deepcopy(base)
    weights = dict(merged.named_parameters())
    for name, mod in lora_layers(adapted).items():
        A, B = mod.lora_A["default"].weight, mod.lora_B["default"].weight  # (r, in), (out, r)
        with torch.no_grad():
            weights[f"{name}.weight"] += (alpha / r) * B @ A
    return merged


@pytest.mark.parametrize("placement", ["hybridnorm_star", "pre", "post", "peri"])
def test_lora_on_every_linear_equals_the_hand_merged_weights(placement: str) -> None:
    base = make(placement).eval()
    ids = torch.randint(0, 97, (2, 12), generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        plain = base(ids).logits
    # init_lora_weights=False draws B too, so the adapter changes the function from the first forward
    adapted = get_peft_model(copy.deepcopy(base), LoraConfig(r=4, lora_alpha=8, target_modules="all-linear",
                                                             init_lora_weights=False)).eval()
    wrapped = lora_layers(adapted)
    assert {n.rsplit(".", 1)[-1] for n in wrapped} == LINEARS
    assert len(wrapped) == 4 * base.config.num_hidden_layers  # every block's, none skipped
    with torch.no_grad():
        got = adapted(input_ids=ids).logits
        want = hand_merged(base, adapted, alpha=8, r=4)(ids).logits
    assert (got - plain).abs().max() > 1e-2  # the adapter is in the forward
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    with torch.no_grad():  # PEFT's own merge agrees with the hand merge
        torch.testing.assert_close(adapted.merge_and_unload()(ids).logits, want, rtol=1e-5, atol=1e-5)


NORMS = ["q_norm", "k_norm", "v_norm", "attn_norm", "ffn_norm", "attn_out_norm", "ffn_out_norm", "final_norm"]


@pytest.mark.parametrize("method", ["ln_tuning", "ia3"])
@pytest.mark.parametrize("placement", ["hybridnorm_star", "pre", "olmo2", "peri"])
def test_every_parameter_ln_tuning_and_ia3_train_reaches_the_logits(placement: str, method: str) -> None:
    """PEFT's LN tuning swaps each norm for a wrapper holding a trainable copy, IA3 scales the linears: each
    trainable tensor, scaled alone, must change the logits. A fast path that read a norm's gain or a weight
    past its module (the fused Q/K/V kernel reads the Q/K/V norms' gains) would leave one dead."""
    cfg = LNTuningConfig(target_modules=NORMS) if method == "ln_tuning" else \
        IA3Config(target_modules=sorted(LINEARS), feedforward_modules=["w_out"])
    base = make(placement)
    adapted = get_peft_model(base, cfg).eval()
    trainable = [(n, p) for n, p in adapted.named_parameters() if p.requires_grad]
    ids = torch.randint(0, 97, (2, 12), generator=torch.Generator().manual_seed(3))
    n_norms = sum(1 for name, _ in base.named_modules() if name.rsplit(".", 1)[-1] in NORMS)
    assert len(trainable) == (n_norms if method == "ln_tuning" else 4 * base.config.num_hidden_layers)
    with torch.no_grad():
        before = adapted(input_ids=ids).logits
        for name, p in trainable:
            kept = p.clone()
            p.mul_(1.5)
            assert not torch.equal(adapted(input_ids=ids).logits, before), f"{name} does not reach the logits"
            p.copy_(kept)


def test_lora_fine_tunes_an_exported_run_and_every_saved_form_gives_its_logits(
        tmp_path: Path, trained_run: Path) -> None:
    """An exported run, adapted by ``Trainer``: only the adapter moves; the adapter folder reloaded onto a
    fresh base, and the merged model saved and reloaded (by transformers and by ``hybridnorm generate``),
    each give the fine-tuned model's logits and greedy text."""
    export_run(trained_run, tmp_path / "base")
    tok = AutoTokenizer.from_pretrained(tmp_path / "base")
    model = AutoModelForCausalLM.from_pretrained(tmp_path / "base")
    before = {k: v.detach().clone() for k, v in model.state_dict().items()}
    ids = tok(PROMPT, return_tensors="pt")["input_ids"]
    with torch.no_grad():
        base_logits = model.eval()(ids).logits
    adapted = get_peft_model(model, LoraConfig(r=4, lora_alpha=8, target_modules=["w_qkv", "w_o"]))
    with torch.no_grad():  # B starts at zero: the adapted model is the base model until it trains
        assert torch.equal(adapted(input_ids=ids).logits, base_logits)

    rows = [{"input_ids": (row := tok("In the beginning God created the heaven and the earth.")["input_ids"]),
             "labels": row}] * 8
    args = TrainingArguments(output_dir=str(tmp_path / "out"), per_device_train_batch_size=4, max_steps=6,
                             learning_rate=3e-2, logging_steps=1, report_to=[], save_strategy="no", use_cpu=True,
                             seed=0)
    trainer = Trainer(model=adapted, args=args, train_dataset=rows, data_collator=collate)
    trainer.train()
    losses = [h["loss"] for h in trainer.state.log_history if "loss" in h]
    assert losses[-1] < losses[0] - 0.1, losses
    for name, value in adapted.get_base_model().state_dict().items():
        if "lora_" not in name:  # the frozen weights did not move
            assert torch.equal(value, before[name.replace(".base_layer", "")]), name

    adapted.eval()
    with torch.no_grad():
        tuned = adapted(input_ids=ids).logits
    assert (tuned - base_logits).abs().max() > 1e-2
    greedy = dict(max_new_tokens=NEW, min_new_tokens=NEW, do_sample=False)
    want = adapted.generate(input_ids=ids, **greedy)

    adapted.save_pretrained(tmp_path / "adapter")  # the adapter alone, reloaded onto a fresh base
    assert (tmp_path / "adapter" / "adapter_model.safetensors").is_file()
    assert not (tmp_path / "adapter" / "model.safetensors").exists()
    reloaded = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(tmp_path / "base"),
                                         tmp_path / "adapter").eval()
    with torch.no_grad():
        assert torch.equal(reloaded(input_ids=ids).logits, tuned)

    merged_dir = tmp_path / "merged"  # our class again, the adapter folded in, saved as users save it
    adapted.merge_and_unload().save_pretrained(merged_dir)
    tok.save_pretrained(merged_dir)
    merged = AutoModelForCausalLM.from_pretrained(merged_dir).eval()
    assert type(merged).__name__ == "HybridNormForCausalLM"
    with torch.no_grad():
        torch.testing.assert_close(merged(ids).logits, tuned, rtol=1e-5, atol=1e-5)
    assert torch.equal(merged.generate(input_ids=ids, **greedy), want)
    # our own command line reads the merged folder as it reads an exported one: the same greedy text
    assert cli_generate(merged_dir, PROMPT) == tok.decode(want[0], skip_special_tokens=True)


def test_moe_experts_and_router_take_lora_and_merge_to_the_adapted_function() -> None:
    """On an MoE, ``all-linear`` wraps the router and the attention linears, and ``target_parameters``
    adapts the stacked expert weights (E, in, out) that are no ``nn.Linear``: the adapted model trains
    under gradient checkpointing with the plain step's adapter gradients, and PEFT's merge gives its logits."""
    base = make(moe=MoEConfig(num_experts=4, top_k=2, expert_hidden_size=16))
    ids = torch.randint(0, 97, (2, 12), generator=torch.Generator().manual_seed(4))
    cfg = LoraConfig(r=4, target_modules="all-linear", target_parameters=["ffn.w_in", "ffn.w_out"],
                     init_lora_weights=False)

    def adapter_grads(checkpointing: bool) -> tuple[torch.nn.Module, dict[str, torch.Tensor]]:
        torch.manual_seed(5)
        adapted = get_peft_model(copy.deepcopy(base), cfg)
        if checkpointing:
            adapted.gradient_checkpointing_enable()  # the name every supported transformers has (5.5 on)
        adapted.train()
        adapted(input_ids=ids, labels=ids).loss.backward()
        return adapted, {n: p.grad for n, p in adapted.named_parameters() if p.requires_grad}

    adapted, plain = adapter_grads(False)
    _, checkpointed = adapter_grads(True)
    wrapped = [getattr(mod, "parameter_name", None) or name.rsplit(".", 1)[-1]
               for name, mod in lora_layers(adapted).items()]  # a wrapped tensor goes by its parameter's name
    assert sorted(wrapped) == sorted(["w_qkv", "w_o", "router", "w_in", "w_out"] * 2)
    assert plain.keys() == checkpointed.keys() and all(g is not None and g.abs().sum() > 0 for g in plain.values())
    for n in plain:
        torch.testing.assert_close(checkpointed[n], plain[n], rtol=1e-5, atol=1e-7)

    adapted.eval()
    with torch.no_grad():
        got = adapted(input_ids=ids).logits
        assert (got - base.eval()(ids).logits).abs().max() > 1e-2
        torch.testing.assert_close(adapted.merge_and_unload()(ids).logits, got, rtol=1e-5, atol=1e-5)


def test_an_adapter_folder_given_as_a_model_says_what_it_is_and_how_to_merge_it(tmp_path: Path, capsys) -> None:
    """``save_pretrained`` of a PEFT model writes the adapter alone; each command that takes a model folder
    refuses it in one line that names it as an adapter and its base model, and writes nothing."""
    from bad_input_helpers import assert_refused

    make().save_pretrained(tmp_path / "base")
    adapter = tmp_path / "adapter"
    get_peft_model(AutoModelForCausalLM.from_pretrained(tmp_path / "base"),
                   LoraConfig(r=2, target_modules=["w_qkv"])).save_pretrained(adapter)
    needles = ["PEFT adapter folder", str(tmp_path / "base"), "merge_and_unload"]
    for argv in (["generate", str(adapter), "--prompt", "x"], ["eval", str(adapter)],
                 ["export", str(adapter), "--to", "hf", str(tmp_path / "out")],
                 ["import", str(adapter), "--out", str(tmp_path / "run")]):
        assert_refused(argv, capsys, needles, tmp_path)
        assert not (tmp_path / "out").exists() and not (tmp_path / "run").exists()


@torch.no_grad()
def test_lora_on_the_tied_head_acts_as_on_a_stock_tied_lm_head(tmp_path: Path) -> None:
    """The tied head is the module ``tied_head`` (no weight of its own): LoRA on it adapts the logits as LoRA on
    a stock tied ``lm_head`` does, and merging writes into the one shared weight, the embedding's, in both."""
    from test_hf_stock_seams import pair

    ours, theirs = pair(tmp_path, "llama")
    assert theirs.lm_head.weight is theirs.model.embed_tokens.weight  # the stock class ties by sharing it
    ids = torch.randint(0, 256, (2, 9), generator=torch.Generator().manual_seed(2))
    plain = ours(ids).logits
    ours = get_peft_model(ours, LoraConfig(r=2, target_modules=["tied_head"], init_lora_weights=False))
    theirs = get_peft_model(theirs, LoraConfig(r=2, target_modules=["lm_head"], init_lora_weights=False))
    for x, y in zip(lora_layers(ours).values(), lora_layers(theirs).values(), strict=True):
        y.lora_A["default"].weight.copy_(x.lora_A["default"].weight)
        y.lora_B["default"].weight.copy_(x.lora_B["default"].weight)
    adapted = ours(ids).logits
    assert (adapted - plain).abs().max() > 1e-2  # the adapter acts
    assert (adapted - theirs(ids).logits).abs().max() < 1e-5
    merged_ours, merged_theirs = ours.merge_and_unload(), theirs.merge_and_unload()
    assert (merged_ours(ids).logits - merged_theirs(ids).logits).abs().max() < 1e-5
