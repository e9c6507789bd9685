"""What transformers' own model tests and tools expect of a model class, checked on ours through
transformers' entry points: ``initializer_range`` is the σ every random draw scales with (its
``_config_zero_init`` check), weights a checkpoint lacks are drawn as a constructed model draws them,
``resize_token_embeddings(mean_resizing=False)`` draws new rows as the scheme does (not torch's N(0, 1)),
packed sequences under a 4-D mask equal separate rows, ``activation_checkpointing_enable`` keeps the
gradients, and a bad standard field is refused under the name the caller gave it."""

from __future__ import annotations

import json
import math
import re
from pathlib import Path

import pytest
import torch

pytest.importorskip("transformers", reason="the hf extra (transformers) is not installed")
from transformers import LlamaConfig, OlmoeConfig, PreTrainedModel, set_seed
from transformers.modeling_outputs import BaseModelOutputWithPast
from transformers.trainer_utils import unwrap_peft_model

import hybridnorm as hn
from hybridnorm import ConfigError
from hybridnorm.hf import HybridNormConfig, HybridNormForCausalLM, HybridNormModel
from hybridnorm.hf.configuration import MOE_ONLY

V, D = 99, 32


def config(**kw) -> HybridNormConfig:
    """Built from standard fields alone, as transformers' CausalLMModelTester builds its configs."""
    return HybridNormConfig(**{**dict(vocab_size=V, hidden_size=D, num_hidden_layers=2, num_attention_heads=2,
                                      num_key_value_heads=2, intermediate_size=37, max_position_embeddings=64,
                                      pad_token_id=0), **kw})


def trunc_std(sigma: float) -> float:
    """The standard deviation of N(0, σ²) truncated at ±3σ."""
    a = 3.0
    pdf = math.exp(-a * a / 2) / math.sqrt(2 * math.pi)
    return sigma * math.sqrt(1 - 2 * a * pdf / math.erf(a / math.sqrt(2)))


@pytest.mark.parametrize("placement", hn.placements.names())
def test_a_vanishing_initializer_range_leaves_every_random_weight_at_zero(placement: str) -> None:
    """transformers' test_initialization: σ -> 1e-10 must take every random draw with it (norm gains stay 1)."""
    model = HybridNormForCausalLM(config(placement=placement, initializer_range=1e-10))
    for name, p in model.named_parameters():
        mean = round(p.mean().item() * 1e9) / 1e9
        assert mean in (0.0, 1.0), f"{name}: mean {p.mean().item()}"


def test_initializer_range_is_the_init_sigma_and_round_trips(tmp_path: Path) -> None:
    default = config()
    assert default.initializer_range is None  # the scheme's own default, 1/sqrt(2.5 d)
    assert default.model_config().std == pytest.approx(1 / math.sqrt(2.5 * D))
    cfg = config(initializer_range=0.05, tie_word_embeddings=False, placement="pre_norm")
    assert cfg.model_config().init_std == 0.05 and cfg.to_dict()["hybridnorm"]["init_std"] == 0.05
    torch.manual_seed(0)
    model = HybridNormForCausalLM(cfg)
    for w in (model.model.embed.weight, model.model.blocks[0].attn.w_qkv.weight, model.model.lm_head.weight):
        assert w.std().item() == pytest.approx(trunc_std(0.05), rel=0.1)
    cfg.save_pretrained(tmp_path)
    assert HybridNormConfig.from_pretrained(tmp_path).model_config().init_std == 0.05


def test_an_untied_head_keeps_the_papers_sigma_under_the_megatron_scheme() -> None:
    """HybridNorm's Table 10 draws the untied head with 1/sqrt(d) whatever σ is: a vanishing
    initializer_range shrinks every other weight, not that one."""
    model = HybridNormForCausalLM(config(placement="hybridnorm_star", tie_word_embeddings=False,
                                         initializer_range=1e-10))
    assert model.model.lm_head.weight.std().item() == pytest.approx(trunc_std(1 / math.sqrt(D)), rel=0.1)
    assert model.model.embed.weight.abs().max().item() < 1e-9


@pytest.mark.parametrize("tie", [True, False])
def test_resize_without_mean_resizing_draws_new_rows_as_the_scheme_does(tie: bool) -> None:
    torch.manual_seed(0)
    model = HybridNormForCausalLM(config(placement="pre_norm", initializer_range=0.02, tie_word_embeddings=tie))
    old_in = model.get_input_embeddings().weight.detach().clone()
    model.resize_token_embeddings(V + 400, mean_resizing=False)
    new_in = model.get_input_embeddings().weight.detach()
    assert model.config.vocab_size == V + 400 and torch.equal(new_in[:V], old_in)
    assert new_in[V:].std().item() == pytest.approx(trunc_std(0.02), rel=0.1)  # torch's default draw: 1.0
    if tie:  # still tied: one weight, no head module of its own
        assert model.model.lm_head is None and model.get_output_embeddings().weight is model.model.embed.weight
    else:
        head = model.get_output_embeddings().weight.detach()
        assert head.shape[0] == V + 400 and head[V:].std().item() == pytest.approx(trunc_std(0.02), rel=0.1)
    with torch.no_grad():
        assert torch.isfinite(model(torch.tensor([[V + 399, 3, V + 1]])).logits).all()


@pytest.mark.parametrize("cls", [HybridNormModel, HybridNormForCausalLM])
def test_weights_a_checkpoint_lacks_are_drawn_as_a_constructed_model_draws_them(cls, monkeypatch) -> None:
    """transformers' test_can_init_all_missing_weights: with every module's init seeded alike, a model loaded
    from an empty state dict (built on the meta device, then initialized) equals one constructed directly;
    with a partial one, the given weights are kept exactly."""
    if not hasattr(PreTrainedModel, "_initialize_weights"):
        pytest.skip("this transformers has no PreTrainedModel._initialize_weights to seed")
    original = PreTrainedModel._initialize_weights

    def seeded(self, module, *args, **kwargs):
        set_seed(0)
        return original(self, module, *args, **kwargs)

    monkeypatch.setattr(PreTrainedModel, "_initialize_weights", seeded)
    built = cls(config())
    loaded = cls.from_pretrained(None, config=config(), state_dict={})
    for (name, a), (name_b, b) in zip(built.state_dict().items(), loaded.state_dict().items(), strict=True):
        assert name == name_b and torch.equal(a, b), name
    torch.manual_seed(1)
    donor = cls(config())
    given = {k: v for k, v in donor.state_dict().items() if ".blocks.0." not in k}
    partial = cls.from_pretrained(None, config=config(), state_dict=given)
    state = partial.state_dict()
    assert all(torch.equal(state[k], v) for k, v in given.items())
    assert all(torch.isfinite(v).all() for v in state.values())


@torch.no_grad()
def test_packed_sequences_under_a_4d_mask_equal_separate_rows() -> None:
    """Three sequences packed in one row, each attending only to itself, positions restarting at 0."""
    import oracle

    model = HybridNormForCausalLM(config(placement="hybridnorm_star", num_hidden_layers=3)).eval()
    oracle.randomize_(model.model, seed=0)
    g = torch.Generator().manual_seed(2)
    seqs = [torch.randint(1, V, (n,), generator=g) for n in (4, 6, 3)]
    doc = torch.cat([torch.full((len(s),), i) for i, s in enumerate(seqs)])  # (T,) which sequence a token is in
    T = len(doc)
    allowed = (doc[:, None] == doc[None, :]) & torch.ones(T, T, dtype=torch.bool).tril()
    mask = torch.zeros(1, 1, T, T).masked_fill(~allowed, torch.finfo(torch.float32).min)  # additive, as HF writes
    pos = torch.cat([torch.arange(len(s)) for s in seqs])[None]
    packed = model(torch.cat(seqs)[None], attention_mask=mask, position_ids=pos).logits[0]
    alone = torch.cat([model(s[None]).logits[0] for s in seqs])
    assert (packed - alone).abs().max() < 1e-5


@pytest.mark.parametrize("every", [1, 2])
def test_activation_checkpointing_enable_gives_the_plain_gradients(every: int) -> None:
    if not hasattr(PreTrainedModel, "activation_checkpointing_enable"):
        pytest.skip("this transformers has no activation_checkpointing_enable")
    torch.manual_seed(0)
    plain = HybridNormForCausalLM(config(num_hidden_layers=4)).train()
    ckpt = HybridNormForCausalLM(config(num_hidden_layers=4)).train()
    ckpt.load_state_dict(plain.state_dict())
    ckpt.activation_checkpointing_enable(every_n_layers=every)
    ids = torch.randint(1, V, (3, 9), generator=torch.Generator().manual_seed(3))
    plain(ids, labels=ids).loss.backward()
    ckpt(ids, labels=ids).loss.backward()
    for (name, p), q in zip(plain.named_parameters(), ckpt.parameters(), strict=True):
        assert torch.allclose(p.grad, q.grad, atol=1e-7), name


@pytest.mark.parametrize(("kwargs", "names"), [
    ({"hidden_size": 0}, "hidden_size (model.d_model)=0 must be >= 1"),
    ({"num_attention_heads": 3}, "num_attention_heads (model.n_heads)=3 must divide"),
    ({"initializer_range": -1.0}, "initializer_range (model.init_std)=-1.0 must be > 0"),
    ({"vocab_size": 0}, "model.vocab_size=0 must be >= 1"),
    ({"hybridnorm": {"d_model": -3}}, "hidden_size (model.d_model)=-3"),
    ({"tie_word_embeddings": "yes"}, "tie_word_embeddings (model.tie_embeddings)='yes' must be true or false"),
    ({"hybridnorm": "pre", "tie_word_embeddings": True}, "hybridnorm must be a dict of hybridnorm.ModelConfig"),
])
def test_a_bad_standard_field_is_refused_under_both_names(kwargs: dict, names: str) -> None:
    with pytest.raises(ConfigError) as err:
        HybridNormConfig(**kwargs)
    assert names in str(err.value)


def test_moe_from_standard_fields_equals_moe_from_a_model_config(tmp_path: Path) -> None:
    """OLMoE's / Qwen-MoE's field names build the same MoE model as ModelConfig.moe, round-trip through
    config.json, and its loss carries the router losses."""
    from hybridnorm import ModelConfig
    from hybridnorm.config import MoEConfig

    cfg = config(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=12, norm_topk_prob=True,
                 router_aux_loss_coef=0.02, router_z_loss_coef=0.0)
    want = MoEConfig(num_experts=4, top_k=2, expert_hidden_size=12, normalize_topk=True, lb_loss_weight=0.02,
                     z_loss_weight=0.0)
    assert cfg.model_config().moe == want
    mc = ModelConfig(vocab_size=V, d_model=D, n_layers=2, n_heads=2, n_kv_heads=2, ffn_hidden_size=37, max_seq_len=64,
                     moe=want)
    torch.manual_seed(0)
    ours = HybridNormForCausalLM(cfg).eval()
    theirs = HybridNormForCausalLM(HybridNormConfig.from_model_config(mc)).eval()
    theirs.load_state_dict(ours.state_dict())
    ids = torch.randint(1, V, (2, 7), generator=torch.Generator().manual_seed(4))
    with torch.no_grad():
        a, b = ours(ids, labels=ids), theirs(ids, labels=ids)
    assert torch.equal(a.logits, b.logits) and torch.equal(a.loss, b.loss)
    cfg.save_pretrained(tmp_path)
    back = HybridNormConfig.from_pretrained(tmp_path)
    assert back.model_config().moe == want and (back.num_experts, back.num_experts_per_tok) == (4, 2)
    dense = config()
    assert not hasattr(dense, "num_experts") and dense.model_config().moe is None


@pytest.mark.parametrize(("kwargs", "names"), [
    ({"num_experts_per_tok": 2}, "num_experts_per_tok given for a dense model: set num_experts"),
    ({"num_experts": 2, "num_experts_per_tok": 3}, "num_experts_per_tok (model.moe.top_k)=3 must be <="),
    ({"num_experts": 2, "num_experts_per_tok": 1, "router_aux_loss_coef": -1.0},
     "router_aux_loss_coef (model.moe.lb_loss_weight)=-1.0 must be >= 0"),
])
def test_bad_moe_fields_are_refused_by_name_never_built_dense(kwargs: dict, names: str) -> None:
    with pytest.raises(ConfigError) as err:
        config(**kwargs)
    assert names in str(err.value)


@pytest.mark.parametrize(("kwargs", "names"), [
    ({"hidden_act": "gelu"}, "hidden_act='gelu' is not supported: the FFN is SwiGLU, whose gate is silu (only 'silu')"),
    ({"attention_bias": True}, "attention_bias=True is not supported: the attention projections have no bias"),
    ({"mlp_bias": True}, "mlp_bias=True is not supported: the FFN projections have no bias"),
    ({"use_sliding_window": True}, "use_sliding_window=True is not supported"),
    ({"sliding_window": 8}, "sliding_window=8 is not supported: every layer attends to the whole context"),
    ({"attention_dropout": 1.5}, "attention_dropout=1.5 must be a number in [0, 1)"),
    ({"attention_dropout": "high"}, "attention_dropout='high' must be a finite number"),
])
def test_another_architectures_field_that_would_change_the_function_is_refused(tmp_path: Path, kwargs: dict,
                                                                                names: str) -> None:
    """A Llama/Mistral/Qwen config's fields given to our class (a keyword, a config.json edited or built
    from another model's dict) were kept as attributes and ignored: a "gelu" model ran SwiGLU. Refused by
    name: at construction and from a folder's config.json."""
    from transformers import AutoModelForCausalLM

    with pytest.raises(ConfigError) as err:
        config(**kwargs)
    assert names in str(err.value)
    HybridNormForCausalLM(config()).save_pretrained(tmp_path)
    # a keyword the loaded config has no attribute for goes to the model class, which takes none (transformers'
    # own rule, stock Llama alike): a TypeError naming it, never a model built without it
    if "attention_dropout" not in kwargs:  # a field of ours: set on the loaded config, then checked at build
        with pytest.raises(TypeError, match=f"unexpected keyword argument '{next(iter(kwargs))}'"):
            AutoModelForCausalLM.from_pretrained(tmp_path, **kwargs)
    path = tmp_path / "config.json"
    path.write_text(json.dumps({**json.loads(path.read_text()), **kwargs}))
    with pytest.raises(ConfigError, match=re.escape(names)):
        AutoModelForCausalLM.from_pretrained(tmp_path)
    # the values that fit, or a window switched off (as Qwen3's configs carry one), are fine
    config(hidden_act="silu", attention_bias=False, mlp_bias=False, use_sliding_window=False, sliding_window=4096)


def test_a_placement_beside_the_dict_that_names_another_is_refused_not_ignored(tmp_path: Path) -> None:
    """``placement`` only shows the ``hybridnorm`` dict's placement; edited in a config.json or given to
    ``from_pretrained`` it used to be overwritten silently, the model built as the dict said."""
    from transformers import AutoModelForCausalLM

    HybridNormForCausalLM(config(hybridnorm={"placement": "hybridnorm_star"})).save_pretrained(tmp_path)
    with pytest.raises(ConfigError, match=r"placement='post' is not the model's placement: hybridnorm.placement "
                                          r"\('hybridnorm_star'\) is"):
        AutoModelForCausalLM.from_pretrained(tmp_path, placement="post")
    with pytest.raises(ConfigError, match=r"placement='nonsense': placement 'nonsense' is not a preset"):
        AutoModelForCausalLM.from_pretrained(tmp_path, placement="nonsense")
    path = tmp_path / "config.json"
    path.write_text(json.dumps({**json.loads(path.read_text()), "placement": "pre"}))
    with pytest.raises(ConfigError, match=r"placement='pre' is not the model's placement"):
        AutoModelForCausalLM.from_pretrained(tmp_path)
    # another name of the same structure (the paper's grammar, a display name) is the same model
    path.write_text(json.dumps({**json.loads(path.read_text()), "placement": "HybridNorm*"}))
    assert AutoModelForCausalLM.from_pretrained(tmp_path).config.placement == "hybridnorm_star"


@pytest.mark.parametrize(("dict_placement", "named"), [
    ("Pre-Pre", "pre"), ("Pre-Pre", "pre_ln"), ("pre", "Pre-Pre"),
    ({"name": "mine", "block": {"attn": {"in_norm": True}, "ffn": {"in_norm": True}}}, "Pre-Norm"),
    # the init a placement draws fresh weights with by default is no part of a loaded model (as on resume)
    ({"name": "mine", "init": "megatron", "block": {"attn": {"in_norm": True}, "ffn": {"in_norm": True}}}, "pre"),
    # nor how its blocks are written: compared as built, mix_ln's ⌊0.25·L⌋ Post-Norm blocks are none at L = 2
    ("mix_ln", "pre"), ("pre", "mix_ln"),
    ({"name": "mine", "block": {"attn": {"in_norm": True}, "ffn": {"in_norm": True}},
      "overrides": [{"block": {"attn": {"in_norm": True}, "ffn": {"in_norm": True}}, "first_n": 1}]}, "pre"),
])
def test_a_placement_beside_the_dict_that_names_its_spec_in_other_words_is_the_same_model(
        tmp_path: Path, dict_placement, named: str) -> None:
    """The grammar's ``Pre-Pre`` and the preset ``pre`` build one spec but describe it differently (summary,
    source), as does a spec of one's own with Pre-Norm's blocks: ``placement='pre'`` beside such a dict was
    refused as 'not the model's placement' though the weights were made for exactly it."""
    from transformers import AutoModelForCausalLM

    HybridNormForCausalLM(config(hybridnorm={"placement": dict_placement})).save_pretrained(tmp_path)
    loaded = AutoModelForCausalLM.from_pretrained(tmp_path, placement=named)
    have = loaded.config.model_config().resolved_placement()
    mine = dict_placement if isinstance(dict_placement, str) else hn.placements.Placement.from_dict(dict_placement)
    assert have == hn.placements.get(mine) and have.built(2) == hn.placements.get("pre").built(2)


@pytest.mark.parametrize("norm", ["rms", "layer", "dyt"])
def test_loading_in_bf16_generates_for_every_norm_kind(tmp_path: Path, norm: str) -> None:
    """``from_pretrained(..., dtype=torch.bfloat16)`` (and transformers' ``test_eager_matches_sdpa_inference``)
    casts every weight, norm gains included: the norms still compute in fp32. A LayerNorm model failed here
    ("mixed dtype (CPU)"). Its logits are those of the fp32 load within bf16 rounding (tests/nn/
    test_low_precision_weights.py bounds them against fp32 math), and it generates."""
    from transformers import AutoModelForCausalLM

    torch.manual_seed(0)
    HybridNormForCausalLM(config(hybridnorm={"placement": "hybridnorm_star", "norm": norm})).save_pretrained(tmp_path)
    low = AutoModelForCausalLM.from_pretrained(tmp_path, dtype=torch.bfloat16).eval()
    full = AutoModelForCausalLM.from_pretrained(tmp_path).eval()
    assert low.dtype == torch.bfloat16 and all(p.dtype == torch.bfloat16 for p in low.parameters())
    ids = torch.randint(1, V, (2, 8), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        a, b = low(ids).logits, full(ids).logits
    assert a.dtype == torch.bfloat16
    assert ((a.float() - b).abs().max() / b.abs().max()).item() < 0.08
    out = low.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=5, min_new_tokens=5, do_sample=False)
    assert out.shape == (2, 13)


@torch.no_grad()
@pytest.mark.parametrize("kw", [{}, {"tie_word_embeddings": False}, {"num_experts": 4, "num_experts_per_tok": 2},
                                {"placement": "resi_dual"}], ids=["tied", "untied", "moe", "resi_dual"])
def test_base_model_and_output_embeddings_give_the_logits_to_tools_that_apply_the_head(kw: dict) -> None:
    """transformers' contract, which TRL's trainers rely on (their fused LM head): ``base_model`` is the
    decoder without its head, called with the backbone's arguments (``get_decoder()`` too), and
    ``get_output_embeddings()`` has the head's ``weight`` and ``bias``: applying them gives the LM's logits,
    tied or not. The backbone of an LM and an ``AutoModel`` are their own base models, as Llama's are."""
    torch.manual_seed(0)
    model = HybridNormForCausalLM(config(**kw)).eval()
    names = list(model.state_dict())
    ids = torch.randint(1, V, (2, 9), generator=torch.Generator().manual_seed(1))
    mask = torch.ones_like(ids)
    mask[0, :3] = 0  # left padding
    logits = model(ids, attention_mask=mask).logits
    hidden = model.base_model(input_ids=ids, attention_mask=mask, use_cache=False)
    assert isinstance(hidden, BaseModelOutputWithPast)
    head = model.get_output_embeddings()
    assert isinstance(head, torch.nn.Linear)  # transformers' test_model_get_set_embeddings: None or a Linear
    assert torch.equal(torch.nn.functional.linear(hidden.last_hidden_state, head.weight, head.bias), logits)
    assert torch.equal(head(hidden.last_hidden_state), logits)
    assert torch.equal(model.get_decoder()(ids, attention_mask=mask).last_hidden_state, hidden.last_hidden_state)
    if model.model.lm_head is None:
        assert head.weight is model.model.embed.weight and head.bias is None
    backbone = HybridNormModel(model.config).eval()
    backbone.load_state_dict(model.state_dict(), strict=False)  # the untied head's weight stays unused there
    assert backbone.base_model is backbone and backbone.get_decoder() is backbone
    assert torch.equal(backbone(ids, attention_mask=mask).last_hidden_state, hidden.last_hidden_state)
    # nothing is held twice and no name changes; no tool takes the LM for a PEFT wrapper or a TP/PP plan
    assert list(model.state_dict()) == names and all(not n.startswith(("tied_head", "decoder")) for n in names)
    assert unwrap_peft_model(model) is model
    assert (model.supports_tp_plan, model.supports_pp_plan) == (False, False)


def test_moe_fields_are_attributes_of_an_moe_config_only_as_in_stock_configs(tmp_path: Path) -> None:
    """Tools tell an MoE by its config's attributes: TRL's trainers add a router loss to any config that has
    ``output_router_logits``, weighted by ``router_aux_loss_coef``. A dense config has none of the MoE
    fields, as Llama's has none; an MoE config has them all, as OLMoE's has its own."""
    stock_dense, stock_moe = LlamaConfig(), OlmoeConfig()
    assert not any(hasattr(stock_dense, n) for n in MOE_ONLY)
    assert all(hasattr(stock_moe, n) for n in ("num_experts", "output_router_logits", "router_aux_loss_coef"))
    dense = config(output_router_logits=True)  # ignored on a dense model, as Llama does
    assert not any(hasattr(dense, n) for n in MOE_ONLY)
    dense.save_pretrained(tmp_path / "dense")
    assert not any(hasattr(HybridNormConfig.from_pretrained(tmp_path / "dense"), n) for n in MOE_ONLY)
    moe = config(num_experts=4, num_experts_per_tok=2)
    assert (moe.output_router_logits, moe.router_aux_loss_coef) == (False, moe.model_config().moe.lb_loss_weight)
    moe.output_router_logits = True
    moe.save_pretrained(tmp_path / "moe")
    back = HybridNormConfig.from_pretrained(tmp_path / "moe")
    assert all(hasattr(back, n) for n in MOE_ONLY) and back.output_router_logits is True
