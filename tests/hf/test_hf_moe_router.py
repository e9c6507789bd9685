"""MoE router outputs and losses of the HF classes: ``output_router_logits`` as Mixtral / OLMoE define it,
and router losses that count real tokens only under a padding mask.

Oracles: stock ``MixtralForCausalLM`` with the same weights (its router logits, and its padding-aware
``load_balancing_loss_func``, which for one layer is top_k times ours: its assignment fractions sum to k,
ours to 1), the router applied by hand to what each FFN received, and a per-token Python loop of the
load-balancing and z losses over the real tokens."""

from __future__ import annotations

import math
from pathlib import Path

import oracle  # tests/oracle.py: randomize_ gives every weight (norm gains too) a distinct random value
import pytest
import torch
import torch.nn.functional as F

pytest.importorskip("transformers", reason="the hf extra (transformers) is not installed")
import transformers
from packaging.version import Version
from transformers import AutoModel, AutoModelForCausalLM
from transformers.modeling_outputs import CausalLMOutputWithPast, MoeCausalLMOutputWithPast

import hybridnorm.hf  # noqa: F401  (registers the Auto classes)
from hybridnorm import ModelConfig, TransformerLM
from hybridnorm.config import MoEConfig
from hybridnorm.data.tokenizer import ByteTokenizer
from hybridnorm.hf import HybridNormConfig, HybridNormForCausalLM
from hybridnorm.hf.export import export_model

V, E, K = 97, 4, 2
LBW, ZW = 0.5, 0.1


def mc_of(placement: str = "hybridnorm_star", n_layers: int = 3, moe: MoEConfig | None = None, **kw) -> ModelConfig:
    moe = moe or MoEConfig(num_experts=E, top_k=K, lb_loss_weight=LBW, z_loss_weight=ZW)
    return ModelConfig(**{**dict(vocab_size=V, d_model=32, n_layers=n_layers, n_heads=4, n_kv_heads=2,
                                 ffn_hidden_size=48, max_seq_len=64, placement=placement, moe=moe), **kw})


def hf_model(mc: ModelConfig, **config_kw) -> HybridNormForCausalLM:
    torch.manual_seed(0)
    hf = HybridNormForCausalLM(HybridNormConfig.from_model_config(mc, **config_kw))
    oracle.randomize_(hf.model, seed=0)
    return hf.eval()


def padded_batch() -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(ids, attention_mask, labels) (3, 10): rows left-padded by 4, 0 and 7 tokens. Neither padding nor a
    row's first real token is scored: the logits that would predict it are a padded position's."""
    ids = torch.randint(0, V, (3, 10), generator=torch.Generator().manual_seed(1))
    mask = torch.ones_like(ids)
    labels = ids.clone()
    for row, pad in enumerate((4, 0, 7)):
        mask[row, :pad] = 0
        labels[row, :pad + 1] = -100
    return ids, mask, labels


def naive_router_losses(router_logits: tuple[torch.Tensor, ...], mask: torch.Tensor) -> tuple[float, float]:
    """Layer means of E * sum_i f_i P_i and mean logsumexp^2, by a loop over the real tokens in float64."""
    real = mask.reshape(-1).tolist()
    lbs, zs = [], []
    for logits in router_logits:
        counts, psum, zsum, n = [0.0] * E, [0.0] * E, 0.0, 0
        for row, keep in zip(logits.double().tolist(), real, strict=True):
            if not keep:
                continue
            m = max(row)
            exps = [math.exp(v - m) for v in row]
            probs = [e / sum(exps) for e in exps]
            for e in sorted(range(E), key=lambda i: -probs[i])[:K]:
                counts[e] += 1
            psum = [a + b for a, b in zip(psum, probs, strict=True)]
            zsum += (m + math.log(sum(exps))) ** 2
            n += 1
        lbs.append(E * sum((c / (n * K)) * (p / n) for c, p in zip(counts, psum, strict=True)))
        zs.append(zsum / n)
    return sum(lbs) / len(lbs), sum(zs) / len(zs)


@pytest.mark.parametrize("n_layers", [1, 2])
@torch.no_grad()
def test_router_logits_and_aux_loss_match_stock_mixtral(tmp_path: Path, n_layers: int) -> None:
    """The same weights in stock Mixtral: the same router logits per layer, left padding included; for one
    layer Mixtral's padding-aware aux_loss is top_k times ours (its fractions sum to k); for more layers
    Mixtral pools the layers' tokens before the product where we average per-layer losses (Switch, OLMoE),
    so only the logits are compared there."""
    mc = mc_of("pre", n_layers, MoEConfig(num_experts=E, top_k=K, normalize_topk=True))
    torch.manual_seed(0)
    lm = TransformerLM(mc).eval()
    oracle.randomize_(lm, seed=0)
    assert export_model(lm, tmp_path / "hf", ByteTokenizer()).class_name == "MixtralForCausalLM"
    theirs = transformers.MixtralForCausalLM.from_pretrained(tmp_path / "hf").eval()
    ours = HybridNormForCausalLM(HybridNormConfig.from_model_config(mc)).eval()
    ours.model.load_state_dict(lm.state_dict())
    ids, mask, _ = padded_batch()
    for attention_mask in (mask, None):
        a = ours(ids, attention_mask=attention_mask, output_router_logits=True)
        b = theirs(ids, attention_mask=attention_mask, output_router_logits=True)
        assert isinstance(a, MoeCausalLMOutputWithPast) and len(a.router_logits) == n_layers
        # transformers 5.5 (the supported floor) records the router's softmax under this name, and its
        # load-balancing loss softmaxes that again; later releases record the logits, as we do
        probabilities = all(torch.allclose(w.sum(-1), torch.ones(())) and (w >= 0).all() for w in b.router_logits)
        for got, want in zip(a.router_logits, b.router_logits, strict=True):
            assert got.shape == want.shape == (ids.numel(), E) and got.dtype == torch.float32
            real = (mask.reshape(-1) == 1) if attention_mask is not None else slice(None)
            got = got.softmax(-1) if probabilities else got
            assert (got[real] - want[real]).abs().max().item() < 1e-5  # padded rows see different masks
        if n_layers == 1 and not probabilities:
            assert (K * a.aux_loss).item() == pytest.approx(b.aux_loss.item(), rel=1e-5)
    if Version(transformers.__version__) >= Version("5.24"):  # the pinned release: the strong check ran
        assert not probabilities


def test_loss_is_ce_plus_weighted_router_losses_of_the_real_tokens() -> None:
    """In training mode loss = CE + lb_loss_weight * lb + z_loss_weight * z, the router losses over the real
    tokens only (a per-token loop); aux_loss is lb; each router_logits entry is the router applied to what its
    FFN saw. In eval mode loss is the CE alone (Trainer.evaluate's eval_loss, whose exp is the perplexity),
    with the flag or without; aux_loss is still returned beside it."""
    hf = hf_model(mc_of()).train()  # no dropout: the same logits as in eval mode
    ffn_inputs: list[torch.Tensor] = []
    hooks = [b.ffn.register_forward_pre_hook(lambda m, a: ffn_inputs.append(a[0])) for b in hf.model.blocks]
    ids, mask, labels = padded_batch()
    out = hf(ids, attention_mask=mask, labels=labels, output_router_logits=True)
    for h in hooks:
        h.remove()
    assert len(out.router_logits) == len(ffn_inputs) == 3
    for logits, x, block in zip(out.router_logits, ffn_inputs, hf.model.blocks, strict=True):
        assert torch.allclose(logits, x.reshape(-1, 32) @ block.ffn.router.weight.T, atol=1e-5)
    lb, z = naive_router_losses(out.router_logits, mask)
    ce = F.cross_entropy(out.logits[:, :-1].reshape(-1, V), labels[:, 1:].reshape(-1), ignore_index=-100)
    assert out.aux_loss.item() == pytest.approx(lb, rel=1e-5)
    assert out.loss.item() == pytest.approx(ce.item() + LBW * lb + ZW * z, rel=1e-5)
    assert out.loss.requires_grad and out.aux_loss.requires_grad
    hf.eval()
    with torch.no_grad():
        for flag in (None, True):
            quiet = hf(ids, attention_mask=mask, labels=labels, output_router_logits=flag)
            assert quiet.loss.item() == pytest.approx(ce.item(), rel=1e-6)
            assert torch.allclose(quiet.logits, out.logits, atol=1e-6)
        assert quiet.aux_loss.item() == pytest.approx(lb, rel=1e-5)


@torch.no_grad()
def test_what_padding_holds_changes_nothing() -> None:
    """Before, padded positions were routed and counted: their token ids moved the loss. Now any ids there
    give the same loss, aux loss and real tokens' router logits."""
    hf = hf_model(mc_of())
    ids, mask, labels = padded_batch()
    other = torch.where(mask == 0, (ids + 11) % V, ids)
    a = hf(ids, attention_mask=mask, labels=labels, output_router_logits=True)
    b = hf(other, attention_mask=mask, labels=labels, output_router_logits=True)
    assert a.loss.item() == pytest.approx(b.loss.item(), abs=1e-6)
    assert a.aux_loss.item() == pytest.approx(b.aux_loss.item(), abs=1e-6)
    real = mask.reshape(-1) == 1
    for x, y in zip(a.router_logits, b.router_logits, strict=True):
        assert (x[real] - y[real]).abs().max().item() < 1e-5


@torch.no_grad()
def test_without_a_mask_the_numbers_are_the_training_loops() -> None:
    """No padding mask, training mode: the router losses are those the training loop adds
    (TransformerLM.aux_losses), bitwise, and loss is the training loop's objective."""
    hf = hf_model(mc_of()).train()
    ids, _, _ = padded_batch()
    out = hf(ids, labels=ids, output_router_logits=True)
    aux = hf.model.aux_losses()
    assert torch.equal(out.aux_loss, aux["lb_loss"])
    plain = hf(ids, labels=ids)
    assert isinstance(plain, CausalLMOutputWithPast) and not isinstance(plain, MoeCausalLMOutputWithPast)
    assert torch.equal(plain.loss, out.loss)
    ce = F.cross_entropy(out.logits[:, :-1].reshape(-1, V), ids[:, 1:].reshape(-1))
    assert out.loss.item() == pytest.approx(ce.item() + aux["aux_loss"].item(), rel=1e-6)


@torch.no_grad()
def test_the_config_flag_the_base_model_tuples_and_dense_models(tmp_path: Path) -> None:
    hf = hf_model(mc_of(), output_router_logits=True)
    ids, mask, labels = padded_batch()
    out = hf(ids, attention_mask=mask, labels=labels)  # the config's flag
    assert isinstance(out, MoeCausalLMOutputWithPast) and len(out.router_logits) == 3
    assert isinstance(hf(ids, output_router_logits=False), CausalLMOutputWithPast)  # the argument wins
    hf.save_pretrained(tmp_path)
    back = AutoModelForCausalLM.from_pretrained(tmp_path).eval()
    assert back.config.output_router_logits is True
    assert torch.equal(back(ids, attention_mask=mask, labels=labels).aux_loss, out.aux_loss)
    base = AutoModel.from_pretrained(tmp_path).eval()(ids, attention_mask=mask)
    for x, y in zip(base.router_logits, out.router_logits, strict=True):
        assert torch.equal(x, y)
    loss, aux_loss, logits = hf(ids, attention_mask=mask, labels=labels, return_dict=False)[:3]
    assert (torch.equal(loss, out.loss), torch.equal(aux_loss, out.aux_loss), torch.equal(logits, out.logits)) \
        == (True, True, True)
    dense = hf_model(ModelConfig(vocab_size=V, d_model=32, n_layers=2, n_heads=4, ffn_hidden_size=48, max_seq_len=64))
    assert type(dense(ids, output_router_logits=True)) is CausalLMOutputWithPast  # no router: as Llama does


def test_gradient_checkpointing_records_each_layer_once_and_keeps_the_gradients() -> None:
    """A checkpointed block runs twice (forward, then again in backward): the router logits are recorded
    once per layer, and loss and gradients equal the plain step's."""
    ids, mask, labels = padded_batch()
    grads = []
    for checkpointing in (False, True):
        hf = hf_model(mc_of()).train()
        if checkpointing:
            hf.gradient_checkpointing_enable()
        out = hf(ids, attention_mask=mask, labels=labels, output_router_logits=True)
        out.loss.backward()
        assert len(out.router_logits) == 3
        grads.append((out.loss.detach(), [p.grad.clone() for p in hf.parameters()]))
    (l0, g0), (l1, g1) = grads
    assert torch.equal(l0, l1)
    for a, b in zip(g0, g1, strict=True):
        assert torch.allclose(a, b, atol=1e-6)
    router_grad = hf.model.blocks[0].ffn.router.weight.grad
    assert router_grad.abs().max() > 0  # the router losses reach the router


def test_trainer_evaluate_eval_loss_is_the_cross_entropy_stock_mixtral_reports(tmp_path: Path) -> None:
    """``Trainer.evaluate`` runs the model in eval mode: its ``eval_loss`` is the cross-entropy alone, the same
    number stock Mixtral with the same weights reports (before, ours added the router losses there, about
    0.01 nats on a trained model, so exp(eval_loss) was not the perplexity), and a hand mean over the tokens."""
    from transformers import Trainer, TrainingArguments

    mc = mc_of("pre", 2, MoEConfig(num_experts=E, top_k=K, normalize_topk=True, lb_loss_weight=LBW, z_loss_weight=ZW))
    torch.manual_seed(0)
    lm = TransformerLM(mc).eval()
    oracle.randomize_(lm, seed=0)
    assert export_model(lm, tmp_path / "hf", ByteTokenizer()).class_name == "MixtralForCausalLM"
    theirs = transformers.MixtralForCausalLM.from_pretrained(tmp_path / "hf")
    ours = HybridNormForCausalLM(HybridNormConfig.from_model_config(mc))
    ours.model.load_state_dict(lm.state_dict())
    ids = torch.randint(0, V, (5, 12), generator=torch.Generator().manual_seed(0))
    rows = [{"input_ids": r.tolist(), "labels": r.tolist()} for r in ids]
    args = TrainingArguments(output_dir=str(tmp_path / "t"), per_device_eval_batch_size=2, report_to=[],
                             use_cpu=True, disable_tqdm=True)
    got = [Trainer(model=m, args=args, eval_dataset=rows).evaluate()["eval_loss"] for m in (ours, theirs)]
    with torch.no_grad():
        logits = lm(ids)
    # Trainer averages the eval batches' (2, 2, 1 rows) mean losses weighted by their rows
    by_batch = [F.cross_entropy(logits[i:i + 2, :-1].reshape(-1, V), ids[i:i + 2, 1:].reshape(-1)).item()
                for i in (0, 2, 4)]
    hand = (2 * by_batch[0] + 2 * by_batch[1] + by_batch[2]) / 5
    assert got[0] == pytest.approx(got[1], rel=1e-5)
    assert got[0] == pytest.approx(hand, rel=1e-5)
    ours.train()
    assert ours(ids, labels=ids).loss.item() > F.cross_entropy(logits[:, :-1].reshape(-1, V),
                                                               ids[:, 1:].reshape(-1)).item() + 1e-3
