"""The task heads (``AutoModelForSequenceClassification`` / ``TokenClassification`` / ``QuestionAnswering``)
against the stock transformers heads with the same weights, loaded the way users load them: from an
exported LM folder through the ``Auto`` class, the new head drawn and then copied across.

Oracles: the stock head (Llama, Qwen3, OLMo-2, Mixtral: transformers' own generic heads) for logits, losses of
every ``problem_type`` and every gradient; for gradient accumulation under ``Trainer``, the same model trained
on the whole batch in one step (the stock heads are no oracle there: transformers issue #47688, they come out
``gradient_accumulation_steps`` times too large; hybridnorm/hf/heads.py says how).
"""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import TYPE_CHECKING

import pytest
import torch

pytest.importorskip("transformers", reason="the hf extra (transformers) is not installed")
if TYPE_CHECKING:
    from datasets import Dataset
from test_hf_stock_parity import random_gains, tiny  # tests/hf/: the tiny configs and randomized gains
from test_hf_stock_seams import CASES
from transformers import (
    AutoConfig,
    AutoModel,
    AutoModelForCausalLM,
    AutoModelForQuestionAnswering,
    AutoModelForSequenceClassification,
    AutoModelForTokenClassification,
    AutoTokenizer,
    Trainer,
    TrainingArguments,
)

from hybridnorm import TransformerLM
from hybridnorm.cli import main
from hybridnorm.data.tokenizer import ByteTokenizer
from hybridnorm.hf import HybridNormModel, stock
from hybridnorm.hf.export import export_model
from hybridnorm.hf.heads import HybridNormForSequenceClassification

PAD = 256  # the tiny vocabulary's last id: never drawn by the batches below (0..255)
TOL = 1e-5
# head -> (Auto class, head module, from_pretrained keywords)
HEADS = {
    "single_label": (AutoModelForSequenceClassification, "score", dict(num_labels=3)),
    "multi_label": (AutoModelForSequenceClassification, "score",
                    dict(num_labels=3, problem_type="multi_label_classification")),
    "regression": (AutoModelForSequenceClassification, "score", dict(num_labels=1)),
    "token": (AutoModelForTokenClassification, "score", dict(num_labels=5)),
    "qa": (AutoModelForQuestionAnswering, "qa_outputs", {}),
}


def exported(tmp: Path, case: str, tie: bool = True) -> tuple[Path, Path]:
    """The same random LM exported as ours and as the stock class of ``case``: (ours, stock)."""
    placement, moe = CASES[case]
    torch.manual_seed(0)
    lm = TransformerLM(tiny(placement, moe, tie=tie)).eval()
    random_gains(lm)
    export_model(lm, tmp / "stock", ByteTokenizer())
    export_model(lm, tmp / "ours", ByteTokenizer(), arch="hybridnorm")
    return tmp / "ours", tmp / "stock"


def heads(tmp: Path, case: str, head: str, tie: bool = True, **kw: object) -> tuple[torch.nn.Module, torch.nn.Module]:
    """Ours and the stock head over the same LM, loaded from its folders by the Auto class; the stock head's
    freshly drawn weights copied into ours."""
    auto, name, head_kw = HEADS[head]
    ours_folder, stock_folder = exported(tmp, case, tie)
    if type(AutoConfig.from_pretrained(stock_folder)) not in auto._model_mapping:
        pytest.skip(f"transformers has no {auto.__name__} class for {case}")
    theirs = auto.from_pretrained(stock_folder, pad_token_id=PAD, **head_kw, **kw).eval()
    ours = auto.from_pretrained(ours_folder, pad_token_id=PAD, **head_kw, **kw).eval()
    with torch.no_grad():
        # the stock QA heads hold their trunk as `transformer` and so load none of an LM folder's: given here
        trunk = AutoModel.from_pretrained(stock_folder).state_dict()
        getattr(theirs, theirs.base_model_prefix).load_state_dict(trunk)
        for n, p in getattr(ours, name).named_parameters():
            p.copy_(getattr(theirs, name).get_parameter(n))
    return ours, theirs


def batch() -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Three rows of 10 tokens: right-padded by 3, left-padded by 2, unpadded; their mask and positions."""
    ids = torch.randint(0, PAD, (3, 10), generator=torch.Generator().manual_seed(3))
    ids[0, 7:] = PAD
    ids[1, :2] = PAD
    mask = (ids != PAD).long()
    return ids, mask, (mask.cumsum(-1) - 1).clamp(min=0)


def targets(head: str) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(4)
    if head == "single_label":
        return {"labels": torch.tensor([2, -100, 1])}  # one row ignored
    if head == "multi_label":
        return {"labels": torch.randint(0, 2, (3, 3), generator=g).float()}
    if head == "regression":
        return {"labels": torch.randn(3, generator=g)}
    if head == "token":
        labels = torch.randint(0, 5, (3, 10), generator=g)
        return {"labels": labels.masked_fill(batch()[1] == 0, -100)}
    return {"start_positions": torch.tensor([1, 4, 11]), "end_positions": torch.tensor([3, 8, 2])}  # 11: ignored


def outputs(out: object, head: str) -> list[torch.Tensor]:
    return [out.start_logits, out.end_logits] if head == "qa" else [out.logits]


@pytest.mark.parametrize("head", list(HEADS))
@pytest.mark.parametrize("case", list(CASES))
def test_a_head_computes_what_the_stock_head_computes(tmp_path: Path, case: str, head: str) -> None:
    """Logits (a sequence's from its last real token, left- or right-padded), the loss and every gradient."""
    ours, theirs = heads(tmp_path, case, head)
    ids, mask, positions = batch()
    kw = dict(attention_mask=mask, position_ids=positions, **targets(head))
    a, b = ours(ids, **kw), theirs(ids, **kw)
    for x, y in zip(outputs(a, head), outputs(b, head), strict=True):
        assert x.shape == y.shape and (x - y).abs().max().item() <= TOL
    assert abs(a.loss.item() - b.loss.item()) <= TOL
    assert ours.config.problem_type == theirs.config.problem_type  # transformers' loss decided it for both
    ours.train()
    theirs.train()
    ours.zero_grad()
    theirs.zero_grad()
    torch.manual_seed(9)  # the token head's dropout: the same draws in both
    ours(ids, **kw).loss.backward()
    torch.manual_seed(9)
    theirs(ids, **kw).loss.backward()
    mc = dataclasses.replace(ours.model.config, tie_embeddings=True)  # the head models hold no LM head
    grads = {n: p.grad for n, p in ours.model.named_parameters()}
    mapped = stock.to_hf_state_dict(grads, mc, stock.BY_TYPE[theirs.config.model_type])
    del mapped["lm_head.weight"]
    prefix = theirs.base_model_prefix  # `model`, or the QA heads' `transformer`
    mapped = {f"{prefix}.{n.removeprefix('model.')}": g for n, g in mapped.items()}
    name = HEADS[head][1]
    mapped |= {f"{name}.{n}": p.grad for n, p in getattr(ours, name).named_parameters()}
    params = dict(theirs.named_parameters())
    assert set(mapped) == set(params)
    for n, g in mapped.items():
        ref = params[n].grad
        if n.endswith("embed_tokens.weight"):  # the stock embedding's padding_idx freezes the pad row; ours
            assert not ref[PAD].any()          # trains it (the QA loss reads the pad positions' logits)
            g, ref = g[:PAD], ref[:PAD]
        assert (g - ref).abs().max().item() <= TOL, n


@pytest.mark.parametrize("head", ["single_label", "token", "qa"])
def test_a_head_loads_the_lms_trunk_draws_its_head_and_gives_every_weight_a_gradient(tmp_path: Path,
                                                                                     head: str) -> None:
    """From an untied LM's folder: the trunk is the LM's (the head reads HybridNormModel's final hidden states,
    and ``base_model`` gives them too), the head is the one missing weight, the LM head the one unused;
    the head is drawn with the scheme's σ, initializer_range's (a seeded load draws it again the same); and every
    weight receives a gradient from the loss (DDP without find_unused_parameters needs that)."""
    auto, name, head_kw = HEADS[head]
    folder, _ = exported(tmp_path, "llama", tie=False)
    torch.manual_seed(1)
    model, info = auto.from_pretrained(folder, pad_token_id=PAD, output_loading_info=True, **head_kw)
    assert info["missing_keys"] == {f"{name}.weight"} | ({f"{name}.bias"} if head != "single_label" else set())
    assert info["unexpected_keys"] == {"model.lm_head.weight"}
    torch.manual_seed(1)
    again = auto.from_pretrained(folder, pad_token_id=PAD, **head_kw)
    w = getattr(model, name).weight
    assert torch.equal(w, getattr(again, name).weight)
    mc = model.model.config
    assert 0.5 * mc.std < w.std().item() < 1.5 * mc.std
    if getattr(model, name).bias is not None:
        assert torch.equal(getattr(model, name).bias, torch.zeros_like(getattr(model, name).bias))
    model.eval()
    ids, mask, _ = batch()
    with torch.no_grad():
        hidden = HybridNormModel.from_pretrained(folder)(ids, attention_mask=mask).last_hidden_state
        assert torch.equal(model.base_model(ids, attention_mask=mask).last_hidden_state, hidden)
        out = model(ids, attention_mask=mask)
    head_out = getattr(model, name)(hidden)
    if head == "single_label":  # the last real token of each row: 6, 9, 9
        assert torch.allclose(out.logits, head_out[torch.arange(3), torch.tensor([6, 9, 9])], atol=1e-6)
    elif head == "token":
        assert torch.allclose(out.logits, head_out, atol=1e-6)
    else:
        assert torch.allclose(out.start_logits, head_out[..., 0], atol=1e-6)
    model.train()
    model(ids, attention_mask=mask, **targets(head)).loss.backward()
    assert all(p.grad is not None for p in model.parameters())


def test_a_left_padded_row_scores_what_it_scores_alone(tmp_path: Path) -> None:
    """Without position_ids, ours counts positions over the real tokens (as the LM class does), so padding
    never changes a row's score. (The stock heads count from the first column: a left-padded row scores
    differently there; docs/huggingface.md.)"""
    ours, _ = heads(tmp_path, "qwen3", "single_label")
    ids, mask, _ = batch()
    with torch.no_grad():
        padded = ours(ids, attention_mask=mask).logits
        for row in range(3):
            alone = ours(ids[row, mask[row].bool()][None]).logits
            assert (padded[row] - alone[0]).abs().max().item() <= TOL


def rows(head: str, n: int = 10) -> Dataset:
    """A labelled set for a head's ``Trainer`` test; those tests alone need ``datasets`` (the GPU image lacks it)."""
    datasets = pytest.importorskip("datasets", reason="the dev extra's datasets is not installed")
    g = torch.Generator().manual_seed(6)
    ids = torch.randint(0, PAD, (n, 8), generator=g)
    if head == "token":
        labels = torch.randint(0, 5, (n, 8), generator=g)
        labels[::3, :4] = -100  # uneven counts of scored tokens per row
    elif head == "single_label":
        labels = torch.randint(0, 3, (n,), generator=g)
        labels[1] = -100
    elif head == "multi_label":
        labels = torch.randint(0, 2, (n, 3), generator=g).float()
    else:
        labels = torch.randn(n, generator=g)
    return datasets.Dataset.from_dict({"input_ids": ids.tolist(), "labels": labels.tolist()})


def no_dropout(folder: Path, head_kw: dict) -> object:
    config = AutoConfig.from_pretrained(folder, pad_token_id=PAD, **head_kw)
    config.classifier_dropout = 0.0  # the token head's (a keyword to from_pretrained reaches no config, stock too)
    return config


@pytest.mark.parametrize("head", ["single_label", "multi_label", "regression", "token"])
def test_trainer_with_gradient_accumulation_takes_one_batchs_step(tmp_path: Path, head: str) -> None:
    """Ten rows as one batch, and as micro-batches of 3, 3, 3, 1 accumulated: the same logged loss and the
    same weights after the step (Trainer hands the model num_items_in_batch; the stock heads drop it)."""
    auto, name, head_kw = HEADS[head]
    folder, _ = exported(tmp_path, "llama")
    results = []
    for micro, steps in ((10, 1), (3, 4)):
        torch.manual_seed(0)
        model = auto.from_pretrained(folder, config=no_dropout(folder, head_kw))
        args = TrainingArguments(str(tmp_path / f"run{micro}"), per_device_train_batch_size=micro,
                                 gradient_accumulation_steps=steps, max_steps=1, learning_rate=0.5, optim="sgd",
                                 lr_scheduler_type="constant", max_grad_norm=0.0, report_to=[], use_cpu=True,
                                 logging_steps=1, save_strategy="no", seed=0, data_seed=0, disable_tqdm=True)
        trainer = Trainer(model=model, args=args, train_dataset=rows(head))
        trainer.train()
        loss = next(h["loss"] for h in trainer.state.log_history if "loss" in h)
        results.append((loss, {n: p.detach().clone() for n, p in model.named_parameters()}))
    (whole, after_whole), (accumulated, after_accumulated) = results
    assert accumulated == pytest.approx(whole, rel=1e-5)
    moved = False
    for n, p in after_whole.items():
        assert (p - after_accumulated[n]).abs().max().item() <= 1e-5, n
    torch.manual_seed(0)
    start = auto.from_pretrained(folder, config=no_dropout(folder, head_kw))
    moved = not torch.equal(getattr(start, name).weight, after_whole[f"{name}.weight"])
    assert moved


def test_a_classifier_saved_and_loaded_again_is_the_same_classifier(tmp_path: Path) -> None:
    folder, _ = exported(tmp_path, "olmo2", tie=False)
    model = HybridNormForSequenceClassification.from_pretrained(folder, num_labels=2, pad_token_id=PAD)
    model.save_pretrained(tmp_path / "classifier")
    back, info = AutoModelForSequenceClassification.from_pretrained(tmp_path / "classifier", output_loading_info=True)
    assert not any(info.values())  # nothing missing, unexpected or mismatched
    assert type(back) is HybridNormForSequenceClassification and back.config.num_labels == 2
    ids, mask, _ = batch()
    with torch.no_grad():
        assert torch.equal(back.eval()(ids, attention_mask=mask).logits, model.eval()(ids, attention_mask=mask).logits)


def test_a_classifier_folder_given_to_our_commands_is_one_error_naming_its_architectures(
        tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    """A tied classifier's folder holds every weight a tied LM has: imported, it would be an LM silently not
    the folder's model (its trunk tuned for another task, a head it never had). Refused by name."""
    folder, _ = exported(tmp_path, "llama")
    HybridNormForSequenceClassification.from_pretrained(folder, num_labels=1).save_pretrained(tmp_path / "rm")
    AutoTokenizer.from_pretrained(folder).save_pretrained(tmp_path / "rm")  # as Trainer saves it beside
    for argv in (["import", str(tmp_path / "rm"), "--out", str(tmp_path / "run")],
                 ["generate", str(tmp_path / "rm"), "--prompt", "In the"]):
        assert main(argv) == 2
        err = [line for line in capsys.readouterr().err.splitlines() if line.startswith("error:")]
        assert len(err) == 1 and "architectures=['HybridNormForSequenceClassification']" in err[0], err
    assert not (tmp_path / "run").exists()


@pytest.mark.parametrize("head", ["single_label", "lm"])
def test_base_model_saves_as_the_backbone_that_loads_into_every_head(tmp_path: Path, head: str) -> None:
    """``model.base_model.save_pretrained`` (transformers' own model suite does it for every head class, as a
    stock head's base model is a PreTrainedModel): a HybridNormModel folder with the same final hidden states,
    which any head loads with only its own head missing; the model's own config is left as it was."""
    folder, _ = exported(tmp_path, "llama", tie=False)
    model = (AutoModelForCausalLM.from_pretrained(folder) if head == "lm"
             else HEADS[head][0].from_pretrained(folder, pad_token_id=PAD, **HEADS[head][2])).eval()
    before = model.config.to_dict()
    model.base_model.save_pretrained(tmp_path / "backbone")
    assert model.config.to_dict() == before
    backbone = AutoModel.from_pretrained(tmp_path / "backbone").eval()
    assert type(backbone) is HybridNormModel and backbone.config.architectures == ["HybridNormModel"]
    ids, mask, _ = batch()
    with torch.no_grad():
        assert torch.equal(backbone(ids, attention_mask=mask).last_hidden_state,
                           model.base_model(ids, attention_mask=mask).last_hidden_state)
    for auto, name, kw in HEADS.values():
        _, info = auto.from_pretrained(tmp_path / "backbone", pad_token_id=PAD, output_loading_info=True, **kw)
        assert {k.split(".")[0] for k in info["missing_keys"]} == {name}
        # HybridNormModel keeps an untied LM's head weight (the LM's names, docs/huggingface.md); a head has none
        assert info["unexpected_keys"] == ({"model.lm_head.weight"} if head == "lm" else set())


def test_the_folders_auto_map_names_exactly_the_registered_classes() -> None:
    """Two tables list our classes: the shim's (hybridnorm.hf.remote_code: names, imported by modeling before the
    classes exist) and the Auto factories' (hybridnorm.hf.auto). They must agree, or a trust_remote_code load
    and an ``import hybridnorm.hf`` load would give different classes."""
    from hybridnorm.hf import auto, remote_code

    registered = {"AutoConfig": "HybridNormConfig"} | {f.__name__: c.__name__ for f, c, _ in auto.CLASSES}
    assert registered == remote_code.CLASSES
