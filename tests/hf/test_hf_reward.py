"""Reward models over any placement, through the tools that make and use them: TRL's ``RewardTrainer``
(given the model, or given an exported LM folder as a path, which it loads as
``AutoModelForSequenceClassification`` with ``num_labels=1``), a reward model scoring ``GRPOTrainer``'s
samples, transformers' ``pipeline("text-classification")``, and a fresh interpreter that loads and saves
it with ``trust_remote_code=True`` alone.

The oracle is the stock class with the same weights under the same tool: every logged number, step by step.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
import torch

pytest.importorskip("trl", reason="TRL is not installed (it is in the dev extra)")
from datasets import Dataset
from test_hf_heads import exported
from test_hf_trl import TEXTS, assert_same_steps, logged, sgd
from transformers import AutoModelForSequenceClassification, AutoTokenizer, pipeline
from trl import GRPOConfig, GRPOTrainer, RewardConfig, RewardTrainer

from hybridnorm.hf import HybridNormForSequenceClassification

PREFERENCES = Dataset.from_list([{"chosen": t, "rejected": t[::-1]} for t in TEXTS])


def reward_models(tmp: Path, case: str = "llama") -> tuple[torch.nn.Module, torch.nn.Module]:
    """Ours and the stock reward model (num_labels=1) over the same LM; the stock score head copied into ours."""
    ours_folder, stock_folder = exported(tmp, case)
    theirs = AutoModelForSequenceClassification.from_pretrained(stock_folder, num_labels=1)
    ours = AutoModelForSequenceClassification.from_pretrained(ours_folder, num_labels=1)
    assert type(ours) is HybridNormForSequenceClassification
    with torch.no_grad():
        ours.score.weight.copy_(theirs.score.weight)
    return ours, theirs


@pytest.mark.parametrize("case", ["llama", "qwen3"])
def test_reward_trainer_trains_as_the_stock_class_does(tmp_path: Path, case: str) -> None:
    runs = []
    for model, name in zip(reward_models(tmp_path, case), ("ours", "stock"), strict=True):
        trainer = RewardTrainer(model=model, args=sgd(RewardConfig, tmp_path / name / "rm"),
                                train_dataset=PREFERENCES,
                                processing_class=AutoTokenizer.from_pretrained(tmp_path / name))
        runs.append(logged(trainer))
    assert_same_steps(*runs, rel=1e-4)
    assert runs[0][1]["loss"] < runs[0][0]["loss"] and runs[0][1]["accuracy"] > 0


def test_reward_trainer_with_trls_default_flags_trains_as_the_stock_class_does(tmp_path: Path) -> None:
    runs = []
    for model, name in zip(reward_models(tmp_path), ("ours", "stock"), strict=True):
        args = RewardConfig(output_dir=str(tmp_path / name / "rm"), max_steps=2, report_to=[], use_cpu=True,
                            logging_steps=1, save_strategy="no")
        assert args.bf16 and args.gradient_checkpointing  # TRL's defaults: what this test is about
        runs.append(logged(RewardTrainer(model=model, args=args, train_dataset=PREFERENCES,
                                         processing_class=AutoTokenizer.from_pretrained(tmp_path / name))))
    # bf16 matmuls in both, in different orders: rewards near 0.1 came out 3 bf16 steps apart (one is 2**-11 there)
    assert_same_steps(*runs, rel=1e-2, abs_tol=5e-3)


def test_reward_trainer_given_an_exported_folder_trains_our_class(tmp_path: Path) -> None:
    """RewardTrainer("exported/"): TRL loads the folder as AutoModelForSequenceClassification itself (its
    seed set first, so the score head it draws is reproducible), for ours as for the stock class."""
    runs = []
    for name in exported(tmp_path, "llama"):  # (ours, stock): the folders
        trainer = RewardTrainer(model=str(name), args=sgd(RewardConfig, name / "rm"), train_dataset=PREFERENCES)
        assert trainer.model.config.num_labels == 1
        runs.append((type(trainer.model).__name__, logged(trainer)))
    assert [r[0] for r in runs] == ["HybridNormForSequenceClassification", "LlamaForSequenceClassification"]
    # the two classes draw their heads differently (ours as the scheme draws the LM head), so the numbers
    # differ; each trains
    for _, steps in runs:
        assert steps[1]["loss"] < steps[0]["loss"]


def test_a_reward_model_scores_grpos_samples_as_the_stock_class_does(tmp_path: Path) -> None:
    """GRPO samples completions from a policy and scores them with a reward model (TRL pads and calls it
    itself): with our reward model or the stock one, the same rewards, advantages and steps."""
    policy_folder = exported(tmp_path / "policy", "llama")[1]  # one stock policy for both runs
    runs = []
    for model, name in zip(reward_models(tmp_path / "rm", "qwen3"), ("ours", "stock"), strict=True):
        args = sgd(GRPOConfig, tmp_path / name / "grpo", num_generations=4, max_completion_length=8)
        trainer = GRPOTrainer(model=str(policy_folder), reward_funcs=model, args=args,
                              train_dataset=Dataset.from_list([{"prompt": t[:12]} for t in TEXTS]),
                              reward_processing_classes=AutoTokenizer.from_pretrained(tmp_path / "rm" / name))
        torch.manual_seed(0)
        # TRL logs each reward model's numbers under its folder's name: one name for both
        runs.append([{k.replace(f"/{name}/", "/rm/"): v for k, v in step.items()} for step in logged(trainer)])
    assert_same_steps(*runs, rel=1e-4)
    assert runs[0][0]["reward_std"] > 0  # the reward model told the samples apart


def test_the_text_classification_pipeline_gives_the_stock_classs_scores(tmp_path: Path) -> None:
    ours, theirs = reward_models(tmp_path, "qwen3")
    for m in (ours, theirs):
        m.config.problem_type = "single_label_classification"  # a softmax over one label is 1: use the score
    results = [pipeline("text-classification", model=m, tokenizer=AutoTokenizer.from_pretrained(tmp_path / name),
                        function_to_apply="none")(TEXTS[:4])
               for m, name in ((ours, "ours"), (theirs, "stock"))]
    for a, b in zip(*results, strict=True):
        assert a["label"] == b["label"] and a["score"] == pytest.approx(b["score"], abs=1e-5)


def test_trust_remote_code_loads_saves_and_loads_a_reward_model_again(tmp_path: Path) -> None:
    """A fresh interpreter, no ``import hybridnorm.hf``: the exported LM loads as our reward model through the
    folder's auto_map; saved, its folder loads the same way with the same scores."""
    folder, _ = exported(tmp_path, "llama")
    script = (
        "import sys, torch\n"
        "from transformers import AutoModelForSequenceClassification as A\n"
        f"m = A.from_pretrained({str(folder)!r}, num_labels=1, pad_token_id=256, trust_remote_code=True).eval()\n"
        f"m.save_pretrained({str(tmp_path / 'rm')!r})\n"
        f"back = A.from_pretrained({str(tmp_path / 'rm')!r}, trust_remote_code=True).eval()\n"
        "assert 'hybridnorm.hf' in sys.modules and type(back).__name__ == 'HybridNormForSequenceClassification'\n"
        "ids = torch.arange(24).view(2, 12)\n"
        "with torch.no_grad():\n"
        "    assert torch.equal(m(ids).logits, back(ids).logits)\n"
        "print('ok')\n")
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=300, cwd=tmp_path)
    assert done.returncode == 0 and done.stdout.strip().endswith("ok"), done.stderr[-2000:]
    assert sorted(p.name for p in (tmp_path / "rm").glob("*.py")) == ["modeling_hybridnorm.py"]


def test_reward_trainer_with_a_lora_adapter_trains_the_adapter_and_the_score_alone(tmp_path: Path) -> None:
    """``RewardTrainer(..., peft_config=LoraConfig(task_type="SEQ_CLS", target_modules="all-linear"))``: PEFT
    finds the head by its name (``score``) and trains it whole beside the adapter; nothing else moves."""
    from peft import LoraConfig

    ours, _ = reward_models(tmp_path)
    before = {n: p.detach().clone() for n, p in ours.named_parameters()}
    trainer = RewardTrainer(model=ours, args=sgd(RewardConfig, tmp_path / "lora"), train_dataset=PREFERENCES,
                            processing_class=AutoTokenizer.from_pretrained(tmp_path / "ours"),
                            peft_config=LoraConfig(task_type="SEQ_CLS", target_modules="all-linear", r=4))
    steps = logged(trainer)
    assert steps[1]["loss"] < steps[0]["loss"]
    merged = trainer.model.merge_and_unload()
    changed = {n for n, p in merged.named_parameters() if not torch.equal(p, before[n])}
    assert "score.weight" in changed and changed - {"score.weight"}  # the head, and the adapted linears merged
    assert all(n.endswith(("w_qkv.weight", "w_o.weight", "w_in.weight", "w_out.weight", "score.weight"))
               for n in changed)
