"""``HybridNormForCausalLM``: save_pretrained / Auto from_pretrained / generate round trips for the
placements no stock class expresses (HybridNorm* first), checked against our own TransformerLM."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

pytest.importorskip("transformers", reason="the hf extra (transformers) is not installed")
from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

import hybridnorm.hf  # noqa: F401  (registers the Auto classes)
from hybridnorm import ModelConfig, TransformerLM
from hybridnorm.config import MoEConfig
from hybridnorm.data.tokenizer import ByteTokenizer, train_bpe
from hybridnorm.errors import ConfigError
from hybridnorm.hf import HybridNormConfig, HybridNormForCausalLM, remote_code
from hybridnorm.hf.export import export_model, export_run, hf_tokenizer
from hybridnorm.loading import load_run
from hybridnorm.nn.model import lm_loss


def tiny(placement: str = "hybridnorm_star", **kw) -> ModelConfig:
    return ModelConfig(**{**dict(vocab_size=257, d_model=32, n_layers=3, n_heads=4, n_kv_heads=2,
                                 ffn_hidden_size=48, max_seq_len=64, placement=placement), **kw})


def model(placement: str = "hybridnorm_star", seed: int = 0, **kw) -> TransformerLM:
    torch.manual_seed(seed)
    return TransformerLM(tiny(placement, **kw)).eval()


def test_hybridnorm_star_save_from_pretrained_generate(tmp_path: Path, trained_run: Path) -> None:
    """The acceptance round trip: a trained HybridNorm* run -> export -> Auto from_pretrained ->
    generate() equals our own generate() token for token, and the logits are identical."""
    run = load_run(trained_run)
    result = export_run(trained_run, tmp_path)
    assert (result.class_name, result.stock) == ("HybridNormForCausalLM", False)
    cfg = AutoConfig.from_pretrained(tmp_path)
    assert isinstance(cfg, HybridNormConfig) and cfg.placement == "hybridnorm_star"
    assert cfg.model_config().resolved_placement() == run.model.config.resolved_placement()
    hf = AutoModelForCausalLM.from_pretrained(tmp_path).eval()
    assert isinstance(hf, HybridNormForCausalLM)
    tok = AutoTokenizer.from_pretrained(tmp_path)
    enc = tok("the lord said", return_tensors="pt")
    # <|endoftext|> first, as `hybridnorm generate` and the evaluators put it: training saw every document after one
    assert enc["input_ids"][0].tolist() == [run.tokenizer.eot_id, *run.tokenizer.encode("the lord said")]
    assert tok.model_max_length == run.model.config.max_seq_len

    out = hf.generate(**enc, max_new_tokens=24, min_new_tokens=24, do_sample=False)  # HF's KV cache
    ref = run.model.generate(enc["input_ids"], 24, temperature=0)  # ours, its own cache
    assert torch.equal(out, ref)
    assert len(set(out[0, -24:].tolist())) > 3  # real text, not one repeated token
    with torch.no_grad():
        assert torch.equal(hf(out).logits, run.model(out))


def test_left_padded_batch_generates_what_each_prompt_does_alone(tmp_path: Path, trained_run: Path) -> None:
    run = load_run(trained_run)
    export_run(trained_run, tmp_path)
    hf = AutoModelForCausalLM.from_pretrained(tmp_path).eval()
    tok = AutoTokenizer.from_pretrained(tmp_path, padding_side="left")
    prompts = ["and the", "the people shall keep my"]
    batch = tok(prompts, return_tensors="pt", padding=True)
    assert batch["attention_mask"][0, 0] == 0  # the short prompt really is padded
    out = hf.generate(**batch, max_new_tokens=12, min_new_tokens=12, do_sample=False)
    for row, prompt in zip(out, prompts, strict=True):
        alone = run.model.generate(torch.tensor([[run.tokenizer.eot_id, *run.tokenizer.encode(prompt)]]), 12,
                                   temperature=0)
        assert row[-12:].tolist() == alone[0, -12:].tolist()


def test_padding_mask_and_positions_match_unpadded_logits() -> None:
    ours = model("hybridnorm")
    seq = torch.randint(0, 257, (1, 9), generator=torch.Generator().manual_seed(3))
    padded = torch.cat([torch.zeros(1, 4, dtype=torch.long), seq], dim=1)
    mask = torch.cat([torch.zeros(1, 4, dtype=torch.long), torch.ones(1, 9, dtype=torch.long)], dim=1)
    with torch.no_grad():
        alone, with_pad = ours(seq), ours(padded, attention_mask=mask)
    assert torch.isfinite(with_pad).all()
    assert (with_pad[:, 4:] - alone).abs().max().item() < 1e-5


def test_labels_give_the_shifted_lm_loss() -> None:
    hf = HybridNormForCausalLM(HybridNormConfig.from_model_config(tiny())).eval()
    x = torch.randint(0, 257, (2, 12))
    out = hf(x, labels=x)
    assert out.loss.item() == pytest.approx(lm_loss(out.logits[:, :-1], x[:, 1:]).item(), abs=1e-6)


def test_moe_loss_includes_the_router_aux_loss_in_training_mode_only() -> None:
    """Training mode: the objective (CE + weighted router losses), so Trainer keeps balancing the experts.
    Eval mode: the CE alone, the number the trainer's own validation reports (before, eval-mode loss carried
    the router losses too, so Trainer.evaluate's eval_loss was not the model's cross-entropy)."""
    mc = tiny("hybridnorm", moe=MoEConfig(num_experts=4, top_k=2, lb_loss_weight=0.5, z_loss_weight=0.1))
    hf = HybridNormForCausalLM(HybridNormConfig.from_model_config(mc)).train()
    x = torch.randint(0, 257, (2, 12))
    out = hf(x, labels=x)
    aux = hf.model.aux_losses()["aux_loss"]
    assert aux.item() > 0
    ce = lm_loss(out.logits[:, :-1], x[:, 1:]).item()
    assert out.loss.item() == pytest.approx(ce + aux.item(), abs=1e-6)
    assert hf.eval()(x, labels=x).loss.item() == pytest.approx(ce, abs=1e-6)


def test_config_json_round_trip_and_derived_fields(tmp_path: Path) -> None:
    mc = tiny("Pre-QKV-Post", pad_vocab_multiple=64)
    cfg = HybridNormConfig.from_model_config(mc)
    assert (cfg.vocab_size, cfg.hidden_size, cfg.num_hidden_layers, cfg.num_key_value_heads) == (320, 32, 3, 2)
    cfg.save_pretrained(tmp_path)
    back = AutoConfig.from_pretrained(tmp_path)
    assert back.hybridnorm == cfg.hybridnorm
    assert back.model_config().resolved_placement() == mc.resolved_placement()


def test_bpe_tokenizer_is_saved_as_a_fast_tokenizer_with_the_same_ids(tmp_path: Path) -> None:
    texts = ["In the beginning God created the heaven and the earth."] * 20 + ["And the earth was without form."]
    bpe = train_bpe(texts, vocab_size=300)
    hf_tokenizer(bpe).save_pretrained(tmp_path)
    tok = AutoTokenizer.from_pretrained(tmp_path)
    s = "And God created the earth, and the heaven."
    assert tok(s, add_special_tokens=False)["input_ids"] == bpe.encode(s)
    assert tok(s)["input_ids"] == [bpe.eot_id, *bpe.encode(s)]  # the default prepends <|endoftext|>
    assert bpe.hf.post_processor is None  # the run's own tokenizer is not changed by the export
    assert tok.eos_token == "<|endoftext|>" and tok.eos_token_id == bpe.eot_id
    assert tok.decode(bpe.encode(s)) == s


def test_byte_tokenizer_equivalent_round_trips_any_text() -> None:
    tok = hf_tokenizer(ByteTokenizer())
    s = "Tab\there, ümlaut, 中文, emoji 🙂 and\nnewline  double  space"
    assert tok(s, add_special_tokens=False)["input_ids"] == list(s.encode("utf-8"))
    assert tok.decode(list(s.encode("utf-8"))) == s
    assert len(tok) == 257 and tok.eos_token_id == 256


def test_trust_remote_code_loads_without_importing_hybridnorm_hf(tmp_path: Path) -> None:
    """The exported folder carries a shim module, so tools that only call from_pretrained (lm-eval's
    HFLM, scripts) load our class with trust_remote_code=True in a fresh interpreter."""
    export_model(model(), tmp_path / "hf", ByteTokenizer())
    code = ("from transformers import AutoModelForCausalLM\n"
            f"m = AutoModelForCausalLM.from_pretrained({str(tmp_path / 'hf')!r}, trust_remote_code=True)\n"
            "print(type(m).__name__, m.config.placement)\n")
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=tmp_path, timeout=300,
                          env={**__import__("os").environ, "HF_HUB_OFFLINE": "1", "HF_HOME": str(tmp_path / "hf_home")})
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert proc.stdout.split() == ["HybridNormForCausalLM", "hybridnorm_star"]


def test_a_model_loaded_with_trust_remote_code_saves_a_folder_that_loads_so_again(tmp_path: Path) -> None:
    """Load the export with trust_remote_code=True, change the weights (as fine-tuning does), save_pretrained
    (as Trainer and TRL do), then load the saved folder the same way in a fresh interpreter (as lm-eval's
    ``--model hf`` does): the changed model's logits. transformers would copy the file defining each class
    into the folder, a piece of our package, and leave the shim the config names unwritten: the saved folder
    failed to load ("does not appear to have a file named modeling_hybridnorm.py")."""
    export_model(model(), tmp_path / "hf", ByteTokenizer())
    env = {**__import__("os").environ, "HF_HUB_OFFLINE": "1", "HF_HOME": str(tmp_path / "hf_home")}
    load = "import torch\nfrom transformers import AutoModelForCausalLM\n"
    ids = "torch.arange(40, 52)[None]"
    steps = {"tuned": "m = AutoModelForCausalLM.from_pretrained('hf', trust_remote_code=True)\n"
                      "torch.nn.init.normal_(m.model.blocks[0].ffn.w_out.weight, std=0.5)\n"
                      "m.save_pretrained('tuned')\n",
             "loaded": "m = AutoModelForCausalLM.from_pretrained('tuned', trust_remote_code=True)\n"}
    logits = {}
    for name, code in steps.items():
        code = load + code + f"torch.save(m({ids}).logits.detach(), '{name}.pt')\n"
        proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=tmp_path, timeout=300,
                              env=env)
        assert proc.returncode == 0, proc.stderr[-2000:]
        logits[name] = torch.load(tmp_path / f"{name}.pt")
    assert torch.equal(logits["loaded"], logits["tuned"])
    saved = {p.name for p in (tmp_path / "tuned").iterdir()}
    assert "modeling_hybridnorm.py" in saved and not saved & {"configuration.py", "modeling.py"}
    assert json.loads((tmp_path / "tuned" / "config.json").read_text())["auto_map"] == remote_code.AUTO_MAP


def test_an_older_exports_auto_map_is_still_ours_and_grows_to_todays_on_saving(tmp_path: Path) -> None:
    """Exports before the task heads named the config and the LM only. Such a folder still passes the import
    guard (a map of ours, dropped there, the installed classes used), a changed map does not; and saving a
    model loaded from it writes today's map and a shim that gives every class it names."""
    from hybridnorm.hf import folder

    export_model(model(), tmp_path / "hf", ByteTokenizer())
    cfg_file = tmp_path / "hf" / "config.json"
    cfg = json.loads(cfg_file.read_text())
    cfg["auto_map"] = {k: remote_code.AUTO_MAP[k] for k in ("AutoConfig", "AutoModelForCausalLM")}
    cfg_file.write_text(json.dumps(cfg))
    assert "auto_map" not in folder.read_config(tmp_path / "hf")
    m = HybridNormForCausalLM.from_pretrained(tmp_path / "hf")
    m.save_pretrained(tmp_path / "saved")
    assert json.loads((tmp_path / "saved" / "config.json").read_text())["auto_map"] == remote_code.AUTO_MAP
    shim = (tmp_path / "saved" / remote_code.SHIM).read_text()
    assert all(name in shim for name in remote_code.CLASSES.values())
    for wrong in ({**cfg["auto_map"], "AutoModelForCausalLM": "evil.Model"}, {"AutoModel": "modeling_hybridnorm.X"}):
        cfg_file.write_text(json.dumps({**cfg, "auto_map": wrong}))
        with pytest.raises(ConfigError, match="auto_map"):
            folder.read_config(tmp_path / "hf")
