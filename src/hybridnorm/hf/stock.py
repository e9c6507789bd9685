"""Placements that stock ``transformers`` architectures express exactly, and the weight maps both ways.

A model exports to a stock class only if that class computes the same function, checked on the
*resolved* per-layer specs (not on the preset's name), so ``Pre-QK-Pre`` from the grammar exports like
the ``qk_norm`` preset, and HybridNorm* never pretends to be Llama:

=============  =================================  ===============  ===========================
stock class    block (every layer identical)      Q/K norms        FFN
=============  =================================  ===============  ===========================
Llama          Pre-Norm                           none             SwiGLU
Mistral (1)    Pre-Norm, no sliding window        none             SwiGLU
Phi3 (1)       Pre-Norm, no sliding window        none             SwiGLU (fused, as Q/K/V)
Qwen3          Pre-Norm                           per head, d_h    SwiGLU
Olmo2          reordered: x + N(G(x))             full width       SwiGLU
Mixtral        Pre-Norm                           none             MoE, top-k renormalized
Qwen3Moe       Pre-Norm                           per head, d_h    MoE
Olmoe          Pre-Norm                           full width       MoE
FlexOlmo       reordered: x + N(G(x))             full width       MoE
=============  =================================  ===============  ===========================

(1) import only: the same function as Llama's, so an export writes Llama. Phi-3 stores Q/K/V as one
``qkv_proj`` and gate/up as one ``gate_up_proj``, in our fused layouts' order.

Common conditions: RMSNorm, one ε everywhere, no embedding norm, a final norm, α = β = 1, no 1/√l norm
scaling, Q/K normed before RoPE, no V or C norm. Weight layouts: our fused ``w_qkv`` rows are
``[q; k; v]``, the dense ``w_in`` rows ``[gate; up]``; expert ``w_in`` is (E, d, 2h) with columns
``[gate | up]`` and ``w_out`` (E, h, d), i.e. the transposes of HF's ``gate_up_proj`` (E, 2h, d) and
``down_proj`` (E, d, h).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor

from hybridnorm import placements
from hybridnorm.config import ModelConfig, MoEConfig
from hybridnorm.errors import ConfigError
from hybridnorm.hf.rope_parameters import from_rope_parameters, to_rope_parameters
from hybridnorm.placements.spec import BlockSpec, Placement, SublayerSpec

PRE = SublayerSpec(in_norm=True, skip="input")
REORDERED = SublayerSpec(in_norm=False, skip="input", out_norm=True)


@dataclass(frozen=True)
class StockArch:
    model_type: str      # HF config.model_type
    class_name: str      # the transformers *ForCausalLM class
    sublayer: str        # "pre" | "reordered"
    qk_norm: str         # "" | "head" | "full"
    moe: bool
    # the config class declares head_dim, so an export may set it != hidden_size / heads (the others' config.json
    # may still carry one, which their modeling reads: an import honours it, an export writes our own class)
    free_head_dim: bool
    # Mixtral always renormalizes the top-k gate weights; the others follow config.norm_topk_prob.
    renormalizes_topk: bool | None = None
    fused: bool = False  # Q/K/V in one qkv_proj and gate/up in one gate_up_proj (Phi-3), as ours are

    @property
    def placement(self) -> Placement:
        """Our placement for this class: the registry preset with the same block if there is one
        (``pre``, ``qk_norm``, ``olmo2``), else a spec named after the class."""
        sub = PRE if self.sublayer == "pre" else REORDERED
        block = BlockSpec(attn=sub, ffn=sub, qkv_norm="QK" if self.qk_norm else "",
                          qkv_norm_scope=self.qk_norm or "head")
        for name in placements.names():
            p = placements.get(name)
            if (p.block, p.overrides, p.embed_norm, p.final_norm) == (block, (), False, True):
                return p
        return Placement(name=f"{self.model_type}_like", block=block, final_norm=True, init="normal",
                         summary=f"the block of HF {self.class_name}", source=f"transformers {self.class_name}")


ARCHS: tuple[StockArch, ...] = (
    StockArch("llama", "LlamaForCausalLM", "pre", "", False, True),
    # after Llama, so an export picks Llama (match_stock takes the first class that fits): Mistral's and
    # Phi-3's classes compute Llama's function but for a sliding window, which an import refuses when set
    StockArch("mistral", "MistralForCausalLM", "pre", "", False, True),
    StockArch("phi3", "Phi3ForCausalLM", "pre", "", False, False, fused=True),
    StockArch("qwen3", "Qwen3ForCausalLM", "pre", "head", False, True),
    StockArch("olmo2", "Olmo2ForCausalLM", "reordered", "full", False, False),
    StockArch("mixtral", "MixtralForCausalLM", "pre", "", True, True, renormalizes_topk=True),
    StockArch("qwen3_moe", "Qwen3MoeForCausalLM", "pre", "head", True, True),
    StockArch("olmoe", "OlmoeForCausalLM", "pre", "full", True, False),
    StockArch("flex_olmo", "FlexOlmoForCausalLM", "reordered", "full", True, False),
)
BY_TYPE = {a.model_type: a for a in ARCHS}


def match_stock(mc: ModelConfig) -> tuple[StockArch | None, str]:
    """The stock architecture that computes exactly ``mc``'s function, or None and the reason why not."""
    p = mc.resolved_placement()
    if mc.norm != "rms":
        return None, f"norm={mc.norm!r}: the stock classes use RMSNorm"
    if p.embed_norm:
        return None, "an embedding norm: no stock class has one"
    if p.dual_stream:
        return None, "ResiDual's second stream: no stock class has one"
    if not p.final_norm:
        return None, "no final norm: every stock class has one"
    specs = set(p.blocks(mc.n_layers))
    if len(specs) > 1:
        return None, f"per-layer overrides ({len(specs)} different blocks): stock classes repeat one block"
    b = specs.pop()
    if b.alpha(mc.n_layers) != 1.0 or b.branch_scale != 1.0:
        return None, "residual/branch scales α, β != 1"
    if b.depth_scaled_norms:
        return None, "1/sqrt(layer) norm scaling (LayerNorm Scaling)"
    letters = "".join(sorted(b.qkv_norm.upper()))
    if letters not in ("", "KQ"):
        return None, f"attention norms on {b.qkv_norm!r}: stock classes norm at most Q and K"
    if letters and b.qkv_norm_order != "before_rope":
        return None, "Q/K norms after RoPE: the stock classes norm before it"
    if (b.attn, b.ffn) == (PRE, PRE):
        sublayer = "pre"
    elif (b.attn, b.ffn) == (REORDERED, REORDERED):
        sublayer = "reordered"
    else:
        return None, "its sublayers are neither Pre-Norm nor OLMo-2's reordered norm in both A and F"
    qk = b.qkv_norm_scope if letters else ""
    for arch in ARCHS:
        if (arch.sublayer, arch.qk_norm, arch.moe) != (sublayer, qk, mc.moe is not None):
            continue
        if mc.head_dim * mc.n_heads != mc.d_model and not arch.free_head_dim:
            return None, f"attn_head_dim={mc.head_dim} != d_model/n_heads: {arch.class_name} derives it"
        if mc.moe is not None and arch.renormalizes_topk is not None \
                and arch.renormalizes_topk != mc.moe.normalize_topk:
            return None, f"moe.normalize_topk={mc.moe.normalize_topk}: {arch.class_name} always renormalizes"
        return arch, f"{p.name} computes exactly what {arch.class_name} does"
    kind = "MoE" if mc.moe is not None else "dense"
    return None, f"no stock {kind} class has {sublayer} sublayers with Q/K norm scope {qk or 'none'!r}"


# -- configs ------------------------------------------------------------------------------------------

def to_hf_config_kwargs(mc: ModelConfig, arch: StockArch, eos_token_id: int | None = None,
                        bos_token_id: int | None = None) -> dict[str, Any]:
    """Keyword arguments for the stock config class of ``arch`` describing ``mc``. The special token ids
    are set explicitly: the classes' defaults are their pretrained vocabularies' ids, not ours (bos: the
    eos unless given, as our tokenizers start a document after their end-of-text token)."""
    kw: dict[str, Any] = dict(
        bos_token_id=eos_token_id if bos_token_id is None else bos_token_id, eos_token_id=eos_token_id,
        pad_token_id=None,
        vocab_size=mc.embedding_size, hidden_size=mc.d_model, intermediate_size=mc.ffn_hidden_size,
        num_hidden_layers=mc.n_layers, num_attention_heads=mc.n_heads, num_key_value_heads=mc.kv_heads,
        max_position_embeddings=mc.max_seq_len, rms_norm_eps=mc.norm_eps, hidden_act="silu",
        tie_word_embeddings=mc.tie_embeddings, attention_bias=False,
        rope_parameters=to_rope_parameters(mc))
    if arch.free_head_dim:
        kw["head_dim"] = mc.head_dim
    if arch.model_type == "llama":
        kw["mlp_bias"] = False
    if mc.moe is not None:
        moe = mc.moe
        hidden = moe.expert_hidden_size or mc.ffn_hidden_size
        kw.update(num_experts_per_tok=moe.top_k, router_aux_loss_coef=moe.lb_loss_weight)
        if arch.model_type == "mixtral":
            kw.update(num_local_experts=moe.num_experts, intermediate_size=hidden, router_jitter_noise=0.0)
        else:
            kw.update(num_experts=moe.num_experts, norm_topk_prob=moe.normalize_topk)
            if arch.model_type == "qwen3_moe":
                kw.update(moe_intermediate_size=hidden, decoder_sparse_step=1, mlp_only_layers=[])
            else:
                kw["intermediate_size"] = hidden
    return kw


def _get(cfg: Any, name: str, default: Any = None) -> Any:
    return getattr(cfg, name, default)


def from_hf_config(cfg: Any) -> tuple[ModelConfig, StockArch]:
    """A stock HF config -> (ModelConfig, arch); refuses anything the stock-to-ours map would get wrong."""
    arch = BY_TYPE.get(_get(cfg, "model_type"))
    if arch is None:
        raise ConfigError(f"cannot import model_type={_get(cfg, 'model_type')!r}: importable stock types are "
                          f"{', '.join(BY_TYPE)} (and hybridnorm's own)")
    where = f"{arch.model_type} config"
    act = _get(cfg, "hidden_act", "silu")
    if act != "silu":
        raise ConfigError(f"{where}: hidden_act={act!r}; hybridnorm's FFN is SwiGLU (silu)")
    if _get(cfg, "attention_bias", False) or _get(cfg, "mlp_bias", False):
        raise ConfigError(f"{where}: attention_bias/mlp_bias are on; hybridnorm's projections have no bias")
    if _get(cfg, "clip_qkv") is not None:
        raise ConfigError(f"{where}: clip_qkv={_get(cfg, 'clip_qkv')} is not supported")
    if _get(cfg, "use_sliding_window", False) or (arch.model_type in ("mixtral", "mistral", "phi3")
                                                  and _get(cfg, "sliding_window")):
        raise ConfigError(f"{where}: sliding-window attention is not supported (sliding_window="
                          f"{_get(cfg, 'sliding_window')})")
    layer_types = _get(cfg, "layer_types") or ()
    if any(t != "full_attention" for t in layer_types):  # transformers' caches make a sliding layer of it
        raise ConfigError(f"{where}: layer_types={list(layer_types)}: only full_attention layers are supported")
    try:
        theta, rope_scaling = from_rope_parameters(_get(cfg, "rope_parameters") or {})
    except ConfigError as e:
        raise ConfigError(f"{where}: {e}") from None
    d, heads = cfg.hidden_size, cfg.num_attention_heads
    # every stock class's attention and RoPE read ``getattr(config, "head_dim", hidden / heads)``, so a head_dim
    # in config.json counts even where the config class does not declare one (OLMo-2, Phi-3, OLMoE, FlexOlmo):
    # deriving it there built a model whose Q/K/V shapes were not the folder's
    head_dim = _get(cfg, "head_dim") or d // heads
    if arch.model_type == "olmoe" and head_dim * heads != d:
        raise ConfigError(f"{where}: head_dim={head_dim} != hidden_size / num_attention_heads = {d // heads}: OLMoE's "
                          "q_norm is hidden_size wide, so no model (transformers' own neither) runs these weights")
    moe = None
    ffn = cfg.intermediate_size
    if arch.moe:
        if arch.model_type == "qwen3_moe":
            if _get(cfg, "decoder_sparse_step", 1) != 1 or _get(cfg, "mlp_only_layers"):
                raise ConfigError(f"{where}: dense layers among MoE ones (decoder_sparse_step/mlp_only_layers)")
            ffn = cfg.moe_intermediate_size
        n_exp = cfg.num_local_experts if arch.model_type == "mixtral" else cfg.num_experts
        norm_topk = True if arch.model_type == "mixtral" else bool(cfg.norm_topk_prob)
        moe = MoEConfig(num_experts=n_exp, top_k=cfg.num_experts_per_tok, normalize_topk=norm_topk,
                        lb_loss_weight=float(_get(cfg, "router_aux_loss_coef", 0.01) or 0.0))
    mc = ModelConfig(
        vocab_size=cfg.vocab_size, d_model=d, n_layers=cfg.num_hidden_layers, n_heads=heads,
        n_kv_heads=_get(cfg, "num_key_value_heads") or heads, ffn_hidden_size=ffn,
        attn_head_dim=None if head_dim * heads == d else head_dim,
        max_seq_len=cfg.max_position_embeddings, rope_theta=theta or 10000.0, rope_scaling=rope_scaling,
        tie_embeddings=bool(_get(cfg, "tie_word_embeddings", False)), placement=arch.placement.to_dict(),
        norm="rms", norm_eps=float(cfg.rms_norm_eps), init="normal", moe=moe)
    return mc, arch


# -- weights ------------------------------------------------------------------------------------------

def _layer_map(mc: ModelConfig, arch: StockArch, i: int) -> list[tuple[str, str]]:
    """(our name, HF name) pairs that copy one-to-one for layer i (the fused ones are handled apart)."""
    ours, hf = f"blocks.{i}.", f"model.layers.{i}."
    pairs = [(f"{ours}attn.w_o.weight", f"{hf}self_attn.o_proj.weight")]
    if arch.qk_norm:
        pairs += [(f"{ours}attn.q_norm.weight", f"{hf}self_attn.q_norm.weight"),
                  (f"{ours}attn.k_norm.weight", f"{hf}self_attn.k_norm.weight")]
    if arch.sublayer == "pre":
        pairs += [(f"{ours}attn_norm.weight", f"{hf}input_layernorm.weight"),
                  (f"{ours}ffn_norm.weight", f"{hf}post_attention_layernorm.weight")]
    else:
        pairs += [(f"{ours}attn_out_norm.weight", f"{hf}post_attention_layernorm.weight"),
                  (f"{ours}ffn_out_norm.weight", f"{hf}post_feedforward_layernorm.weight")]
    if arch.moe:
        pairs.append((f"{ours}ffn.router.weight", f"{hf}mlp.gate.weight"))
    else:
        pairs.append((f"{ours}ffn.w_out.weight", f"{hf}mlp.down_proj.weight"))
    return pairs


def to_hf_state_dict(sd: dict[str, Tensor], mc: ModelConfig, arch: StockArch) -> dict[str, Tensor]:
    """Our state dict -> the stock class's (in-memory module names of transformers >= 5)."""
    H, Hkv, D = mc.n_heads, mc.kv_heads, mc.head_dim
    out = {"model.embed_tokens.weight": sd["embed.weight"], "model.norm.weight": sd["final_norm.weight"]}
    out["lm_head.weight"] = sd["embed.weight"] if mc.tie_embeddings else sd["lm_head.weight"]
    for i in range(mc.n_layers):
        out.update({hf: sd[ours] for ours, hf in _layer_map(mc, arch, i)})
        hf = f"model.layers.{i}."
        if arch.fused:
            out[f"{hf}self_attn.qkv_proj.weight"] = sd[f"blocks.{i}.attn.w_qkv.weight"]
            out[f"{hf}mlp.gate_up_proj.weight"] = sd[f"blocks.{i}.ffn.w_in.weight"]
            continue
        q, k, v = sd[f"blocks.{i}.attn.w_qkv.weight"].split((H * D, Hkv * D, Hkv * D))
        out.update({f"{hf}self_attn.q_proj.weight": q, f"{hf}self_attn.k_proj.weight": k,
                    f"{hf}self_attn.v_proj.weight": v})
        if arch.moe:
            out[f"{hf}mlp.experts.gate_up_proj"] = sd[f"blocks.{i}.ffn.w_in"].transpose(1, 2)  # (E, 2h, d)
            out[f"{hf}mlp.experts.down_proj"] = sd[f"blocks.{i}.ffn.w_out"].transpose(1, 2)  # (E, d, h)
        else:
            gate, up = sd[f"blocks.{i}.ffn.w_in.weight"].chunk(2)
            out.update({f"{hf}mlp.gate_proj.weight": gate, f"{hf}mlp.up_proj.weight": up})
    return {k: v.contiguous() for k, v in out.items()}


def from_hf_state_dict(sd: dict[str, Tensor], mc: ModelConfig, arch: StockArch) -> dict[str, Tensor]:
    """The stock class's state dict -> ours (the inverse of :func:`to_hf_state_dict`)."""
    def take(name: str) -> Tensor:
        if name not in sd:
            raise ConfigError(f"{arch.class_name} weights have no {name!r}; is this a transformers >= 5 model?")
        return sd[name]

    out = {"embed.weight": take("model.embed_tokens.weight"), "final_norm.weight": take("model.norm.weight")}
    if not mc.tie_embeddings:
        out["lm_head.weight"] = take("lm_head.weight")
    for i in range(mc.n_layers):
        out.update({ours: take(hf) for ours, hf in _layer_map(mc, arch, i)})
        hf = f"model.layers.{i}."
        if arch.fused:
            out[f"blocks.{i}.attn.w_qkv.weight"] = take(f"{hf}self_attn.qkv_proj.weight")
            out[f"blocks.{i}.ffn.w_in.weight"] = take(f"{hf}mlp.gate_up_proj.weight")
            continue
        out[f"blocks.{i}.attn.w_qkv.weight"] = torch.cat([take(f"{hf}self_attn.{n}_proj.weight") for n in "qkv"])
        if arch.moe:
            out[f"blocks.{i}.ffn.w_in"] = take(f"{hf}mlp.experts.gate_up_proj").transpose(1, 2)
            out[f"blocks.{i}.ffn.w_out"] = take(f"{hf}mlp.experts.down_proj").transpose(1, 2)
        else:
            out[f"blocks.{i}.ffn.w_in.weight"] = torch.cat([take(f"{hf}mlp.gate_proj.weight"),
                                                       take(f"{hf}mlp.up_proj.weight")])
    return {k: v.contiguous() for k, v in out.items()}


def stock_config_class(arch: StockArch) -> type:
    import transformers

    return getattr(transformers, arch.class_name.replace("ForCausalLM", "Config"))


def stock_model_class(arch: StockArch) -> type:
    import transformers

    return getattr(transformers, arch.class_name)

