"""ModelConfig: validation names the field, YAML/JSON round-trips, size presets match the paper."""

import pytest
import torch

import hybridnorm as hn
from hybridnorm import ConfigError, ModelConfig
from hybridnorm.config import RopeScaling
from hybridnorm.train.config import TrainConfig

# SCHEMES.md / paper Table 9 (embedding padded to 100352), in millions.
PAPER_PARAMS = {"151m": 151.4, "285m": 285.2, "550m": 550.5, "543m-deep": 543.7, "1.2b": 1277.0}


@pytest.mark.parametrize("size", sorted(PAPER_PARAMS))
@pytest.mark.parametrize("placement", ["pre", "hybridnorm_star"])
def test_size_presets_match_paper_param_counts(size, placement):
    model = ModelConfig.from_preset(size, placement=placement).build("meta")
    assert model.num_params() / 1e6 == pytest.approx(PAPER_PARAMS[size], abs=0.06)


def test_moe_preset_param_counts():
    model = ModelConfig.from_preset("moe-1b-7b", placement="hybridnorm_star").build("meta")
    assert model.num_params() / 1e9 == pytest.approx(6.9, abs=0.05)           # total
    assert model.num_params(active=True) / 1e9 == pytest.approx(1.3, abs=0.05)  # top-8 of 64 active


def test_one_gpu_moe_preset_is_moe_1b_7b_with_16_experts():
    """moe-1b-2b: every field of MoE-1B-7B but the expert count, so a token's compute is the same; the
    counts by hand: 16 layers x (attention 4 x 2048^2 + 16 experts x 3 x 2048 x 1024 + router 16 x 2048) plus
    untied embedding and head 2 x 50304 x 2048 plus the norms (two per layer, 3 x 128 per-head and a final)."""
    small, big = (ModelConfig.from_preset(s, placement="hybridnorm_star") for s in ("moe-1b-2b", "moe-1b-7b"))
    assert (small.moe.num_experts, small.moe.top_k, big.moe.num_experts) == (16, 8, 64)
    assert {k: v for k, v in small.to_dict().items() if k != "moe"} == {
        k: v for k, v in big.to_dict().items() if k != "moe"}
    model = small.build("meta")
    d, layers, experts = 2048, 16, 16
    by_hand = layers * (4 * d * d + experts * 3 * d * 1024 + experts * d) + 2 * 50304 * d
    norms = sum(p.numel() for n, p in model.named_parameters() if n.endswith("norm.weight"))
    assert model.num_params() == by_hand + norms
    # top 8 either way: the same active experts; only the router, which every token uses, is narrower
    assert big.build("meta").num_params(active=True) - model.num_params(active=True) == layers * (64 - 16) * d


def test_embedding_padding():
    cfg = ModelConfig.from_preset("151m")
    assert (cfg.vocab_size, cfg.embedding_size) == (100278, 100352)


@pytest.mark.parametrize("fmt", ["yaml", "json"])
def test_round_trip(fmt, tmp_path):
    cfg = ModelConfig.from_preset("tiny-moe", placement="Pre-QKV-Post", norm="layer", init="depth_scaled")
    text = cfg.to_yaml() if fmt == "yaml" else cfg.to_json()
    again = ModelConfig.from_yaml(text) if fmt == "yaml" else ModelConfig.from_json(text)
    assert again == cfg
    path = tmp_path / f"c.{fmt}"
    cfg.save(path)
    assert ModelConfig.load(path) == cfg


def test_custom_placement_round_trips_and_builds():
    spec = hn.placements.get("hybridnorm").replace_blocks(qkv_norm_scope="full", qkv_norm_order="after_rope")
    cfg = ModelConfig.from_preset("tiny", placement=spec)
    again = ModelConfig.from_yaml(cfg.to_yaml())
    assert again.resolved_placement() == spec
    assert again.build().blocks[0].attn.q_norm.weight.shape == (64,)  # full width: H * D


@pytest.mark.parametrize(
    ("overrides", "pattern"),
    [
        (dict(n_heads=5), r"n_heads=5 must divide d_model=64"),
        (dict(n_kv_heads=3), r"model.n_kv_heads=3 must divide n_heads=4"),
        (dict(d_model=-8), r"model.d_model=-8 must be >= 1"),
        (dict(n_layers=0), r"model.n_layers=0 must be >= 1"),
        (dict(placement="hybridnrom"), r"placement: placement 'hybridnrom' is not a preset \(b2t, "),
        (dict(norm="batch"), r"norm='batch' is not one of 'rms', 'layer', 'dyt'"),
        (dict(init="xavier"), r"init='xavier' is not one of 'default', 'normal', 'megatron'"),
        (dict(moe=dict(num_experts=4, top_k=5)), r"model\.moe\.top_k=5 must be <= num_experts=4"),
        (dict(moe=dict(num_experts=4, topk=2)), r"moe: unknown field 'topk'"),
        (dict(d_modle=64), r"unknown field 'd_modle'; valid fields: .*d_model"),
        (dict(rope_scaling=dict(type="ntk", factor=2.0)),
         r"model\.rope_scaling\.type='ntk' is not one of 'linear', 'dynamic', 'llama3', 'yarn'"),
        (dict(rope_scaling=dict(type="yarn")),
         r"model\.rope_scaling\.factor is required with model\.rope_scaling\.type"),
        (dict(rope_scaling=dict(type="linear", factor=0.5)), r"model\.rope_scaling\.factor=0\.5 must be >= 1"),
        (dict(rope_scaling=dict(type="linear", factor=2.0, beta_fast=8.0)),
         r"model\.rope_scaling\.beta_fast=8\.0 does nothing with model\.rope_scaling\.type='linear', "
         r"which reads factor"),
        (dict(rope_scaling=dict(type="yarn", factor=2.0, beta=8.0)), r"rope_scaling: unknown field 'beta'"),
    ],
)
def test_bad_config_names_the_field(overrides, pattern):
    with pytest.raises(ConfigError, match=pattern):
        ModelConfig.from_preset("tiny", **overrides)


def test_rope_scaling_from_train_overrides_round_trips_and_builds(tmp_path):
    """As a user types it: ``--model.rope_scaling.*`` overrides build the section, save, load and build."""
    cfg = TrainConfig.from_data({}, ["--model.rope_scaling.type=yarn", "--model.rope_scaling.factor=4",
                                     "--model.rope_scaling.original_max_seq_len=32"])
    assert cfg.model.rope_scaling == RopeScaling(type="yarn", factor=4.0, original_max_seq_len=32)
    cfg.save(tmp_path / "c.yaml")
    assert TrainConfig.load(tmp_path / "c.yaml").model.rope_scaling == cfg.model.rope_scaling
    model = cfg.model.build()
    plain = ModelConfig(**{**cfg.model.to_dict(), "rope_scaling": None}).build()
    assert model.rope_cos.abs().max() > 1.0 >= plain.rope_cos.abs().max()  # YaRN's attention factor scales cos


def test_unknown_size_lists_choices():
    with pytest.raises(ConfigError, match=r"size 'huge' is not one of tiny, small"):
        ModelConfig.from_preset("huge")


def test_bad_config_file_names_the_file(tmp_path):
    bad = tmp_path / "bad.yaml"
    bad.write_text("d_model: [1, 2\n")
    with pytest.raises(ConfigError, match=r"bad\.yaml: config is not valid yaml"):
        ModelConfig.load(bad)
    with pytest.raises(ConfigError, match=r"cannot read config file .*missing\.yaml"):
        ModelConfig.load(tmp_path / "missing.yaml")


def test_yaml_config_text_cannot_run_code():
    with pytest.raises(ConfigError):
        ModelConfig.from_yaml("!!python/object/apply:os.system ['echo pwned']")


@pytest.mark.parametrize("fmt", ["yaml", "json"])
def test_a_key_given_twice_is_refused_not_silently_overwritten(fmt, tmp_path):
    """YAML and JSON parsers keep the last of two equal keys; a config must not train with one of two
    values the user wrote without saying so. A merge (``<<: *base``) may still override its keys."""
    text = {"yaml": "n_layers: 2\nd_model: 64\nd_model: 128\n",
            "json": '{"n_layers": 2, "d_model": 64, "d_model": 128}'}[fmt]
    path = tmp_path / f"twice.{fmt}"
    path.write_text(text)
    with pytest.raises(ConfigError, match=rf"twice\.{fmt}: config is not valid {fmt}: .*duplicate key 'd_model'"):
        ModelConfig.load(path)
    nested = tmp_path / "nested.yaml"  # a duplicate inside a section, as in the train config
    nested.write_text("model:\n  d_model: 64\n  n_layers: 2\n  d_model: 64\n")
    with pytest.raises(ConfigError, match=r"nested\.yaml: .*duplicate key 'd_model'.*line 4"):
        TrainConfig.load(nested)
    merged = ModelConfig.from_yaml("<<: {d_model: 64, n_layers: 2}\nd_model: 128\n")
    assert (merged.d_model, merged.n_layers) == (128, 2)


@pytest.mark.parametrize("fmt", ["yaml", "json"])
def test_config_nested_too_deeply_is_one_clear_error(fmt, tmp_path):
    path = tmp_path / f"deep.{fmt}"
    path.write_text('{"d_model": ' + "[" * 50_000 + "]" * 50_000 + "}")  # deeper than the parser's recursion
    with pytest.raises(ConfigError, match=rf"deep\.{fmt}: config is not valid {fmt}: nested deeper than 100 levels"):
        ModelConfig.load(path)
    with pytest.raises(ConfigError, match=r"model\.d_model="):  # on the command line: one error naming the field
        TrainConfig.from_cli(None, ["--model.d_model=" + "[" * 50_000])


@pytest.mark.parametrize(
    ("scheme", "out_std"),
    [("normal", 1.0), ("megatron", 1 / 8 ** 0.5), ("depth_scaled", None), ("deepnorm", (8 * 4) ** -0.25)],
)
def test_init_schemes(scheme, out_std):
    torch.manual_seed(0)
    cfg = ModelConfig(vocab_size=512, d_model=256, n_layers=4, n_heads=4, ffn_hidden_size=512,
                      placement="pre", init=scheme, tie_embeddings=False)
    model = hn.TransformerLM(cfg)
    sigma = 1 / (2.5 * 256) ** 0.5
    assert cfg.std == pytest.approx(sigma)
    for depth, block in enumerate(model.blocks, start=1):
        expect = sigma * (out_std if out_std is not None else 1 / (2 * depth) ** 0.5)
        for w in (block.attn.w_o.weight, block.ffn.w_out.weight):
            assert w.std().item() == pytest.approx(expect, rel=0.08)
            assert w.abs().max().item() <= 3 * expect + 1e-7  # truncated at 3σ
        q_rows = block.attn.w_qkv.weight[:256]
        assert q_rows.std().item() == pytest.approx(sigma, rel=0.08)
    head_std = 1 / 256 ** 0.5 if scheme in ("megatron", "depth_scaled") else sigma
    assert model.lm_head.weight.std().item() == pytest.approx(head_std, rel=0.08)
    assert all(torch.all(n.weight == 1) for n in model.modules() if isinstance(n, hn.nn.RMSNorm))


def test_default_init_follows_placement():
    assert ModelConfig.from_preset("tiny", placement="pre").resolved_init() == "normal"
    assert ModelConfig.from_preset("tiny", placement="hybridnorm_star").resolved_init() == "megatron"
    assert ModelConfig.from_preset("tiny", placement="deepnorm").resolved_init() == "deepnorm"
    assert ModelConfig.from_preset("tiny", placement="pre", init="megatron").resolved_init() == "megatron"


def test_shipped_yaml_configs_load():
    from pathlib import Path

    files = sorted((Path(__file__).resolve().parents[1] / "configs" / "model").glob("*.yaml"))
    assert files
    for f in files:
        cfg = ModelConfig.load(f)
        assert cfg.to_dict() == ModelConfig.from_yaml(cfg.to_yaml()).to_dict()
