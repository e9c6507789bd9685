"""Model configuration: dataclasses that validate, round-trip through YAML/JSON and ``build()``.

Size presets are the paper's Table 9 models plus tiny CPU ones; ``ModelConfig.from_preset("550M",
placement="hybridnorm")`` builds any of them with any placement. Every invalid value raises
:class:`~hybridnorm.errors.ConfigError` naming the field.
"""

from __future__ import annotations

import dataclasses
import json
import math
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import yaml

from hybridnorm import placements as _placements
from hybridnorm.errors import ConfigError
from hybridnorm.placements.spec import INITS, Placement

if TYPE_CHECKING:
    from hybridnorm.nn.model import TransformerLM

NORMS: tuple[str, ...] = ("rms", "layer", "dyt")


@dataclass
class MoEConfig:
    """A dropless Mixture-of-Experts FFN in every block (OLMoE-style: softmax router, top-k)."""

    num_experts: int = 64
    top_k: int = 8
    expert_hidden_size: int | None = None  # per expert; None: ModelConfig.ffn_hidden_size
    normalize_topk: bool = False           # OLMoE does not renormalize the top-k probabilities
    lb_loss_weight: float = 0.01
    z_loss_weight: float = 0.001

    def validate(self, where: str = "moe") -> None:
        if self.num_experts < 1:
            raise ConfigError(f"{where}.num_experts={self.num_experts} must be >= 1")
        if not 1 <= self.top_k <= self.num_experts:
            raise ConfigError(f"{where}.top_k={self.top_k} must be in [1, num_experts={self.num_experts}]")
        if self.expert_hidden_size is not None and self.expert_hidden_size < 1:
            raise ConfigError(f"{where}.expert_hidden_size={self.expert_hidden_size} must be >= 1")
        for name in ("lb_loss_weight", "z_loss_weight"):
            if getattr(self, name) < 0:
                raise ConfigError(f"{where}.{name}={getattr(self, name)} must be >= 0")


@dataclass
class ModelConfig:
    """A decoder-only LM. ``placement`` is a preset/grammar name, a dict spec, or a Placement."""

    vocab_size: int = 8192
    d_model: int = 256
    n_layers: int = 4
    n_heads: int = 4
    n_kv_heads: int | None = None          # None: = n_heads (no GQA)
    attn_head_dim: int | None = None       # None: d_model / n_heads (Qwen3 decouples: 128 at d=1024, 16 heads)
    ffn_hidden_size: int = 688
    max_seq_len: int = 512
    rope_theta: float = 500_000.0
    tie_embeddings: bool = True
    placement: str | dict[str, Any] | Placement = "hybridnorm_star"
    norm: str = "rms"                      # rms | layer | dyt
    norm_eps: float = 1e-5
    init: str = "default"                  # "default" (the placement's) or one of placements.spec.INITS
    init_std: float | None = None          # None: 1/sqrt(2.5 d)
    pad_vocab_multiple: int = 1            # embedding rows rounded up to a multiple of this
    moe: MoEConfig | None = None
    fast_kernels: bool = True              # hand-written kernels (hybridnorm.nn.kernels); false: the plain math

    def __post_init__(self) -> None:
        if isinstance(self.moe, dict):
            check_fields("moe", self.moe, MoEConfig)
            self.moe = MoEConfig(**self.moe)
        self.validate()

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
        p = self.placement
        return Placement.from_dict(p) if isinstance(p, dict) else _placements.get(p)

    def resolved_init(self) -> str:
        return self.resolved_placement().init if self.init == "default" else self.init

    # -- checks ----------------------------------------------------------------------------------

    def validate(self) -> ModelConfig:
        for name in ("vocab_size", "d_model", "n_layers", "n_heads", "ffn_hidden_size", "max_seq_len",
                     "pad_vocab_multiple"):
            v = getattr(self, name)
            if not isinstance(v, int) or isinstance(v, bool) or v < 1:
                raise ConfigError(f"ModelConfig.{name}={v!r} must be a positive integer")
        if self.attn_head_dim is not None and (not isinstance(self.attn_head_dim, int) or self.attn_head_dim < 2):
            raise ConfigError(f"ModelConfig.attn_head_dim={self.attn_head_dim!r} must be an integer >= 2 or null")
        if self.attn_head_dim is None and self.d_model % self.n_heads:
            raise ConfigError(f"ModelConfig.n_heads={self.n_heads} must divide d_model={self.d_model}")
        if self.n_kv_heads is not None and (self.n_kv_heads < 1 or self.n_heads % self.n_kv_heads):
            raise ConfigError(f"ModelConfig.n_kv_heads={self.n_kv_heads} must be >= 1 and divide "
                              f"n_heads={self.n_heads}")
        if self.head_dim % 2:
            raise ConfigError(f"ModelConfig: head dim {self.head_dim} (attn_head_dim or d_model/n_heads) must be even "
                              "for RoPE")
        if not self.rope_theta > 0:
            raise ConfigError(f"ModelConfig.rope_theta={self.rope_theta} must be > 0")
        if self.norm not in NORMS:
            raise ConfigError(f"ModelConfig.norm={self.norm!r} is not one of {', '.join(map(repr, NORMS))}")
        if not self.norm_eps > 0:
            raise ConfigError(f"ModelConfig.norm_eps={self.norm_eps} must be > 0")
        if self.init not in ("default", *INITS):
            raise ConfigError(f"ModelConfig.init={self.init!r} is not one of "
                              f"{', '.join(map(repr, ('default', *INITS)))}")
        if self.init_std is not None and not self.init_std > 0:
            raise ConfigError(f"ModelConfig.init_std={self.init_std} must be > 0")
        try:
            self.resolved_placement()
        except ConfigError as e:
            raise ConfigError(f"ModelConfig.placement: {e}") from None
        if self.moe is not None:
            self.moe.validate("ModelConfig.moe")
        if not isinstance(self.fast_kernels, bool):
            raise ConfigError(f"ModelConfig.fast_kernels={self.fast_kernels!r} must be true or false")
        return self

    # -- build and (de)serialize -----------------------------------------------------------------

    def build(self, device: Any = None) -> TransformerLM:
        from hybridnorm.nn.model import TransformerLM

        if device is None:
            return TransformerLM(self)
        with __import__("torch").device(device):
            return TransformerLM(self)

    def to_dict(self) -> dict[str, Any]:
        d = dataclasses.asdict(self)
        if isinstance(self.placement, Placement):
            d["placement"] = self.placement.to_dict()
        return d

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> ModelConfig:
        if not isinstance(d, dict):
            raise ConfigError(f"ModelConfig: expected a mapping, got {type(d).__name__}")
        check_fields("ModelConfig", d, cls)
        return cls(**d)

    def to_yaml(self) -> str:
        return yaml.safe_dump(self.to_dict(), sort_keys=False, allow_unicode=True)

    @classmethod
    def from_yaml(cls, text: str) -> ModelConfig:
        try:
            data = yaml.safe_load(text)  # safe: no tags that construct objects
        except yaml.YAMLError as e:
            raise ConfigError(f"config is not valid yaml: {e}") from None
        return cls.from_dict(data)

    def to_json(self) -> str:
        return json.dumps(self.to_dict(), indent=2, ensure_ascii=False)

    @classmethod
    def from_json(cls, text: str) -> ModelConfig:
        try:
            data = json.loads(text)
        except json.JSONDecodeError as e:
            raise ConfigError(f"config is not valid json: {e}") from None
        return cls.from_dict(data)

    @classmethod
    def load(cls, path: str | Path) -> ModelConfig:
        """Read a ``.yaml``/``.yml``/``.json`` file (safe loaders only: no code in config text)."""
        path = Path(path)
        try:
            text = path.read_text(encoding="utf-8")
        except (OSError, UnicodeDecodeError) as e:
            raise ConfigError(f"cannot read config file {path}: {e}") from None
        try:
            return cls.from_json(text) if path.suffix == ".json" else cls.from_yaml(text)
        except ConfigError as e:
            raise ConfigError(f"config file {path}: {e}") from None

    def save(self, path: str | Path) -> None:
        path = Path(path)
        path.write_text(self.to_json() if path.suffix == ".json" else self.to_yaml(), encoding="utf-8")

    @classmethod
    def from_preset(cls, size: str, **overrides: Any) -> ModelConfig:
        """A size preset (see :data:`SIZES`) with any field overridden."""
        key = size.strip().lower()
        if key not in SIZES:
            raise ConfigError(f"size {size!r} is not one of {', '.join(SIZES)}")
        d = dict(SIZES[key])
        check_fields("ModelConfig", overrides, cls)
        d.update(overrides)
        return cls.from_dict(d)


def check_fields(where: str, d: dict[str, Any], cls: type) -> None:
    names = {f.name for f in dataclasses.fields(cls)}
    for key in d:
        if key not in names:
            raise ConfigError(f"{where}: unknown field {key!r}; valid fields: {', '.join(sorted(names))}")


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
}
