"""``HybridNormForCausalLM`` under transformers' ``Trainer`` and training features, through their own entry
points: gradient accumulation gives one big batch's loss and gradients (``num_items_in_batch``), and so do
padding-free batches (``DataCollatorWithFlattening``); gradient checkpointing gives the plain step's,
``resize_token_embeddings`` survives save/load, and Trainer's own checkpoints resume to the straight run's
weights."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

pytest.importorskip("transformers", reason="the hf extra (transformers) is not installed")
pytest.importorskip("accelerate", reason="Trainer needs accelerate (in the dev extra)")
import transformers
from transformers import AutoModelForCausalLM, DataCollatorWithFlattening, Trainer, TrainingArguments

import hybridnorm.hf  # noqa: F401  (registers the Auto classes)
from hybridnorm import ModelConfig
from hybridnorm.config import MoEConfig
from hybridnorm.hf import HybridNormConfig, HybridNormForCausalLM

V = 97


def make(placement: str = "hybridnorm_star", seed: int = 0, **kw) -> HybridNormForCausalLM:
    torch.manual_seed(seed)
    mc = ModelConfig(**{**dict(vocab_size=V, d_model=32, n_layers=2, n_heads=4, n_kv_heads=2, ffn_hidden_size=48,
                                max_seq_len=64, placement=placement), **kw})
    return HybridNormForCausalLM(HybridNormConfig.from_model_config(mc))


def ragged_samples(n: int = 8, seed: int = 1) -> list[dict[str, list[int]]]:
    """Sequences of very different lengths: a mean of per-micro-batch means would weight their tokens
    differently from one batch's mean, so only correct num_items_in_batch handling matches."""
    g = torch.Generator().manual_seed(seed)
    lengths = [3, 17, 5, 24, 9, 2, 30, 11][:n]
    return [{"input_ids": (ids := torch.randint(0, V, (n_tok,), generator=g).tolist()), "labels": ids}
            for n_tok in lengths]


def collate(rows: list[dict[str, list[int]]]) -> dict[str, torch.Tensor]:
    """Right-pad to the longest row; padded labels are -100 (not scored), padded inputs masked."""
    T = max(len(r["input_ids"]) for r in rows)
    ids = torch.zeros(len(rows), T, dtype=torch.long)
    labels = torch.full((len(rows), T), -100)
    mask = torch.zeros(len(rows), T, dtype=torch.long)
    for i, r in enumerate(rows):
        n = len(r["input_ids"])
        ids[i, :n], labels[i, :n], mask[i, :n] = torch.tensor(r["input_ids"]), torch.tensor(r["labels"]), 1
    return {"input_ids": ids, "labels": labels, "attention_mask": mask}


def one_trainer_step(tmp: Path, model: torch.nn.Module, batch: int, accum: int, collator: object = collate,
                     **args: object) -> tuple[float, dict]:
    """One optimizer step of plain SGD (lr 1, no clipping, no decay): the update is minus the gradient."""
    before = {k: v.detach().clone() for k, v in model.named_parameters()}
    args = TrainingArguments(output_dir=str(tmp), per_device_train_batch_size=batch, gradient_accumulation_steps=accum,
                             max_steps=1, learning_rate=1.0, optim="sgd", lr_scheduler_type="constant",
                             weight_decay=0.0, max_grad_norm=0.0, logging_steps=1, report_to=[], save_strategy="no",
                             use_cpu=True, dataloader_drop_last=False, seed=0, data_seed=0, **args)
    trainer = Trainer(model=model, args=args, train_dataset=ragged_samples(), data_collator=collator)
    trainer.train_dataset_sampler = None
    trainer._get_train_sampler = lambda *a, **k: torch.utils.data.SequentialSampler(trainer.train_dataset)
    trainer.train()
    loss = next(h["loss"] for h in trainer.state.log_history if "loss" in h)
    grads = {k: before[k] - v.detach() for k, v in model.named_parameters()}
    return loss, grads


def stock_llama(*_: object) -> torch.nn.Module:
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    return LlamaForCausalLM(LlamaConfig(vocab_size=V, hidden_size=32, intermediate_size=48, num_hidden_layers=2,
                                        num_attention_heads=4, num_key_value_heads=2))


def pinned_transformers() -> str:
    """The transformers version constraints.txt pins (the one `make test` installs)."""
    lines = (Path(__file__).resolve().parents[2] / "constraints.txt").read_text(encoding="utf-8").splitlines()
    return next(line.split("==")[1] for line in lines if line.startswith("transformers=="))


@pytest.mark.parametrize("placement", ["hybridnorm_star", "post"])
def test_gradient_accumulation_equals_one_big_batch(tmp_path: Path, placement: str) -> None:
    """8 ragged samples as 1 x 8 and as 4 micro-batches of 2: same logged loss, same gradients. The same
    Trainer on a stock LlamaForCausalLM is the oracle for what it does to any model's gradients under
    accumulation (transformers 5.5.0 with accelerate 1.15 scales them by 1/4 for every model): ours must
    match; on the pinned release that ratio is exactly 1."""
    big_loss, big = one_trainer_step(tmp_path / "a", make(placement), batch=8, accum=1)
    acc_loss, acc = one_trainer_step(tmp_path / "b", make(placement), batch=2, accum=4)
    # the reference: the 8 samples' summed token loss in one plain forward, over the number of items Trainer
    # counts: the scored (shifted) labels since transformers 5.2x, every label before (5.5 counts 101, not 93)
    batch = collate(ragged_samples())
    ref = make(placement)
    with torch.no_grad():
        scored = (batch["labels"][:, 1:] != -100).sum().item()
        total = ref(**batch).loss.item() * scored
    assert any(big_loss == pytest.approx(total / n, rel=1e-4) for n in (scored, (batch["labels"] != -100).sum()))
    assert acc_loss == pytest.approx(big_loss, rel=1e-4)  # was 4x too large before num_items_in_batch
    _, llama_big = one_trainer_step(tmp_path / "c", stock_llama(), batch=8, accum=1)
    _, llama_acc = one_trainer_step(tmp_path / "d", stock_llama(), batch=2, accum=4)
    key = "model.embed_tokens.weight"
    ratio = round((llama_acc[key].norm() / llama_big[key].norm()).item(), 3)
    if transformers.__version__ == pinned_transformers():
        assert ratio == 1.0
    for k in big:
        assert torch.allclose(acc[k], ratio * big[k], rtol=1e-4, atol=1e-6), k
    assert any(g.abs().max() > 0 for g in big.values())


@pytest.mark.parametrize("placement", ["hybridnorm_star", "resi_dual"])
def test_padding_free_batches_of_transformers_flattening_collator_equal_padded_ones(tmp_path: Path,
                                                                                    placement: str) -> None:
    """``DataCollatorWithFlattening`` packs the samples into one row with no padding and no mask, positions
    restarting per sample: each sample must see only itself (transformers' mask builder finds the documents
    from the positions; Trainer runs without a cache), so the logged loss and every gradient equal the padded
    batch's."""
    padded_loss, padded = one_trainer_step(tmp_path / "a", make(placement), batch=8, accum=1)
    flat_loss, flat = one_trainer_step(tmp_path / "b", make(placement), batch=8, accum=1,
                                       collator=DataCollatorWithFlattening())
    # the ratio of the token counts Trainer divides by, from the stock class under the same two collators: 1
    # on the pinned release; transformers 5.5.0 counts the padded batch's unshifted labels (101, not 93)
    ratio = (one_trainer_step(tmp_path / "c", stock_llama(), 8, 1, collator=DataCollatorWithFlattening())[0]
             / one_trainer_step(tmp_path / "d", stock_llama(), 8, 1)[0])
    if transformers.__version__ == pinned_transformers():
        assert ratio == pytest.approx(1.0, rel=1e-6)
    assert flat_loss == pytest.approx(ratio * padded_loss, rel=1e-5)
    for k in padded:
        assert torch.allclose(flat[k], ratio * padded[k], rtol=1e-4, atol=1e-6), k


@pytest.mark.parametrize("accum", [1, 4])
def test_label_smoothing_scores_the_next_token_as_for_a_stock_model(tmp_path: Path, accum: int) -> None:
    """With ``label_smoothing_factor``, Trainer computes the loss from the logits itself and shifts the labels
    only for a class named in transformers' table of causal LMs; ``import hybridnorm.hf`` names ours there.
    Oracle: the same Trainer step on stock ``LlamaForCausalLM`` with the same weights (a Pre-Norm model
    exports to it exactly). Before, ours was scored against its own input tokens: 4.34 where Llama gives 4.86."""
    from hybridnorm.hf.export import export_model

    ours = make("pre")
    assert export_model(ours.model, tmp_path / "llama").class_name == "LlamaForCausalLM"
    llama = transformers.LlamaForCausalLM.from_pretrained(tmp_path / "llama")
    loss, update = one_trainer_step(tmp_path / "a", ours, 8 // accum, accum, label_smoothing_factor=0.1)
    loss_ref, update_ref = one_trainer_step(tmp_path / "b", llama, 8 // accum, accum, label_smoothing_factor=0.1)
    assert loss == pytest.approx(loss_ref, rel=1e-5)
    # the premise: the equality above tells smoothing from none (on a near-uniform random model the two differ
    # by ~1e-4 relative, how much depends on the torch build; rel=1e-3 here failed on torch 2.9)
    assert loss != pytest.approx(one_trainer_step(tmp_path / "c", make("pre"), 8 // accum, accum)[0], rel=1e-5)
    key, ref_key = "model.embed.weight", "model.embed_tokens.weight"
    assert torch.allclose(update[key], update_ref[ref_key], rtol=1e-4, atol=1e-6)


def test_moe_router_loss_adds_up_over_accumulated_micro_batches() -> None:
    """With num_items_in_batch, each micro-batch's router losses are weighted by its share of the scored
    tokens: the micro-batch losses then sum to the token-weighted mean that a Trainer step optimizes."""
    model = make("hybridnorm", tie_embeddings=False,
                 moe=MoEConfig(num_experts=4, top_k=2, lb_loss_weight=0.5, z_loss_weight=0.1)).eval()
    rows = ragged_samples()
    full = collate(rows)
    n_items = (full["labels"][:, 1:] != -100).sum()
    total, parts = torch.zeros(()), []
    with torch.no_grad():
        for i in range(0, 8, 2):
            b = collate(rows[i:i + 2])
            out = model(**b, num_items_in_batch=n_items)
            scored = (b["labels"][:, 1:] != -100).sum()
            mean_loss = model(**b).loss  # token mean + the router losses at full weight
            aux = model.model.aux_losses()["aux_loss"]
            assert aux > 0
            lm_sum = (mean_loss - aux) * scored  # this micro-batch's summed token loss
            parts.append((lm_sum + aux * scored) / n_items)
            total = total + out.loss
    assert total.item() == pytest.approx(sum(parts).item(), rel=1e-5)


@pytest.mark.parametrize("reentrant", [True, False])
@pytest.mark.parametrize("placement", ["hybridnorm_star", "pre"])
def test_gradient_checkpointing_equals_the_plain_step(placement: str, reentrant: bool) -> None:
    from transformers.modeling_layers import GradientCheckpointingLayer

    batch = collate(ragged_samples())
    plain, ckpt = make(placement).train(), make(placement).train()
    assert all(isinstance(b, GradientCheckpointingLayer) for b in ckpt.model.blocks)
    ckpt.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": reentrant})
    assert ckpt.is_gradient_checkpointing
    calls = []  # attention-kernel calls: each block's runs twice when it is recomputed in backward
    for b in ckpt.model.blocks:
        b.attn.inner.register_forward_hook(lambda *_: calls.append(1))
    loss_c = ckpt(**batch).loss
    loss_c.backward()
    loss_p = plain(**batch).loss
    loss_p.backward()
    assert len(calls) == 2 * len(ckpt.model.blocks)
    assert loss_c.item() == loss_p.item()
    for (name, p), q in zip(plain.named_parameters(), ckpt.parameters(), strict=True):
        assert torch.equal(p.grad, q.grad), name
    ckpt.gradient_checkpointing_disable()
    calls.clear()
    ckpt(**batch).loss.backward()
    assert len(calls) == len(ckpt.model.blocks)


def test_gradient_checkpointing_gives_moe_router_losses_their_gradients() -> None:
    """Even when use_reentrant=True is asked for: the router losses leave the block beside its output."""
    kw = dict(tie_embeddings=False, moe=MoEConfig(num_experts=4, top_k=2, lb_loss_weight=0.5, z_loss_weight=0.1))
    plain, ckpt = make("hybridnorm", **kw).train(), make("hybridnorm", **kw).train()
    ckpt.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": True})
    batch = collate(ragged_samples())
    plain(**batch).loss.backward()
    ckpt(**batch).loss.backward()
    for (name, p), q in zip(plain.named_parameters(), ckpt.parameters(), strict=True):
        assert torch.allclose(p.grad, q.grad, atol=1e-7), name
    assert ckpt.model.blocks[0].ffn.router.weight.grad.abs().max() > 0


def test_resize_token_embeddings_survives_save_and_load(tmp_path: Path) -> None:
    model = make("hybridnorm", tie_embeddings=False).eval()
    model.resize_token_embeddings(V + 11)
    assert model.config.vocab_size == V + 11
    assert model.get_input_embeddings().weight.shape[0] == V + 11
    assert model.get_output_embeddings().weight.shape[0] == V + 11
    ids = torch.tensor([[V + 3, 5, V + 10, 7]])
    with torch.no_grad():
        before = model(ids).logits
    assert before.shape[-1] == V + 11
    model.save_pretrained(tmp_path)
    back = AutoModelForCausalLM.from_pretrained(tmp_path).eval()
    assert back.config.model_config().embedding_size == V + 11
    with torch.no_grad():
        assert torch.equal(back(ids).logits, before)


@pytest.mark.parametrize("kw", [{}, {"tie_embeddings": False, "moe": MoEConfig(num_experts=4, top_k=2)}],
                         ids=["hybridnorm_star_tied", "moe_untied"])
def test_trainer_checkpoint_resumes_to_the_straight_runs_weights(tmp_path: Path, kw: dict) -> None:
    """Trainer's own checkpointing (save_steps: save_pretrained of our class with its tied or untied head,
    optimizer and scheduler state by parameter order) and ``train(resume_from_checkpoint=...)``: the resumed
    steps log the straight run's losses and end at its weights, bit for bit."""

    def run(resume: str | None) -> tuple[list[float], dict[str, torch.Tensor]]:
        model = make(**kw)
        args = TrainingArguments(output_dir=str(tmp_path / "out"), per_device_train_batch_size=2, max_steps=6,
                                 learning_rate=1e-2, lr_scheduler_type="linear", warmup_steps=2, logging_steps=1,
                                 report_to=[], save_strategy="steps", save_steps=3, use_cpu=True, seed=0, data_seed=0)
        trainer = Trainer(model=model, args=args, train_dataset=ragged_samples() * 4, data_collator=collate)
        trainer.train(resume_from_checkpoint=resume)
        losses = [h["loss"] for h in trainer.state.log_history if "loss" in h]
        return losses, {k: v.detach().clone() for k, v in model.state_dict().items()}

    straight, weights = run(None)
    assert len(straight) == 6 and len(set(straight)) == 6  # it trained
    resumed, weights_resumed = run(str(tmp_path / "out" / "checkpoint-3"))
    assert resumed[3:] == straight[3:]  # steps 4-6 computed again after the resume (1-3 restored from its log)
    assert weights_resumed.keys() == weights.keys()
    for k in weights:
        assert torch.equal(weights_resumed[k], weights[k]), k
