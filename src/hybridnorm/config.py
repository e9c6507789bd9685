"""Model configuration: dataclasses that validate, round-trip through YAML/JSON and ``build()``.

Size presets are the paper's Table 9 models plus tiny CPU ones; ``ModelConfig.from_preset("550M",
placement="hybridnorm")`` builds any of them with any placement. Every invalid value raises
:class:`~hybridnorm.errors.ConfigError` naming the field.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, ClassVar, Literal

from hybridnorm import placements as _placements
from hybridnorm.config_base import Config, bounded, check_fields, show
from hybridnorm.errors import ConfigError
from hybridnorm.placements.spec import Placement

if TYPE_CHECKING:
    from hybridnorm.nn.model import TransformerLM

NORMS: tuple[str, ...] = ("rms", "layer", "dyt")
__all__ = ["NORMS", "SIZES", "MoEConfig", "ModelConfig", "RopeScaling", "check_fields"]


@dataclass
class MoEConfig(Config):
    """A dropless Mixture-of-Experts FFN in every block (OLMoE-style: softmax router, top-k)."""

    SECTION: ClassVar[str] = "model.moe"
    num_experts: int = bounded(64, ge=1)
    top_k: int = bounded(8, ge=1)
    expert_hidden_size: int | None = bounded(None, ge=1)  # per expert; None: ModelConfig.ffn_hidden_size
    normalize_topk: bool = False           # OLMoE does not renormalize the top-k probabilities
    lb_loss_weight: float = bounded(0.01, ge=0)
    z_loss_weight: float = bounded(0.001, ge=0)

    def check(self) -> None:
        if self.top_k > self.num_experts:
            raise ConfigError(f"{self.SECTION}.top_k={self.top_k} must be <= num_experts={self.num_experts}")


@dataclass
class RopeScaling(Config):
    """RoPE's frequencies stretched to a context longer than pre-training's, as transformers'
    ``rope_parameters`` name them (the equations: :func:`hybridnorm.nn.rope.inv_frequencies`). ``linear``:
    Position Interpolation; ``dynamic``: dynamic NTK (unchanged up to ``max_seq_len``; past it, which only the HF
    classes reach, the base grows with the longest position of each call); ``llama3``: Llama 3.1's rule (slow
    wavelengths stretched, fast ones kept, a blend between); ``yarn``: YaRN (the same by rotation count, and
    cos/sin scaled by ``attention_factor``)."""

    SECTION: ClassVar[str] = "model.rope_scaling"
    type: Literal["linear", "dynamic", "llama3", "yarn"] = "linear"
    factor: float | None = bounded(None, ge=1)               # required: the context's stretch (new / original)
    original_max_seq_len: int | None = bounded(None, ge=1)   # llama3, yarn: pre-training's context (None: max_seq_len)
    low_freq_factor: float = bounded(1.0, gt=0)              # llama3
    high_freq_factor: float = bounded(4.0, gt=0)             # llama3
    beta_fast: float = bounded(32.0, gt=0)                   # yarn: rotations above which a pair is kept
    beta_slow: float = bounded(1.0, gt=0)                    # yarn: rotations below which it is stretched
    truncate: bool = True                                    # yarn: the ramp's ends rounded to whole pairs
    attention_factor: float | None = bounded(None, gt=0)     # yarn: cos/sin scale (None: from factor, mscale)
    mscale: float | None = bounded(None, gt=0)               # yarn (DeepSeek): attention_factor's numerator weight
    mscale_all_dim: float | None = bounded(None, gt=0)       # yarn (DeepSeek): ... and its denominator's

    # the fields each type reads; any other field set away from its default is refused (it would do nothing)
    FIELDS: ClassVar[dict[str, tuple[str, ...]]] = {
        "linear": ("factor",),
        "dynamic": ("factor",),
        "llama3": ("factor", "original_max_seq_len", "low_freq_factor", "high_freq_factor"),
        "yarn": ("factor", "original_max_seq_len", "beta_fast", "beta_slow", "truncate", "attention_factor",
                 "mscale", "mscale_all_dim"),
    }

    def check(self) -> None:
        if self.factor is None:
            raise ConfigError(f"{self.label('factor')} is required with {self.label('type')}={self.type!r} "
                              "(the context's stretch, new length / pre-training's, e.g. 4.0)")
        used = self.FIELDS[self.type]
        for f in dataclasses.fields(self):
            if f.name not in ("type", *used) and getattr(self, f.name) != f.default:
                raise ConfigError(f"{self.label(f.name)}={show(getattr(self, f.name))} does nothing with "
                                  f"{self.label('type')}={self.type!r}, which reads {', '.join(used)}")
        if self.type == "llama3" and self.high_freq_factor <= self.low_freq_factor:
            raise ConfigError(f"{self.label('high_freq_factor')}={self.high_freq_factor:g} must be > "
                              f"low_freq_factor={self.low_freq_factor:g}")


@dataclass
class ModelConfig(Config):
    """A decoder-only LM. ``placement`` is a preset/grammar name, a dict spec, or a Placement."""

    SECTION: ClassVar[str] = "model"
    vocab_size: int = bounded(8192, ge=1)
    d_model: int = bounded(256, ge=1)
    n_layers: int = bounded(4, ge=1)
    n_heads: int = bounded(4, ge=1)
    n_kv_heads: int | None = bounded(None, ge=1)      # None: = n_heads (no GQA)
    attn_head_dim: int | None = bounded(None, ge=2)   # None: d_model / n_heads (Qwen3: 128 at d=1024, 16 heads)
    ffn_hidden_size: int = bounded(688, ge=1)
    max_seq_len: int = bounded(512, ge=1)
    rope_theta: float = bounded(500_000.0, gt=0)
    tie_embeddings: bool = True
    placement: str | dict[str, Any] | Placement = "hybridnorm_star"
    norm: Literal["rms", "layer", "dyt"] = "rms"
    norm_eps: float = bounded(1e-5, gt=0)
    init: Literal["default", "normal", "megatron", "depth_scaled", "deepnorm"] = "default"  # default: the placement's
    init_std: float | None = bounded(None, gt=0)      # None: 1/sqrt(2.5 d)
    pad_vocab_multiple: int = bounded(1, ge=1)        # embedding rows rounded up to a multiple of this
    moe: MoEConfig | None = None
    rope_scaling: RopeScaling | None = None  # None: RoPE as pre-trained (rope_theta alone)
    fast_kernels: bool = True              # hand-written kernels (hybridnorm.nn.kernels); false: the plain math

    # -- derived ---------------------------------------------------------------------------------

    @property
    def kv_heads(self) -> int:
        return self.n_kv_heads or self.n_heads

    @property
    def head_dim(self) -> int:
        return self.attn_head_dim or self.d_model // self.n_heads

    @property
    def embedding_size(self) -> int:
        m = self.pad_vocab_multiple
        return (self.vocab_size + m - 1) // m * m

    @property
    def std(self) -> float:
        return self.init_std if self.init_std is not None else 1.0 / math.sqrt(2.5 * self.d_model)

    def resolved_placement(self) -> Placement:
        """The placement as a :class:`Placement`, resolved once per value of ``placement`` (a name is
        parsed by the registry, a dict read as a spec) and then reused by every caller."""
        raw, spec = self.__dict__.get("_resolved", (None, None))
        if spec is None or raw is not self.placement:
            p = self.placement
            try:
                spec = Placement.from_dict(p) if isinstance(p, dict) else _placements.get(p)
            except ConfigError as e:
                raise ConfigError(f"model.placement: {e}") from None
            self.__dict__["_resolved"] = (p, spec)
        return spec

    def resolved_init(self) -> str:
        return self.resolved_placement().init if self.init == "default" else self.init

    # -- checks ----------------------------------------------------------------------------------

    def check(self) -> None:
        if self.attn_head_dim is None and self.d_model % self.n_heads:
            raise ConfigError(f"model.n_heads={self.n_heads} must divide d_model={self.d_model} "
                              "(or set model.attn_head_dim)")
        if self.n_kv_heads is not None and self.n_heads % self.n_kv_heads:
            raise ConfigError(f"model.n_kv_heads={self.n_kv_heads} must divide n_heads={self.n_heads}")
        if self.head_dim % 2:
            raise ConfigError(f"model: head dim {self.head_dim} (attn_head_dim or d_model/n_heads) must be even "
                              "for RoPE")
        self.resolved_placement()

    # -- build -----------------------------------------------------------------------------------

    def build(self, device: Any = None) -> TransformerLM:
        from hybridnorm.nn.model import TransformerLM

        if device is None:
            return TransformerLM(self)
        with __import__("torch").device(device):
            return TransformerLM(self)

    @classmethod
    def preset(cls, size: str) -> dict[str, Any]:
        """The fields of a size preset (see :data:`SIZES`), as a dict."""
        key = size.strip().lower()
        if key not in SIZES:
            raise ConfigError(f"size {size!r} is not one of {', '.join(SIZES)}")
        return dict(SIZES[key])

    @classmethod
    def from_preset(cls, size: str, **overrides: Any) -> ModelConfig:
        """A size preset (see :data:`SIZES`) with any field overridden."""
        d = cls.preset(size)
        check_fields("model", overrides, cls)
        d.update(overrides)
        return cls.from_dict(d)


# The paper's Table 9 (vocab 100278 padded to 100352; SwiGLU; tied embeddings for dense; context 4096).
_PAPER = dict(vocab_size=100278, pad_vocab_multiple=128, max_seq_len=4096, rope_theta=500_000.0,
              tie_embeddings=True)
SIZES: dict[str, dict[str, Any]] = {
    "tiny": dict(vocab_size=256, d_model=64, n_layers=2, n_heads=4, n_kv_heads=2, ffn_hidden_size=128,
                 max_seq_len=128),
    "small": dict(vocab_size=8192, d_model=256, n_layers=6, n_heads=8, n_kv_heads=4, ffn_hidden_size=688,
                  max_seq_len=256),
    "tiny-moe": dict(vocab_size=256, d_model=64, n_layers=2, n_heads=4, n_kv_heads=2, ffn_hidden_size=32,
                     max_seq_len=128, tie_embeddings=False,
                     moe=dict(num_experts=8, top_k=2)),
    "151m": dict(_PAPER, d_model=768, n_layers=12, n_heads=16, n_kv_heads=4, ffn_hidden_size=2048),
    "285m": dict(_PAPER, d_model=1024, n_layers=12, n_heads=16, n_kv_heads=4, ffn_hidden_size=4096),
    "550m": dict(_PAPER, d_model=1536, n_layers=16, n_heads=16, n_kv_heads=4, ffn_hidden_size=4096),
    "543m-deep": dict(_PAPER, d_model=1024, n_layers=29, n_heads=16, n_kv_heads=4, ffn_hidden_size=4096),
    "1.2b": dict(_PAPER, d_model=2048, n_layers=16, n_heads=32, n_kv_heads=8, ffn_hidden_size=9192),
    "moe-1b-7b": dict(vocab_size=50280, pad_vocab_multiple=128, max_seq_len=4096, rope_theta=10_000.0,
                      tie_embeddings=False, d_model=2048, n_layers=16, n_heads=16, n_kv_heads=16,
                      ffn_hidden_size=1024, moe=dict(num_experts=64, top_k=8)),
    # MoE-1B-7B with 16 experts instead of 64 (top 8 kept: the same 1.3B active parameters a token, 2.1B in
    # all): the MoE that trains on one 80 GB GPU at seq 4096, where MoE-1B-7B's fp32 weights, gradients and
    # AdamW state alone (~103 GiB) do not fit; not one of the paper's models
    "moe-1b-2b": dict(vocab_size=50280, pad_vocab_multiple=128, max_seq_len=4096, rope_theta=10_000.0,
                      tie_embeddings=False, d_model=2048, n_layers=16, n_heads=16, n_kv_heads=16,
                      ffn_hidden_size=1024, moe=dict(num_experts=16, top_k=8)),
}
