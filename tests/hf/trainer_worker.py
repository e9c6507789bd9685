"""One transformers ``Trainer`` run of a tiny ``HybridNormForCausalLM`` (the worker that
test_hf_trainer_torchrun.py starts alone and under ``torchrun``): 4 optimizer steps over 8 ragged samples
per step, then one line ``LOSSES [...]`` (the logged losses) from rank 0.

argv: PLACEMENT MODE [MOE]; MODE is ``single``, ``ddp`` or ``fsdp2`` (accelerate's FSDP2, wrapping each
``HybridNormDecoderLayer``, the class ``_no_split_modules`` names)."""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from test_hf_trainer import collate, make, ragged_samples
from transformers import Trainer, TrainingArguments

from hybridnorm.config import MoEConfig


def main(placement: str, mode: str, moe: bool) -> None:
    # an MoE's router losses depend on how the batch is split (computed per micro-batch, as Mixtral's): 0 here
    extra = dict(tie_embeddings=False, moe=MoEConfig(num_experts=4, top_k=2, lb_loss_weight=0.0,
                                                     z_loss_weight=0.0)) if moe else {}
    model = make(placement, **extra)
    world = int(os.environ.get("WORLD_SIZE", "1"))
    fsdp = dict(fsdp="full_shard auto_wrap", fsdp_config={"transformer_layer_cls_to_wrap": ["HybridNormDecoderLayer"],
                                                          "version": 2}) if mode == "fsdp2" else {}
    args = TrainingArguments(output_dir=os.environ["OUT"], per_device_train_batch_size=8 // world, max_steps=4,
                             learning_rate=1e-2, optim="adamw_torch", lr_scheduler_type="constant", logging_steps=1,
                             report_to=[], save_strategy="no", use_cpu=True, seed=0, data_seed=0, **fsdp)
    trainer = Trainer(model=model, args=args, train_dataset=ragged_samples() * 4, data_collator=collate)
    trainer._get_train_sampler = lambda *a, **k: torch.utils.data.SequentialSampler(trainer.train_dataset)
    trainer.train()
    if int(os.environ.get("RANK", "0")) == 0:
        print("LOSSES", json.dumps([h["loss"] for h in trainer.state.log_history if "loss" in h]), flush=True)


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2], len(sys.argv) > 3 and sys.argv[3] == "moe")
