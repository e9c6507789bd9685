"""``hybridnorm export`` / ``hybridnorm import``: run folders <-> Hugging Face model folders.

Export writes a folder that ``transformers`` loads with ``from_pretrained``: a stock class where one
computes exactly the same function (:func:`hybridnorm.hf.stock.match_stock`), so the model runs anywhere
Llama/Qwen3/OLMo-2/... run, else our own ``HybridNormForCausalLM`` (loaded after ``import hybridnorm.hf``,
or with ``trust_remote_code=True`` through a two-line shim module saved in the folder). The tokenizer is
saved as a ``PreTrainedTokenizerFast``. Import turns a stock (or our own) folder back into a run folder
that ``hybridnorm generate|eval|export`` and ``hybridnorm train --resume`` (fine-tuning) accept. What a
foreign folder may hold before ``transformers`` reads it (no code, no pickles) is :mod:`hybridnorm.hf.folder`.
"""

from __future__ import annotations

import json
import warnings
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from transformers import GenerationConfig, PreTrainedTokenizerFast

from hybridnorm.config import ModelConfig
from hybridnorm.data import chat_templates
from hybridnorm.data.tokenizer import EOT, BPETokenizer, ByteTokenizer, Tokenizer, load_tokenizer
from hybridnorm.errors import ConfigError
from hybridnorm.hf import folder, remote_code, stock
from hybridnorm.hf.modeling import MODEL_TYPE, HybridNormConfig, HybridNormForCausalLM
from hybridnorm.nn import sampling_defaults
from hybridnorm.nn.model import TransformerLM
from hybridnorm.train.checkpoint import TrainState, save_checkpoint
from hybridnorm.train.config import DataConfig, TrainConfig
from hybridnorm.train.optim import build_optimizer
from hybridnorm.train.preflight import check_fits, check_output_folder, staged_folder
from hybridnorm.train.run import Run, check_exists, check_run_fits, is_hf_folder, open_run
from hybridnorm.train.tensor_check import CAST_DTYPES as DTYPES

ARCH_CHOICES: tuple[str, ...] = ("auto", MODEL_TYPE, *stock.BY_TYPE)


@dataclass
class ExportResult:
    out_dir: Path
    class_name: str
    stock: bool
    reason: str  # why this class: the match, or why no stock class fits


def hf_tokenizer(tok: Tokenizer, max_length: int | None = None,
                 chats: dict[str, str] | None = None) -> PreTrainedTokenizerFast:
    """Our tokenizer as a ``PreTrainedTokenizerFast`` with the same ids; ``<|endoftext|>`` (our document
    separator) serves as bos, eos and pad, and is prepended by default (``add_special_tokens=True``) as
    ``hybridnorm generate`` and the evaluators prepend it: training saw every document right after one. A
    tokenizer whose own start token is another (an imported folder's BOS: ``Tokenizer.start_id``) keeps it
    as bos, prepended, and its end-of-text token as eos and pad.
    ``model_max_length`` is the model's context (``max_length``); ``chats``, a run's chat templates (``{name:
    Jinja text}``), its ``chat_template`` (saved as ``chat_template.jinja`` and ``additional_chat_templates/``).
    The byte tokenizer becomes an equivalent HF byte-level model: a BPE with the 256 byte symbols as ids
    0..255 and no merges."""
    from tokenizers import Tokenizer as HFTokenizer
    from tokenizers.processors import TemplateProcessing

    if isinstance(tok, BPETokenizer):
        inner = HFTokenizer.from_str(tok.hf.to_str())  # a copy: the run's own tokenizer stays as it is
    elif isinstance(tok, ByteTokenizer):
        inner = _byte_level_tokenizer()
    else:
        raise ConfigError(f"cannot convert a {type(tok).__name__} tokenizer to a Hugging Face one")
    eot, start = inner.id_to_token(tok.eot_id), inner.id_to_token(tok.start_id)
    inner.post_processor = TemplateProcessing(single=f"{start} $A", pair=f"{start} $A $B:1",
                                              special_tokens=[(start, tok.start_id)])
    return PreTrainedTokenizerFast(tokenizer_object=inner, bos_token=start, eos_token=eot, pad_token=eot,
                                   model_max_length=max_length or int(1e30), clean_up_tokenization_spaces=False,
                                   chat_template=chat_templates.for_transformers(chats or {}))


def _byte_level_tokenizer():  # -> tokenizers.Tokenizer
    from tokenizers import Tokenizer as HFTokenizer
    from tokenizers import decoders, models, pre_tokenizers
    from transformers.convert_slow_tokenizer import bytes_to_unicode

    vocab = {ch: b for b, ch in bytes_to_unicode().items()}  # GPT-2's byte -> symbol table; byte b keeps id b
    vocab[EOT] = 256
    inner = HFTokenizer(models.BPE(vocab=vocab, merges=[]))
    inner.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    inner.decoder = decoders.ByteLevel()
    inner.add_special_tokens([EOT])
    return inner


def export_model(model: TransformerLM, out_dir: str | Path, tokenizer: Tokenizer | None = None,
                 arch: str = "auto", dtype: str = "float32", source: str | None = None,
                 stop_ids: Sequence[int] = (), chats: dict[str, str] | None = None,
                 generation: dict[str, Any] | None = None) -> ExportResult:
    """Save ``model`` (and its tokenizer) as a Hugging Face folder; see the module docstring. ``stop_ids``
    (a run's ``data.stop_tokens``) join the tokenizer's end-of-text token in ``generation_config.json``'s
    ``eos_token_id``, where transformers' ``generate`` stops (config.json keeps the one eos); ``chats`` (a run's
    chat templates) go with the tokenizer; ``generation`` (an imported run's decoding defaults:
    :mod:`hybridnorm.nn.sampling_defaults`) goes into ``generation_config.json`` as it came."""
    if arch not in ARCH_CHOICES:
        raise ConfigError(f"--arch={arch!r} is not one of {', '.join(ARCH_CHOICES)}")
    if dtype not in DTYPES:
        raise ConfigError(f"--dtype={dtype!r} is not one of {', '.join(DTYPES)}")
    out = check_output_folder(out_dir, "export folder", inputs=[source])
    mc = model.config
    match, reason = stock.match_stock(mc)
    if arch not in ("auto", MODEL_TYPE) and (match is None or match.model_type != arch):
        raise ConfigError(f"cannot export as {arch}: " + (reason if match is None else
                                                           f"this model matches {match.model_type}, not {arch}"))
    eos, bos = (tokenizer.eot_id, tokenizer.start_id) if tokenizer is not None else (None, None)
    sd = model.state_dict()  # copied into the export class in fp32, which is cast to ``dtype`` once below
    if match is not None and arch != MODEL_TYPE:
        cfg = stock.stock_config_class(match)(**stock.to_hf_config_kwargs(mc, match, eos_token_id=eos,
                                                                             bos_token_id=bos))
        hf = stock.stock_model_class(match)(cfg)
        hf.load_state_dict(stock.to_hf_state_dict(sd, mc, match), strict=True)
        class_name, is_stock = match.class_name, True
    else:
        cfg = HybridNormConfig.from_model_config(mc, bos_token_id=bos, eos_token_id=eos)
        cfg.auto_map = dict(remote_code.AUTO_MAP)  # save_pretrained writes the shim it names
        hf = HybridNormForCausalLM(cfg)
        hf.model.load_state_dict(sd, strict=True)
        class_name, is_stock = "HybridNormForCausalLM", False
        if arch == MODEL_TYPE and match is not None:
            reason = f"--arch={MODEL_TYPE} asked for hybridnorm's own class ({reason})"
    hf = hf.to(DTYPES[dtype])
    cfg.dtype = DTYPES[dtype]
    if (extra := [i for i in dict.fromkeys(stop_ids) if i != eos]) and eos is None:
        raise ConfigError("export: stop_ids need the tokenizer (its end-of-text token is the first eos)")
    if extra or generation:
        # a GenerationConfig of its own, not one marked as derived from config.json, which transformers may
        # rebuild from config.json's single eos_token_id
        hf.generation_config = GenerationConfig(bos_token_id=bos, eos_token_id=[eos, *extra] if extra else eos)
    # checked writable above; a disk that fills up fails here, leaving nothing (written aside, renamed at the end)
    with staged_folder(out, "export folder") as tmp, folder.quiet_transformers():
        hf.save_pretrained(tmp)
        if generation:  # as the folder had them, added to the file rather than set on the GenerationConfig:
            # transformers refuses to save sampling fields without do_sample=true, which a folder may have (it
            # loads them with a warning), and an import -> export round trip keeps what the folder said
            file = tmp / "generation_config.json"
            file.write_text(json.dumps({**json.loads(file.read_text(encoding="utf-8")), **generation}, indent=2),
                            encoding="utf-8")
        if tokenizer is not None:
            hf_tokenizer(tokenizer, mc.max_seq_len, chats).save_pretrained(tmp)
        (tmp / "hybridnorm_export.json").write_text(json.dumps({
            "class": class_name, "stock": is_stock, "reason": reason,
            "placement": mc.resolved_placement().to_dict(), "source": source}, indent=1, default=str),
            encoding="utf-8")
    return ExportResult(out, class_name, is_stock, reason)


# config fields that act only while training (random noise in the forward), which TransformerLM has no
# counterpart for: a folder read with one set is the same function in eval mode, but not in training
TRAINING_ONLY_FIELDS = ("attention_dropout", "router_jitter_noise", "resid_pdrop", "embd_pdrop")


def warn_training_only_fields(path: str | Path, written: str) -> None:
    """One warning per training-only field set to a nonzero value in ``path``'s config.json: it is not in
    the ``written`` folder, so training from that folder runs without it."""
    file = folder.model_folder(path) / "config.json"
    raw = folder.read_config(path)
    for name in TRAINING_ONLY_FIELDS:
        value = raw.get(name)
        if isinstance(value, (int, float)) and not isinstance(value, bool) and value != 0:
            warnings.warn(f"{file}: {name}={value} is not carried over to the {written}: hybridnorm's model has "
                          f"no such training-time noise (it computes the same in eval mode; training from the "
                          f"{written} runs without it)", stacklevel=2)


def export_run(path: str | Path, out_dir: str | Path, arch: str = "auto", dtype: str = "float32") -> ExportResult:
    """Export a run folder (its newest good checkpoint), one ``checkpoints/step_*`` folder or a local HF
    folder (to another architecture or dtype)."""
    check_exists(path)  # said as such, not as an output folder problem or a folder without a run
    check_output_folder(out_dir, "export folder", inputs=[path])  # before minutes of loading, not after
    if is_hf_folder(path):
        run = load_hf_run(path)
        warn_training_only_fields(path, "export folder")
    else:
        check_run_fits(path, copies=2)  # the run's model, then the export class's copy of it
        run = open_run(path)
    return export_model(run.model, out_dir, run.tokenizer, arch=arch, dtype=dtype, source=str(run.checkpoint),
                        stop_ids=run.stop_ids, chats=run.chat_templates, generation=run.generation.kept)


def load_hf(path: str | Path, allow_pickle: bool = False) -> tuple[TransformerLM, str]:
    """A local HF folder (stock class or ours) -> (TransformerLM in fp32 with its weights, model_type).

    Everything :mod:`hybridnorm.hf.folder` refuses is refused before ``transformers`` reads a byte: code
    (``auto_map``), an unsupported ``model_type``, pickle weights without ``allow_pickle``. Then the
    model's size is checked against the free memory, and only then are weights read."""
    path = Path(path)
    raw = folder.read_config(path)
    cfg = folder.build_config(path, raw)
    if cfg.model_type == MODEL_TYPE:
        mc = cfg.model_config()
    else:
        try:  # refuses what our model cannot express, before any weights load
            mc, arch = stock.from_hf_config(cfg)
        except ConfigError as e:
            raise ConfigError(f"{path / 'config.json'}: {e}") from None
        except Exception as e:  # a field of the wrong kind that the config class let through
            raise ConfigError(f"{path / 'config.json'}: {type(e).__name__}: {folder.one_line(e)}") from None
    copies = 2  # the HF model, then a plain TransformerLM built from its state dict
    weights = folder.find_weights(path, allow_pickle=allow_pickle)
    check_fits(mc, "cpu", training=False, copies=copies + (weights.kind == "pickle"),
               what=f"the model in {path}")
    hf = folder.load_model(path, cfg, weights)
    if cfg.model_type != MODEL_TYPE and mc.tie_embeddings \
            and hf.get_output_embeddings().weight is not hf.get_input_embeddings().weight:
        # tie_word_embeddings=true, but the files hold an lm_head.weight unlike the embedding: transformers then
        # leaves the two untied (a warning) and computes with the file's head, so the import must as well
        mc.tie_embeddings = False
    model = TransformerLM(mc)  # our own blocks and attention kernel, not the HF class's transformers parts
    try:
        if cfg.model_type == MODEL_TYPE:
            model.load_state_dict(hf.model.state_dict(), strict=True)
        else:
            model.load_state_dict(stock.from_hf_state_dict(hf.state_dict(), mc, arch), strict=True)
    except RuntimeError as e:  # a shape the config read implies and the folder's class does not: one error line
        raise ConfigError(f"the weights in {path} do not fit the model its config.json describes: "
                          f"{folder.one_line(e)[:400]}") from None
    return model.eval(), cfg.model_type


# slow-tokenizer files of a folder without tokenizer.json (SentencePiece; GPT-2 style BPE)
SLOW_TOKENIZER_FILES = ("tokenizer.model", "spiece.model", "vocab.json")


def load_hf_run(path: str | Path, allow_pickle: bool = False) -> Run:
    """A local HF folder as a :class:`~hybridnorm.train.run.Run` (model, tokenizer, a TrainConfig whose
    tokenizer is the folder's), so ``hybridnorm generate|eval`` take HF folders as they take runs."""
    path = folder.model_folder(path)
    tok_file = path / "tokenizer.json"
    if not tok_file.is_file():
        slow = next((n for n in SLOW_TOKENIZER_FILES if (path / n).is_file()), None)
        how = (f"; it has {slow}, which transformers converts (hybridnorm does not read it): "
               f"python -c \"from transformers import AutoTokenizer; AutoTokenizer.from_pretrained('{path}')"
               f".save_pretrained('{path}')\" writes tokenizer.json") if slow else ""
        raise ConfigError(f"{path} has no tokenizer.json (a fast tokenizer is needed to use the model){how}")
    model, _ = load_hf(path, allow_pickle=allow_pickle)
    tokenizer = load_tokenizer(tok_file)
    mc: ModelConfig = model.config
    if tokenizer.vocab_size > mc.embedding_size:
        raise ConfigError(f"{tok_file} has {tokenizer.vocab_size} tokens but the model only "
                          f"{mc.embedding_size} embedding rows")
    if tokenizer.vocab_size < mc.embedding_size:  # HF pads vocabularies; keep the rows, sample only real ids
        mc.vocab_size, mc.pad_vocab_multiple = tokenizer.vocab_size, mc.embedding_size
    # the folder's other eos ids, as tokens: `import` keeps them in the run's config (data.stop_tokens)
    stop_ids = tuple(i for i in folder.eos_ids(path, mc.vocab_size) if i != tokenizer.eot_id)
    stop_tokens = tuple(tokenizer.id_to_token(i) for i in stop_ids)
    if None in stop_tokens:  # an id inside the vocabulary size that names no token (a hole in the ids)
        raise ConfigError(f"{path}: eos_token_id {stop_ids[stop_tokens.index(None)]} is no token of {tok_file}")
    cfg = TrainConfig(model=mc, data=DataConfig(tokenizer=str(tok_file.resolve()), stop_tokens=stop_tokens),
                      seq_len=min(TrainConfig.seq_len, mc.max_seq_len), out_dir=str(path))
    return Run(run_dir=path, checkpoint=path, config=cfg, model=model, tokenizer=tokenizer, tokenizer_file=tok_file,
               stop_ids=stop_ids, chat_templates=chat_templates.read_hf_folder(path),
               generation=folder.generation_defaults(path))


def import_hf(path: str | Path, out_dir: str | Path, allow_pickle: bool = False) -> Path:
    """A local HF folder -> a run folder (config.yaml, tokenizer.json, checkpoints/step_000000).
    ``allow_pickle``: read pickle weights (only) with ``torch.load(weights_only=True)``; the run folder
    written holds safetensors, so nothing downstream unpickles again."""
    out = check_output_folder(out_dir, "run folder (--out)", inputs=[folder.model_folder(path)])  # input named first
    run = load_hf_run(path, allow_pickle=allow_pickle)
    warn_training_only_fields(path, "run folder")
    cfg = run.config
    names = ("config.yaml", *run.tokenizer.files, *((chat_templates.FILE,) if run.chat_templates else ()),
             *((sampling_defaults.FILE,) if run.generation.kept else ()))
    with staged_folder(out, "run folder") as tmp:  # all or nothing: no half run behind a failure
        run.tokenizer.save(tmp)
        if run.chat_templates:  # an instruct model's: `export` writes them back for apply_chat_template
            (tmp / chat_templates.FILE).write_text(chat_templates.dumps(run.chat_templates), encoding="utf-8")
        if run.generation.kept:  # how the folder decodes by default: `generate` follows it, `export` writes it back
            (tmp / sampling_defaults.FILE).write_text(json.dumps(run.generation.kept, indent=1), encoding="utf-8")
        cfg.data.tokenizer, cfg.out_dir = str((out / "tokenizer.json").resolve()), str(out)
        (tmp / "config.yaml").write_text(cfg.to_yaml(), encoding="utf-8")
        opt = build_optimizer(run.model, cfg.optim)  # the trainer's own param groups: `train --resume` fine-tunes
        save_checkpoint(tmp / "checkpoints", run.model, opt, TrainState(step=0, tokens=0),
                        run_files={name: (tmp / name).read_bytes() for name in names})
    return out
