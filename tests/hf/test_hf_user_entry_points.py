"""An exported model through transformers' everyday entry points besides ``generate``'s modes, against a stock
``LlamaForCausalLM`` with the same weights (the ``pre`` placement exported both ways; HybridNorm* where no
stock class computes the placement): ``pipeline("text-generation", model=..., tokenizer=...)`` with model and
tokenizer objects, ``TextStreamer`` / ``TextIteratorStreamer``, ``save_pretrained(max_shard_size=...)`` and
the sharded folder loaded back, ``from_pretrained(dtype=torch.bfloat16 / "auto")``,
``resize_token_embeddings`` after ``tokenizer.add_tokens`` (tied and untied), ``gradient_checkpointing_enable()``
and a training step, ``num_parameters`` and ``get_memory_footprint``, ``from_config``."""

from __future__ import annotations

import contextlib
import io
import json
import threading
from pathlib import Path

import pytest
import torch

pytest.importorskip("transformers", reason="the hf extra (transformers) is not installed")
import transformers
from test_hf_stock_parity import random_gains, tiny  # tests/hf/: the tiny configs and randomized gains
from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer, TextIteratorStreamer, TextStreamer, pipeline

from hybridnorm import TransformerLM
from hybridnorm.data.tokenizer import ByteTokenizer
from hybridnorm.hf import HybridNormForCausalLM, stock
from hybridnorm.hf.export import export_model

TOL = 1e-5
IDS = torch.randint(0, 256, (2, 10), generator=torch.Generator().manual_seed(3))


def folders(tmp: Path, tie: bool = True, dtype: str = "float32") -> tuple[Path, Path]:
    """The same ``pre`` model exported as ours and as Llama (each with the tokenizer)."""
    torch.manual_seed(0)
    lm = TransformerLM(tiny("pre", tie=tie)).eval()
    random_gains(lm)
    export_model(lm, tmp / "ours", ByteTokenizer(), arch="hybridnorm", dtype=dtype)
    export_model(lm, tmp / "llama", ByteTokenizer(), arch="llama", dtype=dtype)
    return tmp / "ours", tmp / "llama"


def twins(tmp: Path, tie: bool = True, **kw) -> tuple[HybridNormForCausalLM, transformers.LlamaForCausalLM]:
    ours_dir, llama_dir = folders(tmp, tie)
    ours, theirs = (AutoModelForCausalLM.from_pretrained(d, **kw).eval() for d in (ours_dir, llama_dir))
    assert isinstance(ours, HybridNormForCausalLM) and isinstance(theirs, transformers.LlamaForCausalLM)
    return ours, theirs


def test_pipeline_from_model_and_tokenizer_objects_and_streamers_give_the_stock_text(tmp_path: Path) -> None:
    ours, theirs = twins(tmp_path)
    tok = AutoTokenizer.from_pretrained(tmp_path / "ours", padding_side="left")
    texts = []
    for model in (ours, theirs):
        gen = pipeline("text-generation", model=model, tokenizer=tok, device="cpu")
        one = gen("In the beginning", max_new_tokens=12, do_sample=False)[0]["generated_text"]
        batch = [r[0]["generated_text"] for r in gen(["a", "In the beginning God"], max_new_tokens=12,
                                                      do_sample=False, batch_size=2)]
        new = gen("abc", max_new_tokens=6, do_sample=False, return_full_text=False)[0]["generated_text"]
        texts.append((one, batch, new))
    assert texts[0] == texts[1]
    assert texts[0][0].startswith("In the beginning") and len(texts[0][0]) > len("In the beginning")
    enc = tok("In the beginning", return_tensors="pt")
    streamed = []
    for model in (ours, theirs):
        printed = io.StringIO()
        with contextlib.redirect_stdout(printed):
            out = model.generate(**enc, max_new_tokens=12, min_new_tokens=12, do_sample=False,
                                 streamer=TextStreamer(tok, skip_prompt=True))
        reply = tok.decode(out[0, enc["input_ids"].shape[1]:])
        assert printed.getvalue() == reply + "\n"
        it = TextIteratorStreamer(tok, skip_prompt=True)
        worker = threading.Thread(target=model.generate, kwargs=dict(**enc, max_new_tokens=12, min_new_tokens=12,
                                                                     do_sample=False, streamer=it))
        worker.start()
        pieces = list(it)
        worker.join()
        assert "".join(pieces) == reply
        streamed.append(reply)
    assert streamed[0] == streamed[1]


@pytest.mark.parametrize("tie", [True, False])
def test_sharded_save_loads_back_as_the_same_model(tmp_path: Path, tie: bool) -> None:
    ours, theirs = twins(tmp_path, tie)
    for model in (ours, theirs):
        out = tmp_path / f"sharded_{type(model).__name__}"
        model.save_pretrained(out, max_shard_size="20KB")
        index = json.loads((out / "model.safetensors.index.json").read_text())
        shards = set(index["weight_map"].values())
        assert len(shards) > 1 and all((out / s).is_file() for s in shards)
        assert not (out / "model.safetensors").exists()
        again = AutoModelForCausalLM.from_pretrained(out).eval()
        assert type(again) is type(model)
        with torch.no_grad():
            assert torch.equal(again(IDS).logits, model(IDS).logits)
    names = set(json.loads((tmp_path / "sharded_HybridNormForCausalLM/model.safetensors.index.json").read_text())
                ["weight_map"])
    assert names == set(ours.state_dict())  # every weight once, a tied head not stored twice
    with torch.no_grad():
        torch.testing.assert_close(ours(IDS).logits, theirs(IDS).logits, rtol=0, atol=TOL)


def test_from_pretrained_dtype_bfloat16_and_auto(tmp_path: Path) -> None:
    """``dtype=torch.bfloat16`` casts every weight; ``"auto"`` keeps the folder's (fp32 and a
    ``--dtype bfloat16`` export): as for Llama."""
    fp32 = folders(tmp_path / "fp32")
    bf16 = folders(tmp_path / "bf16", dtype="bfloat16")
    for ours_dir, llama_dir, dtype, want in ((*fp32, torch.bfloat16, torch.bfloat16), (*fp32, "auto", torch.float32),
                                             (*bf16, "auto", torch.bfloat16), (*bf16, None, torch.bfloat16)):
        kw = {} if dtype is None else {"dtype": dtype}
        for folder in (ours_dir, llama_dir):
            model = AutoModelForCausalLM.from_pretrained(folder, **kw)
            assert model.dtype == want and {p.dtype for p in model.parameters()} == {want}, (folder, dtype)
            assert model(IDS).logits.dtype == want


@pytest.mark.parametrize("tie", [True, False])
def test_resize_token_embeddings_for_added_tokens_equals_the_stock_class(tmp_path: Path, tie: bool) -> None:
    """New rows drawn from the same seed (transformers' mean resizing) give Llama's logits on the new ids too;
    ``generate`` then emits them alike; a shrink with ``pad_to_multiple_of`` and a save / load keep them."""
    ours, theirs = twins(tmp_path, tie)
    tok = AutoTokenizer.from_pretrained(tmp_path / "ours")
    assert tok.add_tokens(["<tool>", "</tool>"]) == 2
    enc = tok("hi <tool> x </tool>", return_tensors="pt")
    assert enc["input_ids"].max() == 258
    outs = []
    for model in (ours, theirs):
        torch.manual_seed(3)
        emb = model.resize_token_embeddings(len(tok))
        head = model.get_output_embeddings().weight
        assert emb.weight.shape == head.shape == (259, 32) and model.config.vocab_size == 259
        assert (head.data_ptr() == emb.weight.data_ptr()) == tie
        with torch.no_grad():
            outs.append((model(**enc).logits, model.generate(**enc, max_new_tokens=6, min_new_tokens=6,
                                                              do_sample=False)))
    torch.testing.assert_close(outs[0][0], outs[1][0], rtol=0, atol=TOL)
    assert torch.equal(outs[0][1], outs[1][1])
    for model in (ours, theirs):
        model.resize_token_embeddings(250, pad_to_multiple_of=16)
        assert model.config.vocab_size == 256
    with torch.no_grad():
        torch.testing.assert_close(ours(IDS).logits, theirs(IDS).logits, rtol=0, atol=TOL)
        ours.save_pretrained(tmp_path / "resized")
        again = AutoModelForCausalLM.from_pretrained(tmp_path / "resized").eval()
        assert torch.equal(again(IDS).logits, ours(IDS).logits)


def _step(model: torch.nn.Module, checkpointing: bool) -> tuple[float, dict[str, torch.Tensor]]:
    """One training forward and backward of a left-padded batch; the loss and every gradient."""
    mask = torch.ones_like(IDS)
    mask[0, :3] = 0
    labels = IDS.masked_fill(mask == 0, -100)
    model.zero_grad()
    model.train()
    # transformers 5.24's names; gradient_checkpointing_enable() (the older ones, still there) calls them
    new = hasattr(model, "activation_checkpointing_enable")
    prefix = "activation" if new else "gradient"
    getattr(model, f"{prefix}_checkpointing_{'enable' if checkpointing else 'disable'}")()
    assert getattr(model, f"is_{prefix}_checkpointing") == checkpointing
    loss = model(IDS, attention_mask=mask, position_ids=(mask.cumsum(-1) - 1).clamp(min=0), labels=labels).loss
    loss.backward()
    return loss.item(), {n: p.grad.clone() for n, p in model.named_parameters(remove_duplicate=False)}


@pytest.mark.parametrize("placement", ["pre", "hybridnorm_star"])
def test_gradient_checkpointing_takes_the_plain_step(tmp_path: Path, placement: str) -> None:
    torch.manual_seed(0)
    lm = TransformerLM(tiny(placement))
    random_gains(lm)
    export_model(lm, tmp_path / "ours", ByteTokenizer(), arch="hybridnorm")
    ours = AutoModelForCausalLM.from_pretrained(tmp_path / "ours")
    plain_loss, plain = _step(ours, False)
    loss, grads = _step(ours, True)
    assert loss == plain_loss and set(grads) == set(plain)
    for name, g in grads.items():
        torch.testing.assert_close(g, plain[name], rtol=0, atol=1e-7, msg=name)
    if placement != "pre":
        return
    export_model(lm, tmp_path / "llama", ByteTokenizer(), arch="llama")
    theirs = AutoModelForCausalLM.from_pretrained(tmp_path / "llama")
    stock_loss, stock_grads = _step(theirs, True)
    assert abs(stock_loss - loss) <= TOL
    mapped = stock.to_hf_state_dict({n.removeprefix("model."): g for n, g in grads.items()}, ours.model.config,
                                    stock.BY_TYPE["llama"])
    assert set(mapped) == set(stock_grads)
    for name, g in mapped.items():
        torch.testing.assert_close(g, stock_grads[name], rtol=0, atol=TOL, msg=name)


@pytest.mark.parametrize("tie", [True, False])
def test_num_parameters_and_memory_footprint_count_what_the_stock_class_counts(tmp_path: Path, tie: bool) -> None:
    """The same counts, embeddings excluded or not, and the same bytes of parameters; with buffers ours holds
    its RoPE tables (cos and sin, max_position_embeddings x head_dim/2 each, fp32) where Llama holds
    ``inv_freq``: the footprint differs by exactly those buffers."""
    ours, theirs = twins(tmp_path, tie)
    for kw in ({}, {"only_trainable": True}, {"exclude_embeddings": True}):
        assert ours.num_parameters(**kw) == theirs.num_parameters(**kw), kw
    assert ours.num_parameters() == sum(p.numel() for p in ours.parameters())
    assert ours.num_parameters(exclude_embeddings=True) == ours.num_parameters() - 257 * 32
    params = sum(p.numel() * p.element_size() for p in ours.parameters())
    assert ours.get_memory_footprint(return_buffers=False) == params
    assert theirs.get_memory_footprint(return_buffers=False) == params
    buffers = {id(b): b.numel() * b.element_size() for b in ours.buffers()}
    assert ours.get_memory_footprint() == params + sum(buffers.values())
    assert sum(buffers.values()) == 2 * 64 * 4 * 4  # cos + sin, 64 positions x 4 pairs x fp32


def test_from_config_builds_the_class_with_the_dtype_and_backend_asked(tmp_path: Path) -> None:
    ours_dir, llama_dir = folders(tmp_path)
    for folder in (ours_dir, llama_dir):
        config = AutoConfig.from_pretrained(folder)
        model = AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16, attn_implementation="eager")
        assert model.dtype == torch.bfloat16 and model.config._attn_implementation == "eager"
        assert model.num_parameters() == 257 * 32 + sum(
            p.numel() for n, p in model.named_parameters() if "embed" not in n)
        with torch.device("meta"):
            empty = AutoModelForCausalLM.from_config(config)
        assert {p.device.type for p in empty.parameters()} == {"meta"}
    assert torch.get_default_dtype() == torch.float32
