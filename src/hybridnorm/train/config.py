"""The training run's configuration: model + data + optimizer + loop settings, one YAML file.

``--key=value`` overrides use dotted paths (``--optim.lr=1e-3``, ``--model.n_layers=8``); values are
read with YAML's *safe* loader and every field is type- and range-checked by the one config mechanism
(:mod:`hybridnorm.config_base`), so a typo names the field and the valid choices instead of silently
doing something else.
"""

from __future__ import annotations

import dataclasses
import re
import typing
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, ClassVar, Literal

from hybridnorm.config import ModelConfig
from hybridnorm.config_base import Config, bounded, check_bounds, check_fields, coerce
from hybridnorm.config_text import read_file
from hybridnorm.data.prepare import PreparedData, prepare_data
from hybridnorm.data.tokenizer import MIN_BPE_VOCAB
from hybridnorm.diagnostics.config import DiagnosticsConfig
from hybridnorm.errors import ConfigError
from hybridnorm.nn.attention import AttentionBackend
from hybridnorm.train.optim import OptimConfig

TOKENIZERS = ("bpe", "bytes")
DEVICE = re.compile(r"auto|cpu|cuda(:\d+)?|mps")


@dataclass
class DataConfig(Config):
    SECTION: ClassVar[str] = "data"
    source: str = "kjv"            # "kjv" (embedded), a local file/folder, or "hf:<dataset>"
    tokenizer: str = "bpe"         # bpe | bytes | path to a tokenizer.json
    vocab_size: int = bounded(8192, ge=MIN_BPE_VOCAB)  # for bpe
    cache_dir: str | None = None   # None: $HYBRIDNORM_CACHE or ~/.cache/hybridnorm
    text_field: str = "text"       # a .jsonl record's field / a .parquet column / an hf: dataset's column
    stop_tokens: tuple[str, ...] = ()  # tokens besides the tokenizer's end-of-text token at which generation
                                   # ends (an imported chat model's <|eot_id|> / <|im_end|>: its folder's other
                                   # eos ids); vocabulary entries of the tokenizer. Training does not use them

    def check(self) -> None:
        if not self.source.strip():
            raise ConfigError("data.source='' must name a corpus: kjv, kjv-bigval, a local file/folder or hf:<name>")
        if not self.text_field.strip():
            raise ConfigError("data.text_field='' must name the field of a .jsonl record / the column of a .parquet "
                              "file or hf: dataset that holds the text (default: text)")
        if self.cache_dir is not None and not self.cache_dir.strip():  # "" would be the current folder
            raise ConfigError("data.cache_dir='' is empty: leave it out ($HYBRIDNORM_CACHE, else "
                              "~/.cache/hybridnorm) or name a folder")
        if any(not token for token in self.stop_tokens):
            raise ConfigError(f"data.stop_tokens={list(self.stop_tokens)!r}: a stop token is one vocabulary entry, "
                              "not ''"[:300])
        if self.tokenizer not in TOKENIZERS and not (self.tokenizer.strip() and Path(self.tokenizer).exists()):
            raise ConfigError(f"data.tokenizer={self.tokenizer!r} is not one of "
                              f"{', '.join(map(repr, TOKENIZERS))} nor an existing tokenizer.json")

    def prepare(self) -> PreparedData:
        """The corpus tokenized as this section says (the shared token cache): the one place every field
        reaches ``prepare_data``, for the trainer and every tool that reads a run's or a grid point's data."""
        return prepare_data(self.source, tokenizer=self.tokenizer, vocab_size=self.vocab_size,
                            cache_dir=self.cache_dir, text_field=self.text_field)


def _default_model() -> ModelConfig:
    # The default job: a small HybridNorm* LM that trains in minutes on 2 CPU cores.
    return ModelConfig.from_preset("small", placement="hybridnorm_star")


@dataclass
class TrainConfig(Config):
    model: ModelConfig = field(default_factory=_default_model)
    data: DataConfig = field(default_factory=DataConfig)
    optim: OptimConfig = field(default_factory=lambda: OptimConfig(lr=2e-3, warmup_steps=50))
    batch_size: int = bounded(16, ge=1)       # sequences per process per micro-step
    grad_accum: int = bounded(1, ge=1)        # micro-batches per optimizer step
    global_batch: int = bounded(0, ge=0)      # sequences per optimizer step over all processes; 0: processes x
                                              # batch_size x grad_accum. The run's invariant: a resume keeps the
                                              # checkpoint's and re-splits it (hybridnorm.train.batch_split)
    seq_len: int = bounded(256, ge=1)
    max_steps: int = bounded(480, ge=0)       # the default job: ~7-8 minutes on 2 CPU cores
    max_minutes: float = bounded(0.0, ge=0)   # stop (and checkpoint) after this wall time; 0 = no limit
    stop_after_steps: int = bounded(0, ge=0)  # stop (and checkpoint) after this many steps of this invocation,
                                              # keeping the LR schedule of max_steps (resume later); 0 = no limit
    precision: Literal["auto", "fp32", "bf16"] = "auto"  # bf16: autocast; auto: bf16 where it is faster
                                              # on this device (hybridnorm.train.precision), fp32 elsewhere
    compile: bool = False                     # torch.compile each block (hybridnorm.nn.regional): compiles once
    head_loss: Literal["auto", "eager", "compiled"] = "auto"  # the LM head + loss: eager = the model's own
                                              # (fused kernel, no logits kept); compiled = the plain line under
                                              # torch.compile (faster on a GPU, keeps bf16 logits: nn/regional.py);
                                              # auto: compiled on CUDA with compile=true, else eager
    activation_checkpointing: bool = False    # recompute each block's activations in backward: less memory,
                                              # about one more forward of the blocks per step
    attention: AttentionBackend = "auto"      # the SDPA kernel tried first
                                              # (nn.attention.attention_backend): auto = torch's order (flash
                                              # first on CUDA); cudnn: Hopper's fastest; math: the plain twin
    float8: bool = False                      # the blocks' four big linears in float8 (nn/kernels/float8.py):
                                              # needs bf16; pays only on float8 tensor cores (H100-class GPUs)
    host_sync: Literal["auto", "step", "log"] = "auto"  # read loss / grad norm back every step or at check
                                              # steps only (auto: log on CUDA); see hybridnorm.train.host_sync
    parallel: Literal["ddp", "fsdp"] = "ddp"  # under torchrun: replicate (DDP) or shard (FSDP2) the model;
                                              # a process not under torchrun ignores it (train/parallel.py)
    parallel_replicate: int = bounded(1, ge=1)  # fsdp: R > 1 is HSDP, R replicas x (world / R) shards
    device: str = "auto"                      # auto | cpu | cuda | cuda:N | mps
    dist_timeout: float = bounded(600.0, gt=0)  # under torchrun: seconds any collective waits for the other
                                              # ranks before the job fails with an error naming the rank
    seed: int = bounded(0, ge=0, le=2**64 - 1)  # torch's generators take 64 bits
    log_interval: int = bounded(10, ge=1)
    eval_interval: int = bounded(100, ge=1)
    eval_batches: int = bounded(16, ge=1)      # validation: this many global batches of windows (the same ones
                                              # for every split of the global batch over processes and micro-batches)
    ckpt_interval: int = bounded(100, ge=1)
    keep_last: int = bounded(3, ge=0)         # checkpoints kept; 0 = all
    async_checkpoint: bool = False            # write checkpoint files while the next steps run (published
                                              # when complete, before the next save and before exit)
    out_dir: str = "runs/default"
    diagnostics: DiagnosticsConfig = field(default_factory=DiagnosticsConfig)  # off unless every > 0

    def check(self) -> None:
        if self.seq_len > self.model.max_seq_len:
            raise ConfigError(f"seq_len={self.seq_len} exceeds model.max_seq_len={self.model.max_seq_len}")
        if not DEVICE.fullmatch(self.device):
            raise ConfigError(f"device={self.device!r} is not one of 'auto', 'cpu', 'cuda', 'cuda:N', 'mps'")
        if not self.out_dir.strip():
            raise ConfigError("out_dir='' must name a run folder")
        if self.host_sync == "log" and self.diagnostics.skip_spikes:
            raise ConfigError("host_sync='log' reads the loss only at check steps, but diagnostics.skip_spikes=true "
                              "decides on it before every update: use host_sync=step or auto")
        if self.float8 and self.precision == "fp32":
            raise ConfigError("float8=true runs the matmuls in float8 under bf16 autocast: it needs precision='bf16' "
                              "(or 'auto' where that picks bf16), not 'fp32'")
        if self.parallel_replicate > 1 and self.parallel != "fsdp":
            raise ConfigError(f"parallel_replicate={self.parallel_replicate} needs parallel='fsdp' (HSDP: "
                              "replicas of a sharded model)")

    def compiles_head_loss(self, device_type: str) -> bool:
        """Whether the trainer compiles the LM head + loss (``head_loss``; auto: on CUDA under compile=true,
        where it measured faster than the fused kernel, hybridnorm.nn.regional.compile_head_loss)."""
        if self.head_loss == "auto":
            return self.compile and device_type == "cuda"
        return self.head_loss == "compiled"

    @property
    def tokens_per_step(self) -> int:
        return self.batch_size * self.grad_accum * self.seq_len

    @property
    def eval_windows(self) -> int:
        """Validation windows per evaluation: ``eval_batches`` global batches of them, the same windows for
        every split of the global batch over processes and micro-batches (``global_batch`` 0: not derived
        yet, one process's batch_size × grad_accum)."""
        return self.eval_batches * (self.global_batch or self.batch_size * self.grad_accum)

    def with_overrides(self, overrides: list[str]) -> TrainConfig:
        """A copy with ``--key=value`` overrides applied (and checked)."""
        return TrainConfig.from_dict(TrainConfig.apply_overrides(self.to_dict(), overrides))

    @classmethod
    def from_cli(cls, path: str | Path | None = None, overrides: list[str] | None = None,
                 size: str | None = None) -> TrainConfig:
        """The config of a command line: the YAML file (optional), then a model size preset (its fields
        replace the model's, except vocab_size, which always follows the tokenizer), then the overrides."""
        overrides = list(overrides or [])
        user_keys = {o.lstrip("-").partition("=")[0].replace("-", "_") for o in overrides}
        if "model.vocab_size" in user_keys:  # the trainer sets it to the tokenizer's: it was replaced without a word
            raise ConfigError("--model.vocab_size is the tokenizer's size, which the trainer sets; choose the "
                              "tokenizer instead (--data.vocab_size=N for bpe, --data.tokenizer=bytes or a "
                              "tokenizer.json path); --model.pad_vocab_multiple=N rounds the embedding rows up")
        data = read_file(path) if path else {}
        if size is not None and path:  # the preset replaces the file's model section: its values are still checked
            try:
                check_types(cls, data, "")
            except ConfigError as e:
                raise ConfigError(f"config file {path}: {e}") from None
        if size is not None:  # an empty --size is refused by the preset lookup, not taken as none
            preset = ModelConfig.preset(size)
            preset.pop("vocab_size")
            model = data.get("model") if isinstance(data.get("model"), dict) else _default_model().to_dict()
            data["model"] = {**model, "moe": None, **preset}
            if "seq_len" not in data:  # the default may exceed a small preset's; set even where an option gives
                # one: the file and preset alone are checked when the options fail, and must not fail on it instead
                data["seq_len"] = min(cls.seq_len, preset["max_seq_len"])
        return cls.from_data(data, overrides, source=path)


def check_types(cls: type[Config], data: Any, where: str) -> None:
    """Each field ``data`` gives (recursing into sections) is known and has its declared type and bounds;
    the sections' cross-field rules are left to the final config, which a preset or override may change."""
    if not isinstance(data, dict):
        raise ConfigError(f"{where or 'config'}: expected a section (mapping of fields), got {type(data).__name__} "
                          f"{data!r:.60}")
    check_fields(where or "train config", data, cls)
    hints = typing.get_type_hints(cls)
    for f in dataclasses.fields(cls):
        if f.name not in data:
            continue
        value, tp, label = data[f.name], hints[f.name], cls.label(f.name)
        section = next((a for a in (tp, *typing.get_args(tp)) if isinstance(a, type) and issubclass(a, Config)),
                       None)
        if section is not None and isinstance(value, dict):
            check_types(section, value, label)
            continue
        check_bounds(label, coerce(label, value, tp), f.metadata.get("bounds", {}))


def apply_overrides(data: dict[str, Any], overrides: list[str]) -> dict[str, Any]:
    """``data`` (a train-config dict) with ``--key=value`` overrides applied; see :class:`Config`."""
    return TrainConfig.apply_overrides(data, overrides)
