"""The ``generate`` command: prompts in (``--prompt``, or a file of them with ``--prompt-file``), texts out
(printed, or one JSON record per prompt with ``--output``), ``--batch-size`` prompts at a time, each batch
left-padded and masked as transformers' ``generate`` takes one."""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Iterator
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import IO, Any

from hybridnorm.cli_parser import DEFAULT_PROMPT
from hybridnorm.config_base import is_utf8
from hybridnorm.errors import ConfigError


@dataclass(frozen=True)
class Prompt:
    text: str
    where: str  # "--prompt", "--prompt 2" or "FILE:LINE": what an error about this prompt names


def read_prompt_file(path: str) -> list[Prompt]:
    """The prompts of ``path`` (``-``: standard input). A ``.jsonl`` file holds one JSON object per line with a
    string field ``prompt`` (so a prompt may hold newlines); any other file one prompt per line. Blank lines
    are skipped in both. Anything else is one ConfigError naming the file and line (the corpus readers')."""
    from hybridnorm.data.corpus import decode_text, jsonl_records, read_text

    what, name = "--prompt-file", "standard input" if path == "-" else path
    if path != "-" and Path(path).is_dir():
        raise ConfigError(f"{what} {path} is a folder: name a .txt or .jsonl file of prompts")
    if path.endswith(".jsonl"):
        prompts = [Prompt(_prompt_field(rec, f"{path}:{n}"), f"{path}:{n}")
                   for n, rec in jsonl_records(Path(path), what)]
    else:
        text = decode_text(sys.stdin.buffer.read(), name, what) if path == "-" else read_text(Path(path), what)
        # "\n" alone ends a line, as for the corpus (str.splitlines would also split at U+2028, U+0085, ...)
        prompts = [Prompt(line, f"{name}:{n}") for n, line in enumerate(text.split("\n"), 1) if line.strip()]
    if not prompts:
        raise ConfigError(f"{what} {name} holds no prompts (every line is blank)")
    return prompts


def _prompt_field(record: dict, where: str) -> str:
    prompt = record.get("prompt")
    if not isinstance(prompt, str):
        got = "missing" if "prompt" not in record else f"a {type(prompt).__name__}"
        raise ConfigError(f"--prompt-file {where}: no string field 'prompt' ({got}; its fields: "
                          f"{', '.join(map(repr, record)) or 'none'})")
    return prompt


def prompts_of(args: argparse.Namespace) -> list[Prompt]:
    """The prompts the command was given, in order: ``--prompt`` (each time), or ``--prompt-file``'s."""
    if args.prompt_file is not None:
        if args.prompt:
            raise ConfigError("--prompt and --prompt-file both give prompts: use one of them")
        prompts = read_prompt_file(args.prompt_file)
    else:
        texts = args.prompt or [DEFAULT_PROMPT]
        prompts = [Prompt(t, "--prompt" if len(texts) == 1 else f"--prompt {i}") for i, t in enumerate(texts, 1)]
    for p in prompts:  # a file was decoded as UTF-8 already; a command-line word may not be
        if not is_utf8(p.text):
            which = "" if p.where == "--prompt" else f" ({p.where})"
            raise ConfigError(f"--prompt={p.text!r} is not valid UTF-8 text: pass it as UTF-8{which}")
    return prompts


def check_output(args: argparse.Namespace) -> None:
    """Refuse a bad ``--output`` before the minutes of loading and generating: a folder, an unwritable place,
    the prompt file itself or anything inside the checkpoint being read (it would be overwritten)."""
    from hybridnorm.train.preflight import check_output_file

    if args.output is not None:
        check_output_file(args.output, "--output", example="completions.jsonl",
                          inputs=[("the checkpoint", args.checkpoint), ("the --prompt-file", args.prompt_file)])


def batches(items: list[Any], size: int) -> Iterator[list[Any]]:
    for start in range(0, len(items), size):
        yield items[start:start + size]


@dataclass(frozen=True)
class Completion:
    """One prompt's result, as ``--output`` records it (the field names of OpenAI's completions API)."""
    prompt: str
    completion: str  # the new text, without the token that ended it
    finish_reason: str  # "stop": an end-of-text token ended it; "length": --max-new-tokens did
    prompt_tokens: int  # the start token included
    completion_tokens: int  # the ending token included, as transformers' generate returns it


# characters str.splitlines (and some editors) end a line at, which json.dumps(ensure_ascii=False) leaves as they
# are: escaped, so that a record is one line to every reader
LINE_BREAKS = str.maketrans({"\x85": "\\u0085", "\u2028": "\\u2028", "\u2029": "\\u2029"})


def write_record(f: IO[str], c: Completion) -> None:
    f.write(json.dumps(asdict(c), ensure_ascii=False).translate(LINE_BREAKS) + "\n")


def run_generate(args: argparse.Namespace) -> int:
    """``hybridnorm generate``: every input checked before the model loads, then the batches in order."""
    import torch

    from hybridnorm.data import chat_templates
    from hybridnorm.data.tokenizer import atomic_file, with_start
    from hybridnorm.loading import inference_device, load_run
    from hybridnorm.nn.model import check_generate_args, left_padded
    from hybridnorm.nn.sampling_defaults import COMMAND_DEFAULTS, FIELDS

    written = {k: v for k in FIELDS if (v := getattr(args, k)) is not None}  # the sampling options given
    check_generate_args(args.max_new_tokens, **{**COMMAND_DEFAULTS, **written}, seed=args.seed,
                        as_options=True)  # before loading
    if args.batch_size < 1:
        raise ConfigError(f"--batch-size={args.batch_size} must be >= 1")
    if args.system is not None and not is_utf8(args.system):
        raise ConfigError(f"--system={args.system!r} is not valid UTF-8 text: pass it as UTF-8")
    for flag, given in (("--system", args.system), ("--chat-template-args", args.chat_template_args)):
        if given is not None and args.chat is None:
            raise ConfigError(f"{flag} is for a chat turn: it needs --chat")
    template_args = chat_templates.template_args(args.chat_template_args, "--chat-template-args")
    check_output(args)
    prompts = prompts_of(args)
    device = inference_device(args.device) or torch.device("cpu")  # before the minutes of loading
    run = load_run(args.checkpoint)
    run.model.to(device)
    sampling = run.generation.resolve(written)  # an HF folder's generation_config.json sets the defaults
    if note := run.generation.note(written):
        print(note, file=sys.stderr)
    texts = [p.text for p in prompts]
    if args.chat is not None:
        from hybridnorm.hf.chat import ChatFormatter

        turns = [{"role": "system", "content": args.system}] if args.system is not None else []
        texts = [ChatFormatter(run)([*turns, {"role": "user", "content": t}], args.chat, template_args)
                 for t in texts]
    # the start token first (<|endoftext|> for our tokenizers: every training document followed one; a
    # folder's own BOS where its tokenizer adds one, once: a chat template may write it), as the evaluators
    # and the exported HF tokenizer do
    rows = [with_start(run.tokenizer, run.tokenizer.encode(t)) for t in texts]
    limit = run.model.config.max_seq_len
    for p, row in zip(prompts, rows, strict=True):  # every prompt, before the first batch is generated
        if len(row) + args.max_new_tokens > limit:
            raise ConfigError(f"a prompt of {len(row)} tokens + max_new_tokens={args.max_new_tokens} must be 1 "
                              f"to max_seq_len={limit} tokens ({p.where})")
    # ends after the end-of-text token (or an HF folder's other eos ids), as transformers' generate ends
    stops = [run.tokenizer.eot_id, *run.stop_ids]
    # the device's own generator: on a GPU, the stream transformers' generate draws from after torch.manual_seed;
    # one stream through the batches, so a sampled text depends on --batch-size (greedy does not)
    gen = torch.Generator(device).manual_seed(args.seed)

    def results() -> Iterator[tuple[Prompt, list[int], list[int], bool]]:
        """Each prompt's (prompt, its ids, the new ids up to and with the one that ended it, whether one did),
        in order, generated a batch at a time."""
        pairs = list(zip(prompts, rows, strict=True))
        for batch in batches(pairs, args.batch_size):
            ids, mask = left_padded([row for _, row in batch], run.tokenizer.eot_id, device)  # (B, P) each
            out = run.model.generate(ids, args.max_new_tokens, **asdict(sampling), generator=gen,
                                     stop_ids=None if args.ignore_eos else stops, attention_mask=mask)
            for b, (prompt, row) in enumerate(batch):
                new = out[b, ids.shape[1]:].tolist()
                end = None if args.ignore_eos else next((j for j, t in enumerate(new) if t in stops), None)
                # a row that ended was fed its stop token since
                yield prompt, row, new if end is None else new[:end + 1], end is not None

    if args.output is None:
        for i, (_, row, new, ended) in enumerate(results()):
            if i:
                print()  # a blank line between the texts of several prompts
            if args.chat is None:
                print(run.tokenizer.decode([*row[1:], *new]), flush=True)
            else:  # the reply alone, without the token that ended it
                print(run.tokenizer.decode(new[:-1] if ended else new), flush=True)
        return 0
    # all or nothing: a file renamed into place once every batch is written (interrupted: none is left)
    with atomic_file(Path(args.output)) as f:
        for prompt, row, new, ended in results():
            write_record(f, Completion(prompt.text, run.tokenizer.decode(new[:-1] if ended else new),
                                       "stop" if ended else "length", len(row), len(new)))
    print(f"wrote {len(prompts)} completion{'s' * (len(prompts) != 1)} to {args.output}")
    return 0
