"""A trained run on disk: open its folder (or one checkpoint in it) as model, tokenizer and config;
write the run files a training run keeps beside its checkpoints.

Runs only. :func:`hybridnorm.loading.load_run` opens a run OR a Hugging Face model folder; it sits above
``hybridnorm.hf`` (which itself opens runs through this module to export them), so the two never import
each other.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass, field
from pathlib import Path

from hybridnorm import plain_data
from hybridnorm.config_base import show
from hybridnorm.data import Tokenizer, chat_templates, load_tokenizer
from hybridnorm.data.tokenizer import stop_token_ids
from hybridnorm.errors import ConfigError
from hybridnorm.nn import sampling_defaults
from hybridnorm.nn.model import TransformerLM
from hybridnorm.nn.sampling_defaults import GenerationDefaults
from hybridnorm.train.checkpoint import (
    CheckpointError,
    checked_own_run_file,
    checked_run_file,
    checked_tokenizer_file,
    latest_checkpoint,
    load_weights,
)
from hybridnorm.train.config import TrainConfig
from hybridnorm.train.preflight import REPORT_POINT, check_fits, folder_kind


@dataclass
class Run:
    run_dir: Path
    checkpoint: Path
    config: TrainConfig
    model: TransformerLM
    tokenizer: Tokenizer
    tokenizer_file: Path  # the tokenizer.json read: the checkpoint's own copy, else the run folder's
    # ids besides the tokenizer's end-of-text token that generation stops at: a run's data.stop_tokens, a
    # Hugging Face folder's other eos ids (Llama 3 Instruct's <|eot_id|>, Qwen3's <|im_end|>:
    # hybridnorm.hf.folder.eos_ids; `import` writes them into the run's config as data.stop_tokens)
    stop_ids: tuple[int, ...] = ()
    # {name: Jinja text} for transformers' apply_chat_template: an HF folder's, or the checkpoint's copy of an
    # imported run's chat_templates.json (hybridnorm.data.chat_templates); export writes them back
    chat_templates: dict[str, str] = field(default_factory=dict)
    # decoding defaults `hybridnorm generate` follows: an HF folder's generation_config.json fields, an imported
    # run's copy of them (generation_defaults.json; export writes them back), else none
    generation: GenerationDefaults = field(default_factory=GenerationDefaults)


def write_run_files(run_dir: Path, config_yaml: str, tokenizer: Tokenizer, resumed: Path | None) -> dict[str, bytes]:
    """Write a training run's ``config.yaml`` and tokenizer into ``run_dir``; returns the run files every
    checkpoint keeps a copy of: those, only what the tokenizer wrote (a stale file of another tokenizer in the
    folder is not copied), and the chat templates and decoding defaults of the checkpoint ``resumed`` (an imported
    instruct model's, carried from checkpoint to checkpoint: :mod:`hybridnorm.data.chat_templates`,
    :mod:`hybridnorm.nn.sampling_defaults`)."""
    run_dir.mkdir(parents=True, exist_ok=True)
    (run_dir / "config.yaml").write_text(config_yaml, encoding="utf-8")
    tokenizer.save(run_dir)
    files = {name: (run_dir / name).read_bytes() for name in ("config.yaml", *tokenizer.files)}
    for name in (chat_templates.FILE, sampling_defaults.FILE):  # an imported folder's, carried on
        if resumed is not None and (kept := checked_own_run_file(resumed, name)) is not None:
            files[name] = kept.read_bytes()
            (run_dir / name).write_bytes(files[name])
    return files


def read_generation_defaults(file: Path | None) -> GenerationDefaults:
    """A run's :data:`~hybridnorm.nn.sampling_defaults.FILE` (an imported folder's decoding defaults); none
    without the file. A file that is not JSON is a ConfigError naming it."""
    if file is None:
        return GenerationDefaults()
    try:
        raw = plain_data.loads(file.read_bytes())
    except (OSError, ValueError) as e:
        raise ConfigError(f"{file}: {plain_data.describe_error(e)}") from None
    return GenerationDefaults.from_generation_config(raw, str(file))


def split_run_path(path: Path) -> tuple[Path | None, Path]:
    """(checkpoint, run folder) for ``path``: a ``checkpoints/step_*`` folder (also one copied out of its run:
    then the run folder is the checkpoint itself) or a run folder (no checkpoint chosen yet)."""
    if (path / "manifest.json").exists() or path.name.startswith("step_"):
        return path, (path.parent.parent if path.parent.name == "checkpoints" else path)
    return None, path


def check_run_fits(path: str | Path, copies: int = 1) -> None:
    """:func:`~hybridnorm.train.preflight.check_fits` for loading a run folder or a ``checkpoints/step_*``
    folder on the CPU, from its ``config.yaml`` (a checkpoint's own copy, else the run's) and before any
    weights are read. A folder without a config is left to the loader, which names what is wrong with it."""
    ckpt, run_dir = split_run_path(Path(path))
    cfg_file = checked_run_file(ckpt, "config.yaml") if ckpt is not None else run_dir / "config.yaml"
    if not cfg_file.is_file():
        return
    cfg = TrainConfig.load(cfg_file)
    check_fits(cfg.model, "cpu", training=False, copies=copies, what=f"the model of {ckpt or run_dir}")


MODEL_PATHS = "a run folder, a checkpoints/step_* folder or a local Hugging Face model folder"


def check_exists(path: str | Path, expected: str = MODEL_PATHS) -> Path:
    """``path``, or a ConfigError saying that it does not exist and what was expected there: said first, as
    'no config.json' or 'no run folder or checkpoint at' read as if the path were there, holding the wrong thing."""
    path = Path(path)
    if not path.exists():
        raise ConfigError(f"{path} does not exist (expected {expected})")
    return path


ADAPTER_CONFIG_MAX_BYTES = 1 << 20  # an adapter_config.json is a few KB; a bigger one only loses the hint


def adapter_hint(path: str | Path) -> str:
    """For the error about a folder that holds no model: if it is a PEFT adapter folder (adapter weights alone,
    useless without their base model), what to do with it; else ``""``."""
    path = Path(path)
    if not (path / "adapter_config.json").is_file():
        return ""
    base = ""
    with contextlib.suppress(OSError, ValueError, ConfigError):  # only a hint: a bad file just loses it
        file = path / "adapter_config.json"
        data = plain_data.loads(file.read_bytes()) if file.stat().st_size <= ADAPTER_CONFIG_MAX_BYTES else None
        if isinstance(data, dict) and isinstance(data.get("base_model_name_or_path"), str):
            base = f" ({show(data['base_model_name_or_path'])})"
    return (f"; it is a PEFT adapter folder (adapter_config.json: adapter weights only): merge it into its base "
            f"model{base} first, PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(BASE), ADAPTER)"
            ".merge_and_unload().save_pretrained(OUT), and save the base's tokenizer to OUT too")


def _checkpoints_folder_hint(path: Path) -> str:
    """Said when ``path`` is itself a run's ``checkpoints`` folder: what to pass instead."""
    steps = sorted(p.name for p in path.glob("step_*") if p.is_dir())
    if not steps:
        return ""
    return (f"; {path} is a run's checkpoints folder: pass the run folder {path.parent} (its newest good "
            f"checkpoint) or one checkpoint, e.g. {path / steps[-1]}")


def _refuse_report_folder(path: Path) -> None:
    """A compare/sweep report folder holds runs, none of its own: which to pass, not 'no usable checkpoint'."""
    if folder_kind(path) != "report":
        return
    runs = sorted(p.parent for p in path.glob("/".join(REPORT_POINT)))
    trained = [r for r in runs if (r / "checkpoints").is_dir()] or runs  # the ones a model can be read from
    more = f" ({len(trained)} in all: ls {path / 'runs'})" if len(trained) > 3 else ""
    raise ConfigError(f"{path} is a compare/sweep report folder, not a run: pass one of its runs/<name> folders, "
                      f"e.g. {', '.join(str(r) for r in trained[:3])}{more}")


def is_hf_folder(path: str | Path) -> bool:
    """A Hugging Face model folder: a ``config.json`` and no run ``config.yaml``."""
    path = Path(path)
    return (path / "config.json").is_file() and not (path / "config.yaml").exists()


def open_run(path: str | Path) -> Run:
    """``path`` is a run folder (its newest good checkpoint is used) or a ``checkpoints/step_*`` folder, written
    by one process or sharded by several (FSDP): the model is loaded whole either way."""
    path = check_exists(path)
    ckpt, run_dir = split_run_path(path)
    if ckpt is not None:
        return _open_checkpoint(ckpt, run_dir)
    _refuse_report_folder(path)
    for attempt in range(PRUNED_RETRIES + 1):
        bad: list[str] = []  # with none good, each one's problem (newest first) for the error instead of warnings
        ckpt = latest_checkpoint(path / "checkpoints", why_none=bad)
        if ckpt is None:
            raise CheckpointError(f"{path} has no usable checkpoint" + (
                f" ({len(bad)} found, none verifies; the newest: {bad[0]})" if bad
                else f" (no checkpoints/step_* folder{_checkpoints_folder_hint(path)})") + adapter_hint(path))
        try:
            return _open_checkpoint(ckpt, run_dir)
        except Exception:  # whatever a vanished file raises: OSError, CheckpointError, SafetensorError, ...
            # a run still training with keep_last removed the newest checkpoint while it was read (a newer
            # one was written): the newest again. A checkpoint that is still there failed for what it holds
            if ckpt.exists() or attempt == PRUNED_RETRIES:
                raise
    raise AssertionError("unreachable")


PRUNED_RETRIES = 5  # a checkpoint pruned while read is a race with a save; five in a row is a run saving nonstop


def _open_checkpoint(ckpt: Path, run_dir: Path) -> Run:
    """:func:`open_run` of one ``checkpoints/step_*`` folder of ``run_dir``."""
    # the files this checkpoint was written with (its own copies; an older checkpoint's are its run's)
    cfg_file, tok_file = checked_run_file(ckpt, "config.yaml"), checked_tokenizer_file(ckpt)
    cfg = TrainConfig.load(cfg_file)
    tokenizer = load_tokenizer(tok_file)
    if tokenizer.vocab_size != cfg.model.vocab_size:  # training and import both make them equal
        raise ConfigError(f"vocab mismatch: tokenizer {tok_file} has {tokenizer.vocab_size} "
                          f"tokens but {cfg_file} gives the model vocab_size {cfg.model.vocab_size} "
                          "(a smaller tokenizer could not decode every id the model emits)")
    stop_ids = stop_token_ids(cfg.data.stop_tokens, tokenizer, str(cfg_file))
    chat_file = checked_own_run_file(ckpt, chat_templates.FILE)
    chats = chat_templates.read(chat_file) if chat_file is not None else {}
    generation = read_generation_defaults(checked_own_run_file(ckpt, sampling_defaults.FILE))
    model = TransformerLM(cfg.model)
    load_weights(ckpt, model)  # names, shapes, header dtypes and finiteness checked before anything loads
    model.eval()
    return Run(run_dir, ckpt, cfg, model, tokenizer, tok_file, stop_ids, chats, generation)
