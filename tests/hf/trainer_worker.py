"""Transformers ``Trainer`` (and TRL ``SFTTrainer``) runs of a tiny ``HybridNormForCausalLM`` (the worker that
test_hf_trainer_torchrun.py starts alone and under ``torchrun``): for each variant, 4 optimizer steps over 8
ragged samples per step, then one line ``LOSSES VARIANT [...]`` (the logged losses) from rank 0. The variants
run one after another in the same processes (one launch each way: the launches, not the steps, take the time).

argv: MODE VARIANT...; MODE is ``single``, ``ddp`` or ``fsdp2`` (accelerate's FSDP2, wrapping each
``HybridNormDecoderLayer``, the class ``_no_split_modules`` names); VARIANT is ``lm`` (HybridNorm*), ``moe``
(HybridNorm with 4 experts), ``sft`` (TRL's SFTTrainer on the same samples, tokenized already, padded by TRL's
own collator; its fused LM head computes the loss) or ``seqcls`` (an untied
``HybridNormForSequenceClassification``, 3 classes, one label per sample, with gradient checkpointing, under
which Trainer asks DDP to find no unused parameters: every weight must get a gradient)."""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from test_hf_trainer import V, collate, make, ragged_samples
from transformers import Trainer, TrainingArguments

from hybridnorm.config import MoEConfig
from hybridnorm.hf import HybridNormConfig, HybridNormForSequenceClassification


def classifier(placement: str) -> tuple[HybridNormForSequenceClassification, list[dict], object]:
    """The model, the samples (label: the length mod 3) and their collator (right-padded with id V)."""
    torch.manual_seed(0)
    mc = make(placement, vocab_size=V + 1, tie_embeddings=False).model.config
    model = HybridNormForSequenceClassification(HybridNormConfig.from_model_config(mc, num_labels=3, pad_token_id=V))
    rows = [{"input_ids": r["input_ids"], "labels": len(r["input_ids"]) % 3} for r in ragged_samples()]

    def collate_rows(batch: list[dict]) -> dict[str, torch.Tensor]:
        padded = collate([{"input_ids": r["input_ids"], "labels": r["input_ids"]} for r in batch])
        ids = padded["input_ids"].masked_fill(padded["attention_mask"] == 0, V)
        return {"input_ids": ids, "attention_mask": padded["attention_mask"],
                "labels": torch.tensor([r["labels"] for r in batch])}

    return model, rows, collate_rows


VARIANTS = {"lm": "hybridnorm_star", "moe": "hybridnorm", "sft": "hybridnorm_star", "seqcls": "hybridnorm_star"}


def losses(mode: str, variant: str) -> list[float]:
    placement, moe, sft, seqcls = VARIANTS[variant], variant == "moe", variant == "sft", variant == "seqcls"
    # an MoE's router losses depend on how the batch is split (computed per micro-batch, as Mixtral's): 0 here
    extra = dict(tie_embeddings=False, moe=MoEConfig(num_experts=4, top_k=2, lb_loss_weight=0.0,
                                                     z_loss_weight=0.0)) if moe else {}
    if sft:
        extra["vocab_size"] = 257  # the byte tokenizer's ids, its pad id (256) included
    model = make(placement, **extra)
    world = int(os.environ.get("WORLD_SIZE", "1"))
    fsdp = dict(fsdp="full_shard auto_wrap", fsdp_config={"transformer_layer_cls_to_wrap": ["HybridNormDecoderLayer"],
                                                          "version": 2}) if mode == "fsdp2" else {}
    common = dict(output_dir=os.path.join(os.environ["OUT"], variant), per_device_train_batch_size=8 // world,
                  max_steps=4, learning_rate=1e-2, optim="adamw_torch", lr_scheduler_type="constant", logging_steps=1,
                  report_to=[], save_strategy="no", use_cpu=True, seed=0, data_seed=0, **fsdp)
    if sft:
        from datasets import Dataset
        from trl import SFTConfig, SFTTrainer

        from hybridnorm.data.tokenizer import ByteTokenizer
        from hybridnorm.hf.export import hf_tokenizer

        rows = Dataset.from_list([{"input_ids": r["input_ids"]} for r in ragged_samples() * 4])
        trainer = SFTTrainer(model=model, args=SFTConfig(**common, bf16=False, gradient_checkpointing=False),
                             train_dataset=rows, processing_class=hf_tokenizer(ByteTokenizer()))
    elif seqcls:
        model, rows, collate_rows = classifier(placement)
        trainer = Trainer(model=model, args=TrainingArguments(**common, gradient_checkpointing=True),
                          train_dataset=rows * 4, data_collator=collate_rows)
    else:
        trainer = Trainer(model=model, args=TrainingArguments(**common), train_dataset=ragged_samples() * 4,
                          data_collator=collate)
    trainer._get_train_sampler = lambda *a, **k: torch.utils.data.SequentialSampler(trainer.train_dataset)
    trainer.train()
    return [h["loss"] for h in trainer.state.log_history if "loss" in h]


if __name__ == "__main__":
    for name in sys.argv[2:]:
        got = losses(sys.argv[1], name)
        if int(os.environ.get("RANK", "0")) == 0:
            print("LOSSES", name, json.dumps(got), flush=True)
