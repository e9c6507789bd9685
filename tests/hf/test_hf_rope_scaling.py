"""RoPE scaling (``ModelConfig.rope_scaling``, transformers' ``rope_parameters``: linear, dynamic, llama3, yarn)
against transformers' own implementation: its frequency functions (``ROPE_INIT_FUNCTIONS``), and stock
Llama / Qwen3 / OLMo-2 models with the same weights, at positions past the pre-training context where the
scaling changes every logit. Also: the HF config carries it both ways, ``from_pretrained(...,
rope_parameters=...)`` takes effect, generation with a cache agrees, and every type or key it cannot run
is one error naming it."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

pytest.importorskip("transformers", reason="the hf extra (transformers) is not installed")
import transformers
from test_hf_stock_parity import ids as stock_ids  # tests/hf/: the tiny configs, ids and randomized gains
from test_hf_stock_parity import random_gains
from test_hf_stock_parity import tiny as stock_tiny
from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

import hybridnorm.hf  # registers the Auto classes
from hybridnorm import ConfigError, ModelConfig, TransformerLM
from hybridnorm.config import RopeScaling
from hybridnorm.data.tokenizer import ByteTokenizer
from hybridnorm.hf import stock
from hybridnorm.hf.export import export_model, load_hf
from hybridnorm.hf.rope_parameters import to_rope_parameters
from hybridnorm.nn.rope import inv_frequencies

TOL = 1e-5
TABLE_TOL = 3e-5  # transformers' float32 RoPE tables: see the export test
ORIGINAL = 16  # the "pre-training" context of the tiny models; they run 64 positions, 4x past it
SCALINGS = {
    "linear": dict(type="linear", factor=4.0),
    "dynamic": dict(type="dynamic", factor=4.0),
    "llama3": dict(type="llama3", factor=8.0, low_freq_factor=1.0, high_freq_factor=4.0, original_max_seq_len=ORIGINAL),
    "yarn": dict(type="yarn", factor=4.0, original_max_seq_len=ORIGINAL),
    "yarn-untruncated": dict(type="yarn", factor=4.0, original_max_seq_len=ORIGINAL, beta_fast=16.0, beta_slow=0.5,
                             truncate=False),
    "yarn-mscale": dict(type="yarn", factor=4.0, original_max_seq_len=ORIGINAL, mscale=0.707, mscale_all_dim=0.5),
    "yarn-attention-factor": dict(type="yarn", factor=4.0, original_max_seq_len=ORIGINAL, attention_factor=1.3),
}
# real checkpoints' settings: (head_dim, rope_theta, max_seq_len, scaling)
REAL = {
    "llama-3.1": (128, 500_000.0, 131_072, dict(type="llama3", factor=8.0, low_freq_factor=1.0, high_freq_factor=4.0,
                                                original_max_seq_len=8192)),
    "qwen2.5-yarn": (128, 1_000_000.0, 131_072, dict(type="yarn", factor=4.0, original_max_seq_len=32_768)),
    "gpt-oss": (64, 150_000.0, 131_072, dict(type="yarn", factor=32.0, original_max_seq_len=4096, beta_fast=32.0,
                                             beta_slow=1.0, truncate=False)),
    "deepseek-v3": (64, 10_000.0, 163_840, dict(type="yarn", factor=40.0, original_max_seq_len=4096, mscale=1.0,
                                                mscale_all_dim=1.0, beta_fast=32.0, beta_slow=1.0)),
    "linear-x2": (64, 10_000.0, 8192, dict(type="linear", factor=2.0)),
}


def tiny(placement: str = "pre", scaling: dict | None = None, head_dim: int | None = None, **kw) -> ModelConfig:
    """The stock-parity tests' tiny model with its RoPE stretched by ``scaling`` and any field overridden."""
    return ModelConfig(**{**stock_tiny(placement, head_dim=head_dim).to_dict(), "rope_scaling": scaling, **kw})


def randomized(mc: ModelConfig, seed: int = 0) -> TransformerLM:
    torch.manual_seed(seed)
    model = TransformerLM(mc).eval()
    random_gains(model)
    return model


def ids(batch: int = 2, T: int = 64) -> torch.Tensor:
    """Token ids over the whole context by default: 4x the original 16."""
    return stock_ids(batch, T)


def transformers_frequencies(head_dim: int, theta: float, max_len: int, scaling: dict,
                             seq_len: int | None = None) -> tuple[torch.Tensor, float]:
    mc = ModelConfig(d_model=head_dim * 4, n_heads=4, max_seq_len=max_len, rope_theta=theta, rope_scaling=scaling)
    cfg = transformers.LlamaConfig(hidden_size=head_dim * 4, num_attention_heads=4, max_position_embeddings=max_len,
                                   rope_parameters=to_rope_parameters(mc))
    return ROPE_INIT_FUNCTIONS[scaling["type"]](cfg, torch.device("cpu"), seq_len=seq_len)


@pytest.mark.parametrize("case", [*SCALINGS, *REAL, "dynamic-at-4x"])
def test_frequencies_equal_transformers_own(case: str) -> None:
    head_dim, theta, max_len, scaling = REAL.get(case, (8, 10_000.0, 64, SCALINGS.get(case, SCALINGS["dynamic"])))
    seq_len = 256 if case == "dynamic-at-4x" else None  # dynamic NTK changes nothing up to max_len
    ours, ours_factor = inv_frequencies(head_dim, theta, RopeScaling.from_dict(scaling), max_len, seq_len)
    theirs, their_factor = transformers_frequencies(head_dim, theta, max_len, scaling, seq_len)
    plain, _ = inv_frequencies(head_dim, theta)
    assert torch.allclose(ours, plain) == (case == "dynamic")  # the scaling changed something (dynamic: not yet)
    torch.testing.assert_close(ours.float(), theirs, rtol=1e-6, atol=0)  # theirs is float32
    assert ours_factor == pytest.approx(their_factor, rel=1e-12)


@pytest.mark.parametrize(("placement", "class_name", "case", "head_dim"), [
    ("pre", "LlamaForCausalLM", "linear", None),
    ("pre", "LlamaForCausalLM", "llama3", None),
    ("pre", "LlamaForCausalLM", "yarn", 16),
    ("qk_norm", "Qwen3ForCausalLM", "yarn-untruncated", 16),
    ("qk_norm", "Qwen3ForCausalLM", "yarn-mscale", None),
    ("olmo2", "Olmo2ForCausalLM", "yarn-attention-factor", None),
    ("olmo2", "Olmo2ForCausalLM", "llama3", None),
])
def test_export_to_stock_class_matches_past_the_original_context(tmp_path: Path, placement: str, class_name: str,
                                                                  case: str, head_dim: int | None) -> None:
    ours = randomized(tiny(placement, SCALINGS[case], head_dim))
    result = export_model(ours, tmp_path / "hf", ByteTokenizer())
    assert (result.class_name, result.stock) == (class_name, True)
    saved = json.loads((tmp_path / "hf" / "config.json").read_text())["rope_parameters"]
    assert saved["rope_type"] == SCALINGS[case]["type"]
    theirs = getattr(transformers, class_name).from_pretrained(tmp_path / "hf").eval()
    plain = getattr(transformers, class_name).from_pretrained(
        tmp_path / "hf", rope_parameters={"rope_type": "default", "rope_theta": 10_000.0}).eval()
    with torch.no_grad():
        logits, exact = ours(ids()), ours.double()(ids())  # exact: our float64 forward, the reference
        assert (logits - exact).abs().max().item() <= TOL
        # transformers builds its cos/sin tables in float32 whatever the model's dtype (the rotary embedding's
        # forward casts to float), which alone moves the logits at these 64 positions: 1.03e-5 from the
        # reference measured for OLMo-2 + llama3 on an Intel Xeon (ours: 1.8e-6); a 3x margin for other CPUs
        assert (theirs(ids()).logits - exact).abs().max().item() <= TABLE_TOL
        # the control: unscaled RoPE gives other logits on these positions, so the line above could fail
        assert (plain(ids()).logits - exact).abs().max().item() > 1e-3


@pytest.mark.parametrize(("class_name", "case"), [("LlamaForCausalLM", "llama3"), ("Qwen3ForCausalLM", "yarn")])
def test_import_from_a_stock_folder_with_scaled_rope(tmp_path: Path, class_name: str, case: str) -> None:
    """A Llama 3.1-style / Qwen2.5-style folder made by transformers imports with its scaling (before:
    refused), and the logits are the stock model's."""
    arch = next(a for a in stock.ARCHS if a.class_name == class_name)
    placement = "qk_norm" if class_name.startswith("Qwen3") else "pre"
    kwargs = stock.to_hf_config_kwargs(tiny(placement, tie_embeddings=False), arch, eos_token_id=256)
    rope = {"rope_type": SCALINGS[case]["type"], "rope_theta": 10_000.0, "factor": SCALINGS[case]["factor"],
            "original_max_position_embeddings": ORIGINAL}
    if case == "llama3":
        rope.update(low_freq_factor=1.0, high_freq_factor=4.0)
    kwargs["rope_parameters"] = rope
    torch.manual_seed(0)
    theirs = getattr(transformers, class_name)(stock.stock_config_class(arch)(**kwargs)).eval()
    theirs.save_pretrained(tmp_path / "hf")
    ours, _ = load_hf(tmp_path / "hf")
    assert ours.config.rope_scaling == RopeScaling.from_dict({**SCALINGS[case], "original_max_seq_len": ORIGINAL})
    with torch.no_grad():
        assert (ours(ids()) - theirs(ids()).logits).abs().max().item() <= TOL


def _our_folder(tmp_path: Path, scaling: dict | None) -> tuple[Path, TransformerLM]:
    ours = randomized(tiny("hybridnorm_star", scaling))
    export_model(ours, tmp_path / "hf", ByteTokenizer())
    return tmp_path / "hf", ours


def test_our_class_carries_the_scaling_and_generates_with_a_cache(tmp_path: Path) -> None:
    folder, ours = _our_folder(tmp_path, SCALINGS["yarn"])
    hf = transformers.AutoModelForCausalLM.from_pretrained(folder).eval()
    assert type(hf).__name__ == "HybridNormForCausalLM"
    assert hf.config.rope_parameters["rope_type"] == "yarn"
    with torch.no_grad():
        assert (hf(ids()).logits - ours(ids())).abs().max().item() <= TOL
    prompt = ids(1, 20)  # decodes positions 20..59, past the original 16
    cached = hf.generate(prompt, max_new_tokens=40, min_new_tokens=40, do_sample=False)
    uncached = hf.generate(prompt, max_new_tokens=40, min_new_tokens=40, do_sample=False, use_cache=False)
    assert torch.equal(cached, uncached)
    assert torch.equal(cached, ours.generate(prompt, 40, temperature=0))
    hf.save_pretrained(tmp_path / "again")
    again = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "again").eval()
    with torch.no_grad():
        assert torch.equal(again(ids()).logits, hf(ids()).logits)


@pytest.mark.parametrize("spelling", ["rope_parameters", "rope_scaling"])
def test_from_pretrained_with_rope_parameters_extends_the_context(tmp_path: Path, spelling: str) -> None:
    """The way a user stretches a trained model: ``from_pretrained(folder, rope_parameters=...,
    max_position_embeddings=...)`` (or the older ``rope_scaling=``) gives the model built with that scaling
    from the start, not the folder's plain RoPE."""
    folder, plain = _our_folder(tmp_path, None)
    rope = {"rope_type": "linear", "factor": 4.0}
    kw = {spelling: rope if spelling == "rope_parameters" else {"type": "linear", "factor": 4.0}}
    hf = transformers.AutoModelForCausalLM.from_pretrained(folder, max_position_embeddings=256, **kw).eval()
    stretched = TransformerLM(tiny("hybridnorm_star", SCALINGS["linear"], max_seq_len=256)).eval()
    stretched.load_state_dict(plain.state_dict())
    long = torch.randint(0, 257, (1, 200), generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        assert (hf(long).logits - stretched(long)).abs().max().item() <= TOL
        assert (hf(ids()).logits - plain(ids())).abs().max().item() > 1e-3
    # and a rope_theta given the same way still counts (the other spelling of rope_parameters' theta)
    theta = transformers.AutoModelForCausalLM.from_pretrained(folder, rope_theta=1000.0)
    assert theta.model.config.rope_theta == 1000.0 and theta.config.rope_parameters["rope_theta"] == 1000.0


@pytest.mark.parametrize(("rope", "message"), [
    ({"rope_type": "longrope", "short_factor": [1.0], "long_factor": [2.0]},
     r"rope_parameters.rope_type='longrope' is not supported \(LongRoPE's two frequency sets"),
    ({"rope_type": "ntk", "factor": 2.0}, r"valid: 'default', 'linear', 'dynamic', 'llama3', 'yarn'"),
    ({"rope_type": "linear"}, r"rope_parameters.factor is required with rope_parameters.rope_type='linear'"),
    ({"rope_type": "linear", "factor": 0.5}, r"rope_parameters.factor=0.5 must be >= 1"),
    ({"rope_type": "linear", "factor": 2.0, "beta_fast": 8}, r"rope_parameters.beta_fast=8 does nothing with "
                                                             r"rope_type='linear', which reads factor"),
    ({"rope_type": "llama3", "factor": 2.0, "low_freq_factor": 4.0, "high_freq_factor": 1.0},
     r"rope_parameters.high_freq_factor=1 must be > low_freq_factor=4"),
    ({"rope_type": "yarn", "factor": "four"}, r"rope_parameters.factor='four' must be"),
    ({"rope_type": "default", "rope_theta": -1}, r"rope_parameters.rope_theta=-1 must be a finite number > 0"),
    ({"rope_type": "default", "rope_theta": float("inf")}, r"rope_parameters.rope_theta=inf must be a finite number"),
    ({"rope_type": ["linear"]}, r"rope_parameters.rope_type=\['linear'\] is not supported; valid: 'default'"),
    ({"rope_type": "yarn", "factor": float("nan")}, r"rope_parameters.factor=nan must be a finite number"),
    ({"rope_type": "yarn", "factor": 2.0, "original_max_position_embeddings": 2.5},
     r"rope_parameters.original_max_position_embeddings=2.5 must be an integer"),
    ({"rope_type": "default", "partial_rotary_factor": 0.5}, r"partial_rotary_factor=0.5: RoPE on part of a head"),
    ({"full_attention": {"rope_type": "default"}}, r"one RoPE per layer type \(full_attention\) is not supported"),
])
def test_what_cannot_run_is_one_error_naming_the_key(tmp_path: Path, rope: dict, message: str) -> None:
    folder, _ = _our_folder(tmp_path, None)
    with pytest.raises(ConfigError, match=message):
        transformers.AutoModelForCausalLM.from_pretrained(folder, rope_parameters=rope)
    # the same dict in a stock Llama folder is refused by the importer, naming the folder's type
    kwargs = stock.to_hf_config_kwargs(tiny("pre"), stock.BY_TYPE["llama"], eos_token_id=256)
    cfg = transformers.LlamaConfig(**kwargs)
    cfg.rope_parameters = rope
    with pytest.raises(ConfigError, match=r"llama config: .*" + message):
        stock.from_hf_config(cfg)


def test_two_spellings_of_rope_theta_that_disagree_are_refused() -> None:
    from hybridnorm.hf import HybridNormConfig

    kw = dict(hidden_size=32, num_hidden_layers=1, num_attention_heads=4, vocab_size=64)
    with pytest.raises(ConfigError, match=r"rope_theta=10000 and rope_parameters\['rope_theta'\]=20000 .* disagree"):
        HybridNormConfig(**kw, rope_theta=10_000.0, rope_parameters={"rope_type": "default", "rope_theta": 20_000.0})
    with pytest.raises(ConfigError, match=r"rope_scaling=.* and rope_parameters=.* disagree"):
        HybridNormConfig(**kw, rope_scaling={"type": "linear", "factor": 2.0},
                         rope_parameters={"rope_type": "linear", "factor": 3.0})
    # set one after the other: the later one wins, and both read the same afterwards
    cfg = HybridNormConfig(**kw)
    cfg.rope_parameters = {"rope_type": "default", "rope_theta": 777.0}
    assert cfg.model_config().rope_theta == 777.0 and cfg.to_dict()["rope_theta"] == 777.0
    cfg.rope_theta = 555.0
    assert cfg.model_config().rope_theta == 555.0 and cfg.to_dict()["rope_parameters"]["rope_theta"] == 555.0
    assert "_synced_rope_theta" not in cfg.to_json_string()


def test_an_export_from_before_rope_parameters_loads_unscaled(tmp_path: Path) -> None:
    folder, ours = _our_folder(tmp_path, None)
    path = folder / "config.json"
    d = json.loads(path.read_text())
    d.pop("rope_parameters")
    d["hybridnorm"].pop("rope_scaling")
    path.write_text(json.dumps(d))
    hf = transformers.AutoModelForCausalLM.from_pretrained(folder).eval()
    assert hf.model.config.rope_scaling is None
    with torch.no_grad():
        assert torch.equal(hf(ids()).logits, ours(ids()))


@pytest.mark.parametrize("case", [None, "linear", "dynamic", "yarn"])
def test_past_max_position_embeddings_as_stock_llama(tmp_path: Path, case: str | None) -> None:
    """transformers' models take positions past ``max_position_embeddings`` (the number is the context the
    model was made for, not a limit), and dynamic NTK only changes anything there: so do our HF classes
    (``TransformerLM`` alone still refuses, below). Forward of 3x the context and greedy decoding from 20 to
    100 tokens with a KV cache equal stock Llama's with the same weights (dynamic NTK stretches the base at
    every step as the sequence grows, in both)."""
    mc = tiny("pre", SCALINGS[case] if case else None, max_seq_len=32)
    ours = randomized(mc)
    export_model(ours, tmp_path / "hf", ByteTokenizer())
    theirs = transformers.LlamaForCausalLM.from_pretrained(tmp_path / "hf").eval()
    mine = transformers.AutoModelForCausalLM.from_config(hybridnorm.hf.HybridNormConfig.from_model_config(mc)).eval()
    mine.model.load_state_dict(ours.state_dict())
    assert type(mine).__name__ == "HybridNormForCausalLM"
    long = torch.randint(0, 257, (2, 96), generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        assert (mine(long).logits - theirs(long).logits).abs().max().item() <= TOL
    prompt = long[:1, :20]
    # a fresh stock model: its dynamic NTK keeps state from the long forward above (transformers 5.5.x keeps the
    # grown frequencies for the next prompt, 5.24 resets them), ours has none
    theirs = transformers.LlamaForCausalLM.from_pretrained(tmp_path / "hf").eval()
    out = theirs.generate(prompt, max_new_tokens=80, min_new_tokens=80, do_sample=False)
    assert torch.equal(mine.generate(prompt, max_new_tokens=80, min_new_tokens=80, do_sample=False), out)
    with pytest.raises(ValueError, match="sequence of 96 tokens exceeds max_seq_len=32"):
        ours(long)  # the training model keeps its limit


@pytest.mark.parametrize("scaling_type", ["linear", "dynamic", "yarn"])
def test_transformers_rope_scaling_from_config_contract(scaling_type: str) -> None:
    """transformers' own ``test_model_rope_scaling_from_config``, on the backbone, step for step: a model
    built with ``{"rope_type": "default", ..., "original_max_position_embeddings": 16384}`` and one with
    ``{"rope_type": <type>, "factor": 10.0}`` set on the same config, the same seed: on 10 tokens dynamic
    equals the default and the others differ; on 1.5x max_position_embeddings all differ."""
    from hybridnorm.hf import HybridNormConfig, HybridNormModel

    cfg = HybridNormConfig(vocab_size=99, hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
                           num_key_value_heads=2, intermediate_size=37, max_position_embeddings=512)
    short = torch.randint(0, 99, (1, 10), generator=torch.Generator().manual_seed(0))
    long = torch.randint(0, 99, (1, 768), generator=torch.Generator().manual_seed(1))
    outputs = []
    for rope in ({"rope_type": "default", "rope_theta": 10_000.0, "original_max_position_embeddings": 16384},
                 {"rope_type": scaling_type, "factor": 10.0, "rope_theta": 10_000.0}):
        cfg.rope_parameters = {**cfg.rope_parameters, **rope}
        transformers.set_seed(42)
        model = HybridNormModel(cfg).eval()
        with torch.no_grad():
            outputs.append((model(short).last_hidden_state, model(long).last_hidden_state))
    (short_a, long_a), (short_b, long_b) = outputs
    if scaling_type == "dynamic":
        torch.testing.assert_close(short_a, short_b, rtol=1e-5, atol=1e-5)
    else:
        assert not torch.allclose(short_a, short_b, atol=1e-5)
    assert not torch.allclose(long_a, long_b, atol=1e-5)
