"""The module-level seams of ``HybridNormForCausalLM`` that tools use besides forward and ``generate``, each
against a stock ``LlamaForCausalLM`` with the same weights (the ``pre`` placement exported both ways):
``get_decoder()`` is one module whose hooks fire on every forward, ``set_decoder(get_decoder())`` changes
nothing and ``set_decoder`` of another model's decoder takes its function, a head given to a tied model by
``set_output_embeddings`` survives ``save_pretrained`` / ``from_pretrained``, and what is refused
(LayerSkip's ``assistant_early_exit``, config fields of the wrong type) is refused with one clear error."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch

pytest.importorskip("transformers", reason="the hf extra (transformers) is not installed")
import transformers
from test_hf_stock_parity import random_gains, tiny  # tests/hf/: the tiny configs and randomized gains
from train_helpers import cli_in_process

from hybridnorm import ConfigError, TransformerLM
from hybridnorm.data.tokenizer import ByteTokenizer
from hybridnorm.hf import HybridNormConfig, HybridNormForCausalLM
from hybridnorm.hf.export import export_model

IDS = torch.randint(0, 256, (2, 10), generator=torch.Generator().manual_seed(3))


def pair(tmp: Path, seed: int = 0, tie: bool = True) -> tuple[HybridNormForCausalLM, transformers.LlamaForCausalLM]:
    """Ours and Llama with the same weights (``pre``), both loaded through ``from_pretrained``."""
    torch.manual_seed(seed)
    lm = TransformerLM(tiny("pre", tie=tie)).eval()
    random_gains(lm)
    export_model(lm, tmp / f"llama{seed}", ByteTokenizer(), arch="llama")
    export_model(lm, tmp / f"ours{seed}", ByteTokenizer(), arch="hybridnorm")
    return (HybridNormForCausalLM.from_pretrained(tmp / f"ours{seed}").eval(),
            transformers.LlamaForCausalLM.from_pretrained(tmp / f"llama{seed}").eval())


def test_the_decoder_is_one_module_whose_hooks_see_each_forward_as_llamas_do(tmp_path: Path) -> None:
    models = pair(tmp_path)
    for model in models:
        decoder = model.get_decoder()
        assert decoder is model.get_decoder() and model.base_model is decoder, type(model).__name__
        seen: list[torch.Tensor] = []
        handle = decoder.register_forward_hook(lambda m, args, out, seen=seen: seen.append(out.last_hidden_state))
        out = model(IDS, output_hidden_states=True)
        handle.remove()
        model(IDS)
        assert len(seen) == 1, type(model).__name__  # once per forward, and not after removal
        torch.testing.assert_close(seen[0], out.hidden_states[-1], rtol=0, atol=0)
    torch.testing.assert_close(models[0](IDS).logits, models[1](IDS).logits, rtol=1e-5, atol=1e-5)


def test_set_decoder_of_its_own_decoder_changes_nothing_and_of_another_takes_its_function(tmp_path: Path) -> None:
    a, llama = pair(tmp_path, seed=0, tie=False)
    b, _ = pair(tmp_path, seed=1, tie=False)
    names, before = list(a.state_dict()), a(IDS).logits
    for model in (a, llama):
        model.set_decoder(model.get_decoder())
    assert list(a.state_dict()) == names
    torch.testing.assert_close(a(IDS).logits, before, rtol=0, atol=0)
    torch.testing.assert_close(llama(IDS).logits, before, rtol=1e-5, atol=1e-5)
    # another model's decoder under a's own head: b's final hidden states read by a's head (Llama 5.24's
    # set_decoder of another decoder changes nothing: its LlamaModel has no set_decoder of its own)
    states = b(IDS, output_hidden_states=True).hidden_states[-1]  # (B, T, d)
    a.set_decoder(b.get_decoder())
    assert a.model is b.model and list(a.state_dict()) == names
    torch.testing.assert_close(a(IDS).logits, a.get_output_embeddings()(states), rtol=0, atol=0)
    with pytest.raises(TypeError, match="set_decoder takes"):
        a.set_decoder(torch.nn.Linear(2, 2))


def test_a_head_given_to_a_tied_model_is_saved_and_loaded_back(tmp_path: Path) -> None:
    for model in pair(tmp_path):
        head = torch.nn.Linear(32, model.config.vocab_size, bias=False)
        torch.nn.init.normal_(head.weight, std=0.5)
        model.set_output_embeddings(head)
        before = model(IDS).logits
        assert not torch.equal(before, model.get_input_embeddings()(IDS) @ model.get_input_embeddings().weight.T)
        folder = tmp_path / f"untied_{type(model).__name__}"
        model.save_pretrained(folder)
        back = transformers.AutoModelForCausalLM.from_pretrained(folder).eval()
        assert type(back) is type(model)
        torch.testing.assert_close(back(IDS).logits, before, rtol=0, atol=0)


def test_init_weights_applied_again_keeps_loaded_weights_and_draws_a_fresh_models_as_llama(tmp_path: Path) -> None:
    # model.apply(model._init_weights) (what some fine-tuning scripts call to draw a new head) is a no-op on the
    # weights a from_pretrained loaded, as on Llama; on a model built from its config, it draws new numbers
    for model in pair(tmp_path, tie=False):
        before = {k: v.clone() for k, v in model.state_dict().items()}
        model.apply(model._init_weights)
        for k, v in model.state_dict().items():
            assert torch.equal(v, before[k]), (type(model).__name__, k)
        fresh = type(model)(model.config)
        drawn = {k: v.clone() for k, v in fresh.state_dict().items()}
        fresh.apply(fresh._init_weights)
        changed = [k for k, v in fresh.state_dict().items() if "proj" in k or "w_" in k or "head" in k]
        assert changed and all(not torch.equal(fresh.state_dict()[k], drawn[k]) for k in changed), changed


def test_layerskip_early_exit_is_refused_with_its_reason(tmp_path: Path) -> None:
    ours, llama = pair(tmp_path)
    prompt = IDS[:1, :4]
    greedy = llama.generate(prompt, max_new_tokens=4, do_sample=False)
    # Llama runs it (its first layer proposes, all layers verify: the greedy tokens)
    assert torch.equal(llama.generate(prompt, max_new_tokens=4, do_sample=False, assistant_early_exit=1), greedy)
    for how in ({"assistant_early_exit": 1},
                {"generation_config": transformers.GenerationConfig(assistant_early_exit=1, max_new_tokens=4)}):
        with pytest.raises(ValueError, match=r"assistant_early_exit .* not supported .* assistant_model="):
            ours.generate(prompt, max_new_tokens=4, do_sample=False, **how)
    assert torch.equal(ours.generate(prompt, max_new_tokens=4, do_sample=False), greedy)


BAD_FIELDS = {"use_cache": "false", "pad_token_id": "0", "output_hidden_states": "no", "tie_word_embeddings": "yes",
              "eos_token_id": ["a"], "num_hidden_layers": True, "rms_norm_eps": float("nan"), "placement": 3}


@pytest.mark.parametrize("field", BAD_FIELDS)
def test_a_config_field_of_the_wrong_type_is_refused_naming_it_everywhere_it_can_be_set(tmp_path: Path,
                                                                                        field: str) -> None:
    value = BAD_FIELDS[field]
    message = rf"^{field}( \(model\.\w+\))?(\[0\])?=.* must be "
    kw = dict(vocab_size=64, hidden_size=32, num_hidden_layers=2, num_attention_heads=4, intermediate_size=48)
    with pytest.raises(ConfigError, match=message):
        HybridNormConfig(**{**kw, field: value})
    good = HybridNormConfig(**kw)
    with pytest.raises(ConfigError, match=message):
        setattr(good, field, value)
    folder = tmp_path / "model"
    HybridNormForCausalLM(good).save_pretrained(folder)
    with pytest.raises(ConfigError, match=message):  # from_pretrained sets its keywords on the loaded config
        HybridNormForCausalLM.from_pretrained(folder, **{field: value})
    d = json.loads((folder / "config.json").read_text())
    (folder / "config.json").write_text(json.dumps({**d, field: value}, allow_nan=True))
    with pytest.raises(ConfigError, match=message):
        transformers.AutoModelForCausalLM.from_pretrained(folder)


def test_lossless_conversions_are_kept_and_the_command_names_the_file(exported: Path, tmp_path: Path) -> None:
    cfg = HybridNormConfig(vocab_size=64, hidden_size=32, num_hidden_layers=2.0, num_attention_heads=4,
                           intermediate_size=48, rms_norm_eps=1, eos_token_id=(1, 2))
    assert (cfg.num_hidden_layers, cfg.rms_norm_eps, cfg.eos_token_id) == (2, 1.0, [1, 2])
    assert type(cfg.num_hidden_layers) is int and type(cfg.rms_norm_eps) is float
    folder = tmp_path / "hf"
    shutil.copytree(exported, folder)
    d = json.loads((folder / "config.json").read_text())
    (folder / "config.json").write_text(json.dumps({**d, "use_cache": "false"}))
    r = cli_in_process("generate", str(folder), "--prompt", "In", "--max-new-tokens", "2", ok=False)
    assert r.returncode == 2 and "Traceback" not in r.stderr, r.stderr
    said = f"error: {folder / 'config.json'}: use_cache='false' must be true or false"
    assert r.stderr.strip().splitlines() == [said]
