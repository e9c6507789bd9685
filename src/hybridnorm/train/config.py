"""The training run's configuration: model + data + optimizer + loop settings, one YAML file.

``--key=value`` overrides use dotted paths (``--optim.lr=1e-3``, ``--model.n_layers=8``); values are
parsed with YAML's *safe* loader and checked against the field's type, so a typo names the field and
the valid choices instead of silently doing something else.
"""

from __future__ import annotations

import dataclasses
import types
import typing
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

from hybridnorm.config import ModelConfig, check_fields
from hybridnorm.diagnostics.config import DiagnosticsConfig
from hybridnorm.errors import ConfigError
from hybridnorm.train.optim import OptimConfig

PRECISIONS = ("fp32", "bf16")
TOKENIZERS = ("bpe", "bytes")


@dataclass
class DataConfig:
    source: str = "kjv"            # "kjv" (embedded), a local file/folder, or "hf:<dataset>"
    tokenizer: str = "bpe"         # bpe | bytes | path to a tokenizer.json
    vocab_size: int = 8192         # for bpe
    cache_dir: str | None = None   # None: $HYBRIDNORM_CACHE or ~/.cache/hybridnorm

    def validate(self, where: str = "data") -> None:
        if self.tokenizer not in TOKENIZERS and not Path(self.tokenizer).exists():
            raise ConfigError(f"{where}.tokenizer={self.tokenizer!r} is not one of "
                              f"{', '.join(map(repr, TOKENIZERS))} nor an existing tokenizer.json")


def _default_model() -> ModelConfig:
    # The default job: a small HybridNorm* LM that trains in minutes on 2 CPU cores.
    return ModelConfig.from_preset("small", placement="hybridnorm_star")


@dataclass
class TrainConfig:
    model: ModelConfig = field(default_factory=_default_model)
    data: DataConfig = field(default_factory=DataConfig)
    optim: OptimConfig = field(default_factory=lambda: OptimConfig(lr=2e-3, warmup_steps=50))
    batch_size: int = 16           # sequences per process per micro-step
    grad_accum: int = 1
    seq_len: int = 256
    max_steps: int = 480           # the default job: ~7-8 minutes on 2 CPU cores
    max_minutes: float = 0.0       # stop (and checkpoint) after this wall time; 0 = no limit
    stop_after_steps: int = 0      # stop (and checkpoint) after this many steps of this invocation, keeping
                                   # the LR schedule of max_steps (a chunked job; resume later); 0 = no limit
    precision: str = "bf16"        # fp32 | bf16 (autocast)
    compile: bool = False
    device: str = "auto"           # auto | cpu | cuda | cuda:N
    seed: int = 0
    log_interval: int = 10
    eval_interval: int = 100
    eval_batches: int = 16
    ckpt_interval: int = 100
    keep_last: int = 3
    out_dir: str = "runs/default"
    diagnostics: DiagnosticsConfig = field(default_factory=DiagnosticsConfig)  # off unless every > 0

    def __post_init__(self) -> None:
        for name, cls in (("model", ModelConfig), ("data", DataConfig), ("optim", OptimConfig),
                          ("diagnostics", DiagnosticsConfig)):
            value = getattr(self, name)
            if isinstance(value, dict):
                check_fields(name, value, cls)
                setattr(self, name, cls.from_dict(value) if cls is ModelConfig else cls(**value))
        if isinstance(self.optim.betas, list):
            self.optim.betas = tuple(self.optim.betas)
        self.validate()

    def validate(self) -> TrainConfig:
        self.data.validate()
        self.optim.validate()
        self.diagnostics.validate()
        for name in ("batch_size", "grad_accum", "seq_len", "log_interval", "eval_interval", "ckpt_interval"):
            if getattr(self, name) < 1:
                raise ConfigError(f"{name}={getattr(self, name)} must be >= 1")
        for name in ("max_steps", "stop_after_steps"):
            if getattr(self, name) < 0:
                raise ConfigError(f"{name}={getattr(self, name)} must be >= 0")
        if self.precision not in PRECISIONS:
            choices = ", ".join(map(repr, PRECISIONS))
            raise ConfigError(f"precision={self.precision!r} is not one of {choices}")
        if self.seq_len > self.model.max_seq_len:
            raise ConfigError(f"seq_len={self.seq_len} exceeds model.max_seq_len={self.model.max_seq_len}")
        return self

    @property
    def tokens_per_step(self) -> int:
        return self.batch_size * self.grad_accum * self.seq_len

    def to_dict(self) -> dict[str, Any]:
        d = dataclasses.asdict(self)
        d["model"] = self.model.to_dict()
        d["optim"]["betas"] = list(self.optim.betas)
        return d

    def to_yaml(self) -> str:
        return yaml.safe_dump(self.to_dict(), sort_keys=False, allow_unicode=True)

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> TrainConfig:
        if not isinstance(d, dict):
            raise ConfigError(f"train config: expected a mapping, got {type(d).__name__}")
        check_fields("train config", d, cls)
        return cls(**d)

    @classmethod
    def load(cls, path: str | Path, overrides: list[str] | None = None) -> TrainConfig:
        path = Path(path)
        try:
            data = yaml.safe_load(path.read_text(encoding="utf-8")) or {}
        except (OSError, UnicodeDecodeError) as e:
            raise ConfigError(f"cannot read config file {path}: {e}") from None
        except yaml.YAMLError as e:
            raise ConfigError(f"config file {path} is not valid YAML: {e}") from None
        return cls.from_dict(apply_overrides(data, overrides or []))


def _field_type(cls: type, name: str) -> Any:
    hints = typing.get_type_hints(cls)
    return hints[name]


def _coerce(where: str, value: Any, tp: Any) -> Any:
    """Check a parsed override against a field type (int/float/bool/str/None/tuple/dataclass)."""
    origin = typing.get_origin(tp)
    if origin in (typing.Union, types.UnionType):
        for option in typing.get_args(tp):
            try:
                return _coerce(where, value, option)
            except ConfigError:
                continue
        raise ConfigError(f"{where}={value!r} has the wrong type (expected {tp})")
    if tp is type(None):
        if value is None:
            return None
        raise ConfigError(f"{where}={value!r}: expected null")
    if tp is float and isinstance(value, (int, str)) and not isinstance(value, bool):
        try:
            return float(value)  # YAML 1.1 reads "1e-3" as a string
        except ValueError:
            raise ConfigError(f"{where}={value!r} must be a number") from None
    if tp in (int, float, str, bool):
        if isinstance(value, tp) and not (tp is int and isinstance(value, bool)):
            return value
        raise ConfigError(f"{where}={value!r} must be of type {tp.__name__}")
    return value  # nested dicts, tuples, placement specs: validated by the dataclasses themselves


def apply_overrides(data: dict[str, Any], overrides: list[str]) -> dict[str, Any]:
    """Apply ``key.sub=value`` strings to a config dict, checking each key against the dataclasses."""
    data = yaml.safe_load(yaml.safe_dump(data))  # deep copy of plain data
    for item in overrides:
        key, sep, raw = item.lstrip("-").partition("=")
        if not sep:
            raise ConfigError(f"override {item!r} must look like --key=value")
        try:
            value = yaml.safe_load(raw) if raw != "" else ""
        except yaml.YAMLError:
            value = raw
        parts = key.replace("-", "_").split(".")
        cls: Any = TrainConfig
        node = data
        for i, part in enumerate(parts):
            if not dataclasses.is_dataclass(cls):
                raise ConfigError(f"override {key!r}: {'.'.join(parts[:i])} has no sub-fields")
            names = {f.name for f in dataclasses.fields(cls)}
            if part not in names:
                where = ".".join(parts[:i]) or "train config"
                raise ConfigError(f"override {key!r}: {where} has no field {part!r}; valid fields: "
                                  f"{', '.join(sorted(names))}")
            tp = _field_type(cls, part)
            if i == len(parts) - 1:
                node[part] = _coerce(key, value, tp)
            else:
                if not isinstance(node.get(part), dict):
                    node[part] = TrainConfig().to_dict()[part] if i == 0 else {}
                node = node[part]
                cls = next((a for a in (tp, *typing.get_args(tp)) if dataclasses.is_dataclass(a)), None)
    return data
