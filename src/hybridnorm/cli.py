"""``hybridnorm`` command line: train, generate, eval, placements.

Bad input (missing file, corrupt checkpoint, config typo, vocab mismatch …) prints ONE line
``error: …`` and exits 2; ``--debug`` shows the traceback instead.
"""

from __future__ import annotations

import argparse
import math
import os
import sys
import warnings

from hybridnorm.config_base import is_utf8, parse_text
from hybridnorm.errors import CollectiveError, ConfigError, OneLineArgumentParser

EXIT_FAILED, EXIT_BAD_INPUT, EXIT_DIVERGED, EXIT_INTERRUPTED = 1, 2, 3, 130


def _config(args: argparse.Namespace, extra: list[str]):  # -> TrainConfig (imported lazily: fast --help)
    """The train config of a command line: YAML file (optional), then --size, then --key=value, then flags."""
    from hybridnorm.train.config import TrainConfig

    flags = [f"--model.placement={args.placement}"] if getattr(args, "placement", None) else []
    flags += [f"--max_steps={args.max_steps}"] if args.max_steps is not None else []
    flags += [f"--out_dir={args.out}"] if args.out is not None else []
    return TrainConfig.from_cli(args.config, [*extra, *flags], size=args.size)


def _join_spaced_overrides(argv: list[str], own_options: set[str]) -> list[str]:
    """``--optim.lr 1e-3`` (an option that is not the command's own, then a value as the next word) becomes
    ``--optim.lr=1e-3``: the value is not mistaken for the config file, and a mistyped key is reported as
    the unknown config field it is."""
    out: list[str] = []
    i = 0
    while i < len(argv):
        word = argv[i]
        if (word.startswith("--") and "=" not in word and word not in own_options and i + 1 < len(argv)
                and not argv[i + 1].startswith("--")):
            out.append(f"{word}={argv[i + 1]}")
            i += 2
            continue
        out.append(word)
        i += 1
    return out


def _train(args: argparse.Namespace, extra: list[str]) -> int:
    from hybridnorm.train.preflight import check_output_folder
    from hybridnorm.train.trainer import train

    cfg = _config(args, extra)
    # the trainer applies the same rule to out_dir alone; here it also knows the corpus folder it reads
    check_output_folder(cfg.out_dir, "out_dir (--out)", may_hold=("run",), inputs=[cfg.data.source])
    result = train(cfg, resume=args.resume)  # under main's process_signals
    if result.diverged:
        return EXIT_DIVERGED
    if result.interrupted:
        return EXIT_INTERRUPTED
    rank0 = os.environ.get("RANK", "0") == "0"  # under torchrun every rank returns here: one summary line
    if rank0 and result.val_loss is not None and result.unigram_entropy is not None:
        # NaN without divergence: no step trained by this command (a resume of a run already at max_steps)
        train_loss = f"{result.train_loss:.4f}" if math.isfinite(result.train_loss) else "- (no step to train)"
        print(f"final: step {result.step}, train loss {train_loss}, val loss {result.val_loss:.4f} "
              f"(val ppl {math.exp(result.val_loss):.2f}); unigram entropy {result.unigram_entropy:.4f} nats; "
              f"run folder {result.run_dir}")
    return 0


def _csv(text: str, what: str) -> list[str]:
    items = [t.strip() for t in text.split(",") if t.strip()]
    if not items:
        raise ConfigError(f"{what} must be a comma-separated list, got {text!r}")
    return items


def _grid_values(text: str, what: str) -> list[object]:
    """Comma-separated values read with YAML's safe loader (numbers stay numbers; 1e-3 is a float)."""
    def value(item: str) -> object:
        try:
            v = parse_text(item, "yaml")
        except ConfigError:
            return item
        try:
            return float(v) if isinstance(v, str) else v  # YAML 1.1 reads 1e-3 as a string
        except ValueError:
            return v

    return [value(v) for v in _csv(text, what)]


def _experiment(args: argparse.Namespace, extra: list[str]) -> int:
    """compare and sweep: one grid (placements × inits × axes × seeds), one report."""
    from hybridnorm.experiments.compare import command_line, run_experiment
    from hybridnorm.experiments.grid import Grid

    if not args.out:
        raise ConfigError(f"{args.command} needs --out DIR for its report folder")
    try:
        seeds = [int(s) for s in _csv(args.seeds, "--seeds")]
    except ValueError:
        raise ConfigError(f"--seeds must be integers, got {args.seeds!r}") from None
    axes: list[tuple[str, list[object]]] = []
    if getattr(args, "knob", None):
        if not args.values:
            raise ConfigError("--knob needs --values v1,v2,...")
        axes.append((args.knob, _grid_values(args.values, "--values")))
    for spec in args.axis or []:
        key, sep, values = spec.partition("=")
        if not sep or not key:
            raise ConfigError(f"--axis {spec!r} must look like KEY=v1,v2 (e.g. lr=1e-3,1e-2 or depth=12,24)")
        axes.append((key, _grid_values(values, f"--axis {key}")))
    user_init = next((o.partition("=")[2] for o in extra if o.lstrip("-").startswith("model.init=")), None)
    inits = _csv(args.init, "--init") if args.init else [user_init if user_init and user_init != "default"
                                                          else "megatron"]
    grid = Grid(_csv(args.placements, "--placements"), inits, axes, seeds, warmup_frac=args.warmup_frac)
    summary = run_experiment(_config(args, extra), grid, args.out, jobs=args.jobs, baseline=args.baseline,
                             command=command_line([a for a in (sys.argv[1:] if args.argv is None else args.argv)
                                                   if a != "--report-only"]),  # the command that trains it
                             title="Placement comparison" if args.command == "compare" else "Placement sweep",
                             train=not args.report_only)
    from hybridnorm.train.distributed import current_dist
    if current_dist().is_main:
        print(f"report: {summary}")
    return 0


def _generate(args: argparse.Namespace, extra: list[str]) -> int:
    import torch

    from hybridnorm.loading import load_run
    from hybridnorm.nn.model import check_generate_args

    check_generate_args(args.max_new_tokens, args.temperature, args.top_k, args.seed, as_options=True)  # pre-load
    if not is_utf8(args.prompt):
        raise ConfigError(f"--prompt={args.prompt!r} is not valid UTF-8 text: pass the prompt as UTF-8")
    run = load_run(args.checkpoint)
    gen = torch.Generator().manual_seed(args.seed)
    # <|endoftext|> first, as the evaluators and the exported HF tokenizer do: every training document
    # followed one, so this is the context a document starts from
    ids = [run.tokenizer.eot_id, *run.tokenizer.encode(args.prompt)]
    out = run.model.generate(torch.tensor([ids]), args.max_new_tokens, temperature=args.temperature,
                             top_k=args.top_k or None, generator=gen)
    print(run.tokenizer.decode(out[0, 1:].tolist()))
    return 0


def _eval(args: argparse.Namespace, extra: list[str]) -> int:
    """Validation loss by default; with --mc / --text / --tasks those evaluations instead, as one table."""
    from dataclasses import fields

    from hybridnorm.eval.suite import EvalRequest, run_eval

    run_eval(EvalRequest.from_dict({f.name: getattr(args, f.name) for f in fields(EvalRequest)}))
    return 0


def _require_hf(command: str) -> None:
    try:
        import transformers  # noqa: F401
    except ImportError:
        raise ConfigError(f"`hybridnorm {command}` needs transformers: pip install 'hybridnorm[hf]'") from None


def _export(args: argparse.Namespace, extra: list[str]) -> int:
    _require_hf("export")
    fmt, out = args.to
    if fmt != "hf":
        raise ConfigError(f"--to {fmt!r}: the only export format is 'hf' (a Hugging Face model folder)")
    from hybridnorm.hf.export import export_run

    r = export_run(args.checkpoint, out, arch=args.arch, dtype=args.dtype)
    kind = "stock class, loads with transformers alone" if r.stock else \
        "hybridnorm's own class: `import hybridnorm.hf` or from_pretrained(..., trust_remote_code=True)"
    print(f"exported {args.checkpoint} -> {r.out_dir} as {r.class_name} ({kind})\n  why: {r.reason}")
    return 0


def _import(args: argparse.Namespace, extra: list[str]) -> int:
    _require_hf("import")
    from hybridnorm.hf.export import import_hf
    from hybridnorm.loading import load_run

    run = load_run(import_hf(args.hf_dir, args.out, allow_pickle=args.allow_pickle))
    mc = run.config.model
    print(f"imported {args.hf_dir} -> {run.run_dir}: placement {mc.resolved_placement().name}, "
          f"{run.model.num_params() / 1e6:.2f}M parameters; use it with `hybridnorm generate|eval|export "
          f"{run.run_dir}` or fine-tune with `hybridnorm train {run.run_dir / 'config.yaml'} --out "
          f"{run.run_dir} --resume`")
    return 0


def _placements(args: argparse.Namespace, extra: list[str]) -> int:
    from hybridnorm import placements

    width = max(map(len, placements.names()))
    for name in placements.names():
        print(f"{name:<{width}}  {placements.one_line(placements.get(name))}")
    if args.all:
        print(f"\nGrammar: {placements.GRAMMAR}\n")
        for name in placements.PAPER_NAMES:
            print(f"{name:<14}  {placements.one_line(placements.get(name))}")
    return 0


def _plan(args: argparse.Namespace, extra: list[str]) -> int:
    from hybridnorm.train.plan import PlanOptions, format_plan, plan

    options = {k: v for k, v in vars(args).items() if k in PlanOptions.__dataclass_fields__}  # not the parser's
    print(format_plan(plan(PlanOptions.from_dict(options))))
    return 0


def build_parser() -> argparse.ArgumentParser:
    ap = OneLineArgumentParser(prog="hybridnorm", description="Normalization placements for decoder-only LMs.")
    ap.add_argument("--debug", action="store_true", help="show tracebacks")
    # --debug is accepted after the command too (`hybridnorm train --debug`); SUPPRESS keeps the
    # subcommand from resetting a --debug given before it.
    common = argparse.ArgumentParser(add_help=False)
    common.add_argument("--debug", action="store_true", default=argparse.SUPPRESS, help="show tracebacks")
    sub = ap.add_subparsers(dest="command", required=True)

    t = sub.add_parser("train", parents=[common],
                       help="train a model (default: small HybridNorm* on the embedded KJV corpus)",
                       description="Extra --key=value options override any config field, e.g. --optim.lr=1e-3 "
                                   "--model.n_layers=8 --precision=fp32.")
    t.add_argument("config", nargs="?", help="YAML train config (optional)")
    t.add_argument("--size", help="model size preset (tiny, small, 151m, 550m, ...)")
    t.add_argument("--placement", help="placement preset or grammar name (see `hybridnorm placements`)")
    t.add_argument("--max-steps", type=int)
    t.add_argument("--out", help="run folder (default runs/default)")
    t.add_argument("--resume", action="store_true", help="continue from the newest good checkpoint in --out")
    t.set_defaults(func=_train)

    for name, help_text in (("compare", "train several placements side by side and write a report folder"),
                           ("sweep", "train placements over a grid of knobs and report where each one stops training")):
        c = sub.add_parser(name, parents=[common], help=help_text,
                           description=f"{help_text}. Extra --key=value options override any config field. "
                                       "Re-running the same command skips finished runs and continues "
                                       "interrupted ones.")
        c.add_argument("config", nargs="?", help="YAML train config (optional)")
        c.add_argument("--placements", required=True, help="comma-separated presets or grammar names")
        c.add_argument("--size", help="model size preset (tiny, small, 151m, ...)")
        c.add_argument("--max-steps", type=int)
        c.add_argument("--out", help="report folder")
        c.add_argument("--seeds", default="0", help="comma-separated seeds (default 0)")
        c.add_argument("--init", help="comma-separated init axis: paper (each placement's paper default: "
                                      "confounds init with placement), normal, megatron, depth_scaled, deepnorm. "
                                      "Default: one init for all, megatron (or --model.init if given)")
        c.add_argument("--axis", action="append", metavar="KEY=V1,V2",
                       help="a grid axis over any config field (lr, depth, warmup, steps, clip aliases, or dotted "
                            "names like optim.lr); repeat for a grid over several knobs")
        if name == "sweep":
            c.add_argument("--knob", help="one axis (same as --axis KNOB=VALUES)")
            c.add_argument("--values", help="comma-separated values of --knob")
        c.add_argument("--warmup-frac", type=float, help="warmup steps as a fraction of max_steps at every point")
        c.add_argument("--baseline", help="placement the others are compared with (default: the first)")
        c.add_argument("--jobs", type=int, default=1, help="runs trained side by side, cores split between them")
        c.add_argument("--report-only", action="store_true",
                       help="train nothing: rewrite the report from the runs finished so far")
        c.set_defaults(func=_experiment)

    g = sub.add_parser("generate", parents=[common], help="sample text from a run folder or checkpoint")
    g.add_argument("checkpoint")
    g.add_argument("--prompt", default="In the beginning")
    g.add_argument("--max-new-tokens", type=int, default=100)
    g.add_argument("--temperature", type=float, default=0.8, help="0: greedy")
    g.add_argument("--top-k", type=int, default=50, help="0: sample from the whole vocabulary")
    g.add_argument("--seed", type=int, default=0)
    g.set_defaults(func=_generate)

    e = sub.add_parser("eval", parents=[common], help="evaluate a checkpoint: validation loss (default), "
                       "multiple choice, document perplexity, lm-eval tasks",
                       description="Without --mc/--text/--tasks: the validation loss and perplexity of the run's "
                                   "corpus (or --data). With them: those evaluations, printed as one table.")
    e.add_argument("checkpoint")
    e.add_argument("--data", help="corpus (default: the run's own validation split)")
    e.add_argument("--batches", type=int, help="validation loss: score N batches of --batch-size (default: the "
                   "windows the run's training validated on, eval_batches x global_batch, so the loss is its log's)")
    e.add_argument("--batch-size", type=int, help="default: the run's batch_size for the validation loss, 8 for "
                   "--mc/--text/--tasks")
    e.add_argument("--seq-len", type=int)
    e.add_argument("--mc", metavar="FILE.jsonl",
                   help="zero-shot multiple choice on HellaSwag-style JSONL (context, endings, label): acc, acc_norm")
    e.add_argument("--text", metavar="FILE",
                   help="perplexity, bits per byte and word perplexity of a .txt/.jsonl file, a folder, or 'kjv'")
    e.add_argument("--tasks", help="comma-separated lm-eval tasks (the shipped kjv_mc is always found); "
                                   "needs pip install 'hybridnorm[eval]'")
    e.add_argument("--include-path", metavar="DIR", help="folder of extra lm-eval task YAML files")
    e.add_argument("--limit", type=int, help="first N items of each task / of --mc")
    e.add_argument("--num-fewshot", type=int, help="lm-eval few-shot examples (default: the task's, or 0)")
    e.add_argument("--device", help="cpu, cuda, cuda:N (default: where the run loads, the CPU)")
    e.add_argument("--output", metavar="FILE.json", help="also write all results (per item for --mc) as JSON")
    e.set_defaults(func=_eval)

    x = sub.add_parser("export", parents=[common], help="export a run or checkpoint as a Hugging Face model folder",
                       description="Placements that a stock transformers class computes exactly (pre -> Llama, "
                                   "qk_norm -> Qwen3, olmo2 -> OLMo-2, MoE -> Mixtral/Qwen3-MoE/OLMoE/FlexOlmo) "
                                   "export to it; every other one exports with hybridnorm's own class.")
    x.add_argument("checkpoint", help="run folder or checkpoints/step_* folder")
    x.add_argument("--to", nargs=2, metavar=("FORMAT", "DIR"), required=True, help="hf DIR")
    x.add_argument("--arch", default="auto", help="auto (default), hybridnorm (own class), or a stock "
                                                   "model_type: llama, qwen3, olmo2, mixtral, qwen3_moe, ...")
    x.add_argument("--dtype", default="float32", help="float32 (default), bfloat16 or float16")
    x.set_defaults(func=_export)

    i = sub.add_parser("import", parents=[common], help="turn a local Hugging Face model folder into a run folder")
    i.add_argument("hf_dir", help="folder with config.json, weights and tokenizer.json (Llama, Qwen3, OLMo-2, "
                                  "Mixtral, Qwen3-MoE, OLMoE, FlexOlmo or hybridnorm's own)")
    i.add_argument("--out", required=True, help="new run folder")
    i.add_argument("--allow-pickle", action="store_true",
                   help="read pickle weights (pytorch_model.bin, *.pt) with torch.load(weights_only=True) when "
                        "the folder has no safetensors; refused by default: unpickling can run code")
    i.set_defaults(func=_import)

    sub.add_parser("gradprofile", add_help=False,  # its options: python -m hybridnorm.experiments.gradprofile
                   help="per-block gradient norms at step 1 at the paper's sizes (Figure 2); --help for options")
    p = sub.add_parser("placements", parents=[common], help="list placement presets with their equations")
    p.add_argument("--all", action="store_true", help="also the paper's grammar names")
    p.set_defaults(func=_placements)

    m = sub.add_parser("plan", parents=[common], help="memory per GPU (DDP, FSDP), largest micro-batch, grad_accum")
    m.add_argument("--size", default="1.2b", help="model size preset")
    m.add_argument("--gpus", type=int, default=8)
    m.add_argument("--gpu-mem", type=float, default=80.0, help="GiB per GPU")
    m.add_argument("--seq-len", type=int, default=4096)
    m.add_argument("--micro-batch", type=int, help="sequences per GPU (default: the largest that fits under FSDP)")
    m.add_argument("--global-batch-tokens", type=int, default=4 * 2**20, help="target tokens per step")
    m.add_argument("--precision", default="bf16", help="bf16 (autocast) or fp32")
    m.add_argument("--placement", default="hybridnorm_star")
    m.add_argument("--loss", default="fast", help="LM head + loss: fast (fused) or plain (fast_kernels=false)")
    m.set_defaults(func=_plan)
    # the options each config-taking command owns: any other --key is a config override
    ap.own_options = {name: set(sub.choices[name]._option_string_actions) for name in ("train", "compare", "sweep")}
    return ap


def main(argv: list[str] | None = None) -> int:
    words = sys.argv[1:] if argv is None else list(argv)
    command = next((w for w in words if not w.startswith("-")), None)
    if command != "train":
        return _main(words, command, argv)
    from hybridnorm.train.stop import process_signals  # stdlib only: installed before torch is imported

    # from here on a stop at start-up is "interrupted:" and 130, one in the loop saves first; a repeat breaks neither
    with process_signals():
        return _main(words, command, argv)


ONE_PROCESS_COMMANDS = ("generate", "eval", "export", "import", "gradprofile", "placements", "plan")


def _one_process_only(command: str | None) -> str | None:
    """Why ``command`` must not run under a torchrun of several processes, or None. Only train, compare and
    sweep use torchrun's ranks; every other command would run once per rank, each writing the same files."""
    world = int(os.environ.get("WORLD_SIZE", "1") or 1)
    if world <= 1 or command not in ONE_PROCESS_COMMANDS:
        return None
    return (f"hybridnorm {command} runs in one process, but torchrun started {world} (WORLD_SIZE={world}), "
            f"which would each run it and write the same files; run it without torchrun (train, compare and "
            f"sweep are the commands that use several processes)")


def _main(words: list[str], command: str | None, argv: list[str] | None) -> int:
    if (why := _one_process_only(command)) is not None and not {"-h", "--help"} & set(words):
        print(f"error: {why}", file=sys.stderr)
        return EXIT_BAD_INPUT
    if command == "gradprofile":  # a measurement with its own options (experiments.gradprofile)
        from hybridnorm.experiments import gradprofile
        return gradprofile.main(words[words.index(command) + 1:])
    parser = build_parser()
    overrides: list[str] = []
    if command in ("train", "compare", "sweep"):
        own = parser.own_options[command]
        words = _join_spaced_overrides(words, own)
        # --key=value overrides bypass argparse, which takes a word with a space in it ("--data.source=/my
        # data") for a positional argument, i.e. for the config file
        overrides = [w for w in words if w.startswith("--") and "=" in w and w.partition("=")[0] not in own]
        words = [w for w in words if w not in overrides]
    try:
        args, extra = parser.parse_known_args(words)
        extra = [*overrides, *extra]
        if extra and args.command not in ("train", "compare", "sweep"):
            parser.error(f"unrecognized arguments: {' '.join(extra)}")
    except ConfigError as e:
        if "--debug" in words:
            raise
        print(f"error: {' '.join(str(e).split())}", file=sys.stderr)
        return EXIT_BAD_INPUT
    args.argv = argv
    old_format = warnings.formatwarning
    if not args.debug:  # one line per warning (e.g. a skipped corrupt checkpoint), not two
        warnings.formatwarning = lambda message, *_a, **_k: f"warning: {message}\n"
    try:
        return args.func(args, extra)
    except (ConfigError, OSError, UnicodeDecodeError, ValueError, CollectiveError) as e:  # OSError: a bad path
        if args.debug:
            raise
        lost = isinstance(e, CollectiveError)  # a late or lost rank under torchrun: the input was fine
        hint = "; resume from the newest complete checkpoint with --resume" if lost else ""
        print(f"error: {' '.join(str(e).split())}{hint}", file=sys.stderr)  # one line, whatever the message
        return EXIT_FAILED if lost else EXIT_BAD_INPUT
    except KeyboardInterrupt:
        print("interrupted: checkpoints are saved; run the same command again to continue", file=sys.stderr)
        return EXIT_INTERRUPTED
    finally:
        warnings.formatwarning = old_format


if __name__ == "__main__":
    sys.exit(main())
