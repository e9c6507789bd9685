"""What a local Hugging Face folder may contain before any of it reaches ``transformers``.

A folder given to ``hybridnorm import|generate|eval|export`` is foreign input, and ``transformers`` can be
made to run code from it: a ``config.json`` with an ``auto_map`` names a ``.py`` file in the folder, and
unless ``trust_remote_code`` is passed explicitly ``transformers`` asks on stdin whether to run it. A
pickle weight file (``pytorch_model.bin``, ``*.pt`` ...) can run code when unpickled. So this module reads
the folder itself first, and only what passes goes on:

- ``config.json`` is parsed here as plain JSON: a mapping whose ``model_type`` is one hybridnorm imports;
  an ``auto_map`` anywhere in it is refused (the one exception: a map ``hybridnorm export`` writes for its
  own classes, today's or an older one, which is then dropped: the installed classes are used, never the
  folder's file); a ``quantization_config`` is refused (it loads quantizer back ends, and hybridnorm has no
  quantized layers); attention/expert implementation keys, which may name kernels to fetch, are dropped.
- The config object is built from that dict by the *concrete* class of the model type, and the weights are
  loaded by the concrete model class, with ``trust_remote_code=False``: no ``Auto*`` factory ever sees the
  folder, so no ``auto_map`` is consulted and nothing is ever asked on stdin.
- Weights: safetensors only (``use_safetensors=True``; a sharded index must name files inside the folder).
  A folder with only pickle weights is refused, naming the file and ``--allow-pickle``; with that opt-in the
  file is read here with ``torch.load(weights_only=True)``, which builds tensors and containers only, and
  the resulting state dict is handed to ``transformers``.
"""

from __future__ import annotations

import contextlib
import re
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import Tensor

from hybridnorm import plain_data
from hybridnorm.errors import ConfigError
from hybridnorm.hf import remote_code, stock
from hybridnorm.hf.modeling import MODEL_TYPE, HybridNormConfig, HybridNormForCausalLM
from hybridnorm.nn.sampling_defaults import GenerationDefaults
from hybridnorm.train import tensor_check
from hybridnorm.train.run import adapter_hint, check_exists

CONFIG_MAX_BYTES = 16 << 20  # real configs are a few KB; a bigger file is not worth parsing
PICKLE_SUFFIXES = (".bin", ".pt", ".pth", ".ckpt")
SAFETENSORS, SAFETENSORS_INDEX = "model.safetensors", "model.safetensors.index.json"
PICKLE, PICKLE_INDEX = "pytorch_model.bin", "pytorch_model.bin.index.json"
ALLOW_PICKLE_FLAG = "--allow-pickle"
# Dropped, not refused: they choose kernels (possibly hub-hosted code), never the numbers we copy out.
IMPLEMENTATION_KEYS = ("attn_implementation", "experts_implementation", "_attn_implementation",
                       "_attn_implementation_internal", "_experts_implementation_internal")
# head counts and sizes the config and attention classes divide by (null: derived, as transformers does)
DIVISOR_FIELDS = ("num_attention_heads", "num_key_value_heads", "head_dim")
# JSON files of a folder that from_pretrained reads on its own (generation defaults)
SIDE_JSON = ("generation_config.json",)
# an ``architectures`` entry of a folder that holds a language model: a causal LM, or the bare decoder (whose
# LM head, if tied, is the embedding; an untied one is then refused as missing)
LM_SUFFIXES = ("ForCausalLM", "Model")
_PLAIN_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]*")


def one_line(text: object) -> str:
    """A message on one line: the CLI prints every error as exactly one ``error:`` line, and messages from
    torch / transformers span several."""
    return " ".join(str(text).split())


@contextlib.contextmanager
def quiet_transformers() -> Iterator[None]:
    """transformers' warnings about a foreign config and its progress bars off for the duration: what
    matters is checked here and said in one line (an error stays one ``error:`` line)."""
    from transformers.utils import logging as hf_logging

    bars, verbosity = hf_logging.is_progress_bar_enabled(), hf_logging.get_verbosity()
    hf_logging.disable_progress_bar()
    hf_logging.set_verbosity_error()
    try:
        yield
    finally:
        hf_logging.set_verbosity(verbosity)
        if bars:
            hf_logging.enable_progress_bar()


def supported_model_types() -> tuple[str, ...]:
    return (MODEL_TYPE, *stock.BY_TYPE)


def _find_key(obj: Any, key: str) -> str | None:
    """The dotted location of ``key`` anywhere in nested dicts/lists, or None. Iterative: JSON nested
    deeper than Python's recursion limit must be an error line, not a RecursionError."""
    stack: list[tuple[str, Any]] = [("", obj)]
    while stack:
        where, node = stack.pop()
        if isinstance(node, dict):
            for k, v in node.items():
                here = f"{where}.{k}" if where else str(k)
                if k == key:
                    return here
                stack.append((here, v))
        elif isinstance(node, list):
            stack.extend((f"{where}[{i}]", v) for i, v in enumerate(node))
    return None


def model_folder(path: str | Path) -> Path:
    """``path`` if it is a Hugging Face model folder (it has a ``config.json``); a ConfigError saying what it
    is not (and what it is, for a PEFT adapter folder) otherwise."""
    path = check_exists(path, "a local Hugging Face model folder, one with a config.json")
    if not (path / "config.json").is_file():
        raise ConfigError(f"{path} is not a Hugging Face model folder (no config.json)" + adapter_hint(path))
    return path


def read_config(path: str | Path) -> dict[str, Any]:
    """``path/config.json`` as a dict that is safe to give to a config class (see the module docstring);
    a ConfigError naming the file and the field otherwise."""
    file = model_folder(path) / "config.json"
    try:
        if file.stat().st_size > CONFIG_MAX_BYTES:
            raise ConfigError(f"{file} is {file.stat().st_size:,} bytes; a model config is at most "
                              f"{CONFIG_MAX_BYTES:,}")
        raw = plain_data.loads(file.read_bytes())
    except ConfigError:
        raise
    except OSError as e:
        raise ConfigError(f"cannot read {file}: {one_line(e)}") from None
    except ValueError as e:  # not UTF-8, not JSON, nested too deep
        raise ConfigError(f"{file}: {plain_data.describe_error(e)}") from None
    if not isinstance(raw, dict):
        raise ConfigError(f"{file}: expected a JSON object at the top, got {type(raw).__name__}")
    model_type = raw.get("model_type")
    if model_type not in supported_model_types():
        # checked before anything else reads the file: transformers would look for code (auto_map) or
        # guess a type from the folder's name
        raise ConfigError(f"{file}: model_type={model_type!r} is not one hybridnorm reads; supported: "
                          f"{', '.join(supported_model_types())}")
    arch = raw.get("architectures")
    if isinstance(arch, list) and arch and not any(isinstance(a, str) and a.endswith(LM_SUFFIXES) for a in arch):
        raise ConfigError(f"{file}: architectures={arch!r} names no language model (a task head: a classifier, "
                          "reward model or tagger has no LM head to generate or score with); hybridnorm reads "
                          "causal LMs (architectures ending in ForCausalLM)")
    cfg = dict(raw)
    if model_type == MODEL_TYPE and remote_code.is_ours(cfg.get("auto_map")):
        del cfg["auto_map"]  # our own export's pointer to its shim; the installed class is used instead
    if (where := _find_key(cfg, "auto_map")) is not None:
        raise ConfigError(f"{file}: {where} points transformers at Python code in the folder; hybridnorm never "
                          "runs code from a model folder (model_type names the class to use)")
    if (where := _find_key(cfg, "quantization_config")) is not None:
        raise ConfigError(f"{file}: {where} is set; hybridnorm reads unquantized weights only")
    for key in IMPLEMENTATION_KEYS:
        cfg.pop(key, None)
    for key in DIVISOR_FIELDS:  # 0 was a ZeroDivisionError inside transformers, naming no field
        value = cfg.get(key)
        if isinstance(value, int) and not isinstance(value, bool) and value < 1:
            raise ConfigError(f"{file}: {key}={value} must be >= 1")
    for name in SIDE_JSON:  # transformers parses these itself: through our reader first, naming the file
        if (Path(path) / name).is_file():
            side_json(Path(path) / name)
    return cfg


def side_json(file: Path) -> dict[str, Any]:
    """A folder's JSON object besides ``config.json`` (``generation_config.json``), parsed; too big, unreadable,
    not UTF-8 JSON, nested too deep or not an object is one ConfigError naming the file."""
    try:
        if file.stat().st_size > CONFIG_MAX_BYTES:
            raise ConfigError(f"{file} is {file.stat().st_size:,} bytes; a model's JSON file is at most "
                              f"{CONFIG_MAX_BYTES:,}")
        raw = plain_data.loads(file.read_bytes())
    except (OSError, ValueError) as e:
        raise ConfigError(f"{file}: {plain_data.describe_error(e)}") from None
    if not isinstance(raw, dict):  # transformers would fail on it deep in from_pretrained, naming no file
        raise ConfigError(f"{file}: expected a JSON object, got {type(raw).__name__}")
    return raw


def eos_ids(path: str | Path, vocab_size: int) -> tuple[int, ...]:
    """The eos ids transformers' ``generate`` stops at for the folder: ``generation_config.json``'s
    ``eos_token_id`` if the folder has that file, else ``config.json``'s (one id, a list, or none), less
    ids outside ``0 .. vocab_size - 1``, which are never sampled (an embedding padded past the tokenizer).
    A value that is not an integer or a list of integers is a ConfigError naming the file."""
    path = Path(path)
    file = path / "generation_config.json"
    if not file.is_file():
        file = path / "config.json"
    raw = side_json(file)
    value = raw.get("eos_token_id")
    ids = [] if value is None else [value] if isinstance(value, int) and not isinstance(value, bool) else value
    if not isinstance(ids, list) or not all(isinstance(i, int) and not isinstance(i, bool) for i in ids):
        raise ConfigError(f"{file}: eos_token_id={value!r} must be a token id or a list of them"[:300])
    return tuple(dict.fromkeys(i for i in ids if 0 <= i < vocab_size))


def generation_defaults(path: str | Path) -> GenerationDefaults:
    """The sampling defaults of the folder's ``generation_config.json`` (none without the file), which
    ``hybridnorm generate`` follows as transformers' ``generate()`` does: :mod:`hybridnorm.nn.sampling_defaults`."""
    file = Path(path) / "generation_config.json"
    if not file.is_file():
        return GenerationDefaults()
    return GenerationDefaults.from_generation_config(side_json(file), str(file))


def build_config(path: str | Path, cfg: dict[str, Any]) -> Any:  # -> transformers.PretrainedConfig
    """The concrete config class of ``cfg['model_type']`` built from the checked dict."""
    model_type = cfg["model_type"]
    cls = HybridNormConfig if model_type == MODEL_TYPE else stock.stock_config_class(stock.BY_TYPE[model_type])
    try:
        with quiet_transformers():
            return cls.from_dict(cfg)
    except ConfigError as e:
        raise ConfigError(f"{Path(path) / 'config.json'}: {e}") from None
    except Exception as e:  # the config classes raise TypeError/ValueError/... on values of the wrong kind
        raise ConfigError(f"{Path(path) / 'config.json'}: {type(e).__name__}: {one_line(e)}") from None


def model_class(model_type: str) -> type:
    return HybridNormForCausalLM if model_type == MODEL_TYPE else stock.stock_model_class(stock.BY_TYPE[model_type])


# -- weights ------------------------------------------------------------------------------------------

@dataclass(frozen=True)
class Weights:
    kind: str           # "safetensors" | "pickle"
    files: list[Path]   # the files that will be read


def _index_files(index: Path, suffix: str) -> list[Path]:
    """The shard files a ``*.index.json`` names, each a plain file name inside the folder."""
    try:
        data = plain_data.loads(index.read_bytes())
    except OSError as e:
        raise ConfigError(f"cannot read {index}: {one_line(e)}") from None
    except ValueError as e:
        raise ConfigError(f"{index}: {plain_data.describe_error(e)}") from None
    weight_map = data.get("weight_map") if isinstance(data, dict) else None
    if not isinstance(weight_map, dict) or not weight_map:
        raise ConfigError(f"{index}: expected a non-empty 'weight_map' object")
    names = sorted(set(weight_map.values()), key=str)
    for name in names:
        if not isinstance(name, str) or not _PLAIN_NAME.fullmatch(name) or not name.endswith(suffix):
            raise ConfigError(f"{index}: shard {name!r} is not a plain *{suffix} file name in the folder")
        if not (index.parent / name).is_file():
            raise ConfigError(f"{index}: shard {index.parent / name} does not exist")
    return [index.parent / n for n in names]


def find_weights(path: str | Path, allow_pickle: bool = False) -> Weights:
    """The weight files of a folder: safetensors if there are any (pickle files beside them are never
    opened), else pickle files, refused unless ``allow_pickle``."""
    path = Path(path)
    if (path / SAFETENSORS).is_file():
        return Weights("safetensors", [path / SAFETENSORS])
    if (path / SAFETENSORS_INDEX).is_file():
        return Weights("safetensors", _index_files(path / SAFETENSORS_INDEX, ".safetensors"))
    try:
        pickles = sorted(p for p in path.iterdir() if p.suffix in PICKLE_SUFFIXES and p.is_file())
    except OSError as e:
        raise ConfigError(f"cannot list {path}: {one_line(e)}") from None
    if (path / PICKLE_INDEX).is_file():
        files = _index_files(path / PICKLE_INDEX, ".bin")
    elif (path / PICKLE).is_file():
        files = [path / PICKLE]
    elif len(pickles) == 1:
        files = pickles
    elif pickles:
        raise ConfigError(f"{path} has no {SAFETENSORS} and several pickle files ({', '.join(p.name for p in pickles)})"
                          ": which one holds the model is ambiguous")
    else:
        raise ConfigError(f"{path} has no weights: expected {SAFETENSORS} (or {SAFETENSORS_INDEX} and its shards)")
    if not allow_pickle:
        raise ConfigError(f"{files[0]} is a pickle file, and unpickling can run code: refused. Convert it to "
                          f"{SAFETENSORS}, or if you trust it, `hybridnorm import {path} --out RUN "
                          f"{ALLOW_PICKLE_FLAG}` reads it with torch.load(weights_only=True)")
    return Weights("pickle", files)


def load_pickle_state_dict(files: list[Path]) -> dict[str, Tensor]:
    """The tensors of opted-in pickle files, read with ``torch.load(weights_only=True)`` only: the
    restricted unpickler builds tensors and plain containers and refuses any other global."""
    out: dict[str, Tensor] = {}
    for f in files:
        try:
            sd = torch.load(f, map_location="cpu", weights_only=True)
        except Exception as e:  # the restricted unpickler's refusals, truncated or foreign files
            raise ConfigError(f"cannot read {f} with torch.load(weights_only=True): {type(e).__name__}: "
                              f"{one_line(e)[:300]}") from None
        if not isinstance(sd, dict) or not all(isinstance(k, str) and isinstance(v, Tensor) for k, v in sd.items()):
            raise ConfigError(f"{f} is not a state dict (a mapping of names to tensors): found "
                              f"{type(sd).__name__}")
        for k, v in sd.items():
            if not v.is_floating_point():
                raise ConfigError(f"{f}: tensor {k!r} is {v.dtype}, but every weight of the model is floating point")
        tensor_check.check_finite(sd.items(), str(f))
        out.update(sd)
    return out


def load_model(path: str | Path, config: Any, weights: Weights) -> Any:  # -> transformers.PreTrainedModel
    """The concrete HF model of ``config`` with the folder's weights, in fp32, no code from the folder.

    A weight that is missing from the files or has another shape than ``config.json`` implies is refused by
    name: ``transformers`` would only warn (a multi-line report) and leave it randomly initialized, which
    would import a model that is silently not the folder's."""
    path = Path(path)
    cls = model_class(config.model_type)
    if weights.kind == "safetensors":  # the headers' claims and every value, before transformers reads them
        dtype = getattr(config, "dtype", None)
        tensor_check.check_header_dtypes(weights.files, tensor_check.expected_dtype(
            None if dtype is None else str(dtype), f"{path / 'config.json'}"))
        for f in weights.files:
            tensor_check.check_file_finite(f)
    common: dict[str, Any] = dict(config=config, dtype=torch.float32, trust_remote_code=False,
                                  output_loading_info=True, ignore_mismatched_sizes=True)  # report, not raise
    try:
        with quiet_transformers():
            if weights.kind == "pickle":
                state_dict = load_pickle_state_dict(weights.files)
                model, info = cls.from_pretrained(None, state_dict=state_dict, **common)
            else:
                model, info = cls.from_pretrained(path, local_files_only=True, use_safetensors=True, **common)
    except ConfigError:
        raise
    except Exception as e:  # safetensors, OSError, conversion errors: all mean a broken folder
        raise ConfigError(f"cannot load the weights in {path}: {type(e).__name__}: {one_line(e)[:500]}") from None
    mismatched = sorted(info.get("mismatched_keys") or (), key=str)
    if mismatched:
        key, file_shape, model_shape = mismatched[0]
        raise ConfigError(f"weights in {path} do not match its config.json: {key} has shape {tuple(file_shape)}, "
                          f"the config implies {tuple(model_shape)}" + _more(len(mismatched)))
    missing = sorted(info.get("missing_keys") or ())
    if missing:
        raise ConfigError(f"weights in {path} lack {missing[0]!r}" + _more(len(missing))
                          + f" that a {cls.__name__} of its config.json has")
    return model


def _more(n: int) -> str:
    return f" (and {n - 1} more)" if n > 1 else ""
