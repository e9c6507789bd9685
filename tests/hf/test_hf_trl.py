"""``HybridNormForCausalLM`` under TRL's trainers, through TRL's own entry points: ``SFTTrainer`` (padded,
packed without padding, completion-only, an MoE with TRL's router loss, TRL's default flags),
``DPOTrainer`` and ``GRPOTrainer``.

TRL never calls the model's own loss. Its fused LM head runs ``model.base_model(...)`` for the final hidden
states and applies ``get_output_embeddings()``'s weight and bias itself, and it takes any config that has
``output_router_logits`` for an MoE, weighting Mixtral's load-balancing loss by ``router_aux_loss_coef``.
So the oracles are: the stock transformers class with the same weights under the same trainer and flags
(every logged number, step by step; the second step's loss shows the first step's update), and, for
placements no stock class computes, the same documents packed into one row and padded apart.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

pytest.importorskip("trl", reason="TRL is not installed (it is in the dev extra)")
from datasets import Dataset
from test_hf_stock_parity import random_gains, tiny  # tests/hf/: the tiny configs and randomized gains
from test_hf_stock_seams import pair
from transformers import AutoModelForCausalLM, AutoTokenizer
from trl import DPOConfig, DPOTrainer, GRPOConfig, GRPOTrainer, SFTConfig, SFTTrainer

from hybridnorm import TransformerLM
from hybridnorm.config import MoEConfig
from hybridnorm.data.tokenizer import ByteTokenizer
from hybridnorm.hf import HybridNormForCausalLM
from hybridnorm.hf.export import export_model

TEXTS = ["In the beginning God created the heaven and the earth.", "And God said, Let there be light.",
         "And the evening and the morning were the first day.", "Jesus wept.",
         "And God saw the light, that it was good.", "The LORD is my shepherd; I shall not want.",
         "Blessed are the meek.", "And darkness was upon the face of the deep."]
# router-loss weight 0.02 (Mixtral's router_aux_loss_coef through the export): TRL adds its router loss
AUX_MOE = MoEConfig(num_experts=4, top_k=2, normalize_topk=True, lb_loss_weight=0.02, z_loss_weight=0.0)


def texts(mode: str) -> Dataset:
    if mode == "completion_only":  # the prompt's tokens are not scored
        return Dataset.from_list([{"prompt": t[:12], "completion": t[12:]} for t in TEXTS])
    return Dataset.from_list([{"text": t} for t in TEXTS])


def sgd(config_class: type, tmp: Path, **kw: object) -> object:
    """Two steps of plain SGD, each over the whole data set (lr 0.5, no clipping, fp32, no checkpointing);
    ``kw`` adds to or overrides these."""
    return config_class(**{**dict(output_dir=str(tmp), max_steps=2, per_device_train_batch_size=8, learning_rate=0.5,
                                  optim="sgd", lr_scheduler_type="constant", weight_decay=0.0, max_grad_norm=0.0,
                                  bf16=False, gradient_checkpointing=False, report_to=[], use_cpu=True,
                                  logging_steps=1, save_strategy="no", seed=0, data_seed=0), **kw})


def logged(trainer: object) -> list[dict]:
    """Each step's logged numbers (loss, TRL's metrics), trained."""
    trainer.train()
    steps = [{k: v for k, v in h.items() if k != "epoch" and "time" not in k} for h in trainer.state.log_history
             if "loss" in h]
    assert len(steps) == 2
    return steps


def assert_same_steps(a: list[dict], b: list[dict], rel: float = 1e-5, abs_tol: float = 1e-6) -> None:
    for x, y in zip(a, b, strict=True):
        assert x.keys() == y.keys()
        for k in x:
            assert x[k] == pytest.approx(y[k], rel=rel, abs=abs_tol), (k, x, y)


def sft(model: torch.nn.Module, folder: Path, mode: str) -> list[dict]:
    args = sgd(SFTConfig, folder / f"sft-{mode}", **(dict(packing=True, max_length=64) if mode == "packed" else {}))
    return logged(SFTTrainer(model=model, args=args, train_dataset=texts(mode),
                             processing_class=AutoTokenizer.from_pretrained(folder)))


@pytest.mark.parametrize(("case", "mode", "moe"), [
    ("llama", "padded", None), ("llama", "packed", None), ("llama", "completion_only", None),
    ("qwen3", "packed", None), ("olmo2", "padded", None),
    ("mixtral", "padded", AUX_MOE), ("mixtral", "packed", AUX_MOE)])
def test_sft_trains_as_the_stock_class_does(tmp_path: Path, case: str, mode: str, moe: MoEConfig | None) -> None:
    ours, theirs = pair(tmp_path, case, moe=moe)
    if moe is not None:
        with torch.no_grad():
            recorded = theirs.base_model(input_ids=torch.arange(8)[None], output_router_logits=True).router_logits
        if torch.allclose(recorded[0].sum(-1), torch.ones(())):
            pytest.skip("this transformers' Mixtral records its router's softmax as router_logits (5.5.0; later "
                        "releases record the logits, as ours does), so TRL's router loss differs for it")
    a, b = sft(ours, tmp_path / "ours", mode), sft(theirs, tmp_path / "stock", mode)
    assert_same_steps(a, b)
    assert ("aux_loss" in a[0]) == (moe is not None)  # TRL's router loss, on the MoE only
    assert a[1]["loss"] < a[0]["loss"]


def test_sft_with_trls_default_flags_trains_as_the_stock_class_does(tmp_path: Path) -> None:
    """SFTConfig's defaults: bf16 autocast, gradient checkpointing, fused AdamW at 2e-5 with a linear decay."""
    ours, theirs = pair(tmp_path, "llama")
    runs = []
    for model, folder in ((ours, tmp_path / "ours"), (theirs, tmp_path / "stock")):
        args = SFTConfig(output_dir=str(folder / "sft"), max_steps=2, report_to=[], use_cpu=True, logging_steps=1,
                         save_strategy="no")
        assert args.bf16 and args.gradient_checkpointing  # TRL's defaults: what this test is about
        runs.append(logged(SFTTrainer(model=model, args=args, train_dataset=texts("padded"),
                                      processing_class=AutoTokenizer.from_pretrained(folder))))
    assert_same_steps(*runs, rel=1e-2)  # bf16 matmuls in both, in different orders


def exported(tmp: Path, placement: str, moe: MoEConfig | None) -> Path:
    torch.manual_seed(0)
    lm = TransformerLM(tiny(placement, moe))
    random_gains(lm)
    export_model(lm, tmp / "ours", ByteTokenizer(), arch="hybridnorm")
    return tmp / "ours"


@pytest.mark.parametrize(("placement", "moe"), [("hybridnorm_star", None), ("resi_dual", None),
                                                ("hybridnorm_star", AUX_MOE)])
def test_sft_packed_documents_train_as_the_same_documents_padded(tmp_path: Path, placement: str,
                                                                  moe: MoEConfig | None) -> None:
    """No stock class computes these placements: packing the documents into one row without padding (TRL's
    padding-free batches: position_ids restart per document, no attention mask) must train as the same
    documents padded apart, so no document sees another's tokens."""
    folder = exported(tmp_path, placement, moe)
    padded, packed = (sft(HybridNormForCausalLM.from_pretrained(folder), folder, mode) for mode in ("padded", "packed"))
    # the ratio of the token counts Trainer divides by, padded to packed, from the stock class: 1 on the pinned
    # release; transformers 5.5.0 counts the padded rows' unshifted labels, so it scales the first step's loss
    # and gradient (and, through the update, everything after it)
    pair(tmp_path / "llama", "llama")
    stock = tmp_path / "llama" / "stock"
    stock_padded, stock_packed = (sft(AutoModelForCausalLM.from_pretrained(stock), stock, mode)[0]["loss"]
                                  for mode in ("padded", "packed"))
    ratio = stock_packed / stock_padded
    if ratio == pytest.approx(1.0, rel=1e-6):
        assert_same_steps(padded, packed, rel=1e-5)
    else:  # the first step alone: its token loss rescaled (TRL adds the router loss, a mean, unscaled)
        def token_loss(step: dict) -> float:
            return step["loss"] - (moe.lb_loss_weight * step["aux_loss"] if moe else 0.0)

        assert token_loss(packed[0]) == pytest.approx(ratio * token_loss(padded[0]), rel=1e-5)
        for key in ("entropy", "mean_token_accuracy", "aux_loss"):
            assert packed[0].get(key) == pytest.approx(padded[0].get(key), rel=1e-5), key


def test_dpo_trains_as_the_stock_class_does(tmp_path: Path) -> None:
    pairs = Dataset.from_list([{"prompt": t[:12], "chosen": t[12:], "rejected": t[12:][::-1]} for t in TEXTS])
    runs = []
    for model, folder in zip(pair(tmp_path, "llama"), (tmp_path / "ours", tmp_path / "stock"), strict=True):
        trainer = DPOTrainer(model=model, args=sgd(DPOConfig, folder / "dpo", beta=0.5), train_dataset=pairs,
                             processing_class=AutoTokenizer.from_pretrained(folder))
        runs.append(logged(trainer))
    assert_same_steps(*runs, rel=1e-4)
    assert runs[0][1]["loss"] < runs[0][0]["loss"]


def test_grpo_samples_scores_and_trains_as_the_stock_class_does(tmp_path: Path) -> None:
    """GRPO generates its completions (``generate()`` with sampling, under one seed), scores them with a
    reward function and trains on them: the same tokens, rewards and losses for ours and the stock class."""
    completions: dict[str, list[str]] = {"ours": [], "stock": []}
    runs = []
    for model, name in zip(pair(tmp_path, "llama"), completions, strict=True):
        def reward(completions: list[str], _seen: list[str] = completions[name], **_: object) -> list[float]:
            _seen.extend(completions)
            return [float(len(set(c))) for c in completions]  # varies between samples: a nonzero advantage
        args = sgd(GRPOConfig, tmp_path / name / "grpo", num_generations=4, max_completion_length=8)
        trainer = GRPOTrainer(model=model, reward_funcs=reward, args=args,
                              train_dataset=Dataset.from_list([{"prompt": t[:12]} for t in TEXTS]),
                              processing_class=AutoTokenizer.from_pretrained(tmp_path / name))
        runs.append(logged(trainer))
    assert completions["ours"] == completions["stock"] and len(set(completions["ours"])) > 1
    assert_same_steps(*runs, rel=1e-4)
    assert runs[0][0]["reward_std"] > 0 and runs[0][0]["grad_norm"] > 0  # it trained on something


@pytest.mark.parametrize("moe", [None, AUX_MOE], ids=["dense", "moe"])
def test_a_model_saved_by_sft_loads_back_unchanged(tmp_path: Path, moe: MoEConfig | None) -> None:
    """What a user does next: ``trainer.save_model()`` and load the folder again. The weights and the config
    (an MoE's router-loss weight, a dense model's lack of MoE fields) come back as trained."""
    folder = exported(tmp_path, "hybridnorm_star", moe)
    model = HybridNormForCausalLM.from_pretrained(folder)
    trainer = SFTTrainer(model=model, args=sgd(SFTConfig, tmp_path / "sft"), train_dataset=texts("padded"),
                         processing_class=AutoTokenizer.from_pretrained(folder))
    trainer.train()
    trainer.save_model(str(tmp_path / "tuned"))
    back = AutoModelForCausalLM.from_pretrained(tmp_path / "tuned").eval()
    ids = torch.randint(0, 256, (2, 12), generator=torch.Generator().manual_seed(5))
    with torch.no_grad():
        assert torch.equal(back(ids).logits, model.eval()(ids).logits)
        assert not torch.equal(back(ids).logits, HybridNormForCausalLM.from_pretrained(folder)(ids).logits)
    assert back.config.model_config() == model.config.model_config()
    assert hasattr(back.config, "router_aux_loss_coef") == (moe is not None)


def test_sft_with_a_lora_adapter_trains_the_adapter_alone_checkpointed_or_not(tmp_path: Path) -> None:
    """``SFTTrainer(..., peft_config=LoraConfig(target_modules="all-linear"))``: only the adapter's weights
    move, and TRL's default gradient checkpointing gives the same steps as none."""
    from peft import LoraConfig

    folder = exported(tmp_path, "hybridnorm_star", None)
    base = HybridNormForCausalLM.from_pretrained(folder).state_dict()
    runs = []
    for checkpointing in (False, True):
        args = sgd(SFTConfig, tmp_path / f"sft-{checkpointing}", gradient_checkpointing=checkpointing)
        trainer = SFTTrainer(model=HybridNormForCausalLM.from_pretrained(folder), args=args,
                             train_dataset=texts("padded"), processing_class=AutoTokenizer.from_pretrained(folder),
                             peft_config=LoraConfig(r=4, lora_alpha=8, target_modules="all-linear"))
        runs.append(logged(trainer))
        tuned = trainer.model.get_base_model().state_dict()
        frozen = {k.replace(".base_layer", ""): v for k, v in tuned.items() if "lora_" not in k}
        assert frozen.keys() == base.keys() and all(torch.equal(frozen[k], base[k]) for k in base)
    assert_same_steps(*runs)
    assert runs[0][1]["loss"] < runs[0][0]["loss"]
