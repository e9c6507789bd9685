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

from hybridnorm.cli_parser import build_parser
from hybridnorm.config_text import parse_text
from hybridnorm.errors import CollectiveError, ConfigError, escape_unencodable_output, one_line

EXIT_FAILED, EXIT_BAD_INPUT, EXIT_DIVERGED, EXIT_INTERRUPTED = 1, 2, 3, 130
EXIT_BROKEN_PIPE = 128 + 13  # what a shell reports for a Unix tool that SIGPIPE ended (`... | head`)


def _config(args: argparse.Namespace, extra: list[str]):  # -> TrainConfig (imported lazily: fast --help)
    """The train config of a command line: YAML file (optional), then --size, then --key=value, then flags."""
    from hybridnorm.train.config import TrainConfig

    flags = [f"--model.placement={args.placement}"] if getattr(args, "placement", None) is not None else []
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
    from hybridnorm.eval.perplexity import perplexity_of_nll
    from hybridnorm.train.distributed import leave
    from hybridnorm.train.preflight import check_output_folder
    from hybridnorm.train.trainer import train

    cfg = _config(args, extra)
    # the trainer applies the same rule to out_dir alone; here it also knows the corpus folder it reads
    check_output_folder(cfg.out_dir, "out_dir (--out)", may_hold=("run",), inputs=[("data.source", cfg.data.source)])
    result = train(cfg, resume=args.resume)  # under main's process_signals
    leave()  # under torchrun: every rank leaves the group together
    if result.diverged:
        return EXIT_DIVERGED
    if result.interrupted:
        return EXIT_INTERRUPTED
    rank0 = os.environ.get("RANK", "0") == "0"  # under torchrun every rank returns here: one summary line
    if rank0 and result.val_loss is not None and result.unigram_entropy is not None:
        # NaN without divergence: no step trained by this command (a resume of a run already at max_steps)
        train_loss = f"{result.train_loss:.4f}" if math.isfinite(result.train_loss) else "- (no step to train)"
        print(f"final: step {result.step}, train loss {train_loss}, val loss {result.val_loss:.4f} "
              f"(val ppl {perplexity_of_nll(result.val_loss):.2f}); unigram entropy {result.unigram_entropy:.4f} nats"
              + (f", bigram {result.bigram_entropy:.4f} nats" if result.bigram_entropy is not None else "")
              + f"; run folder {result.run_dir}")
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
    from hybridnorm.experiments.grid import Grid, check_knob

    if not args.out:
        raise ConfigError(f"{args.command} needs --out DIR for its report folder")
    try:
        seeds = [int(s) for s in _csv(args.seeds, "--seeds")]
    except ValueError:
        raise ConfigError(f"--seeds must be integers, got {args.seeds!r}") from None
    axes: list[tuple[str, list[object]]] = []
    if getattr(args, "values", None) and not getattr(args, "knob", None):  # else the values were dropped, silently
        raise ConfigError("--values needs --knob KEY (the field the values are for), or give --axis KEY=v1,v2")
    if getattr(args, "knob", None):
        if not args.values:
            raise ConfigError("--knob needs --values v1,v2,...")
        check_knob("--knob", args.knob)
        axes.append((args.knob, _grid_values(args.values, "--values")))
    for spec in args.axis or []:
        key, sep, values = spec.partition("=")
        if not sep or not key:
            raise ConfigError(f"--axis {spec!r} must look like KEY=v1,v2 (e.g. lr=1e-3,1e-2 or depth=12,24)")
        check_knob("--axis", key)
        axes.append((key, _grid_values(values, f"--axis {key}")))
    base = _config(args, extra)
    # the user's init wherever it was given (--model.init, or the --config file's model.init); else megatron
    user_init = base.model.init
    inits = _csv(args.init, "--init") if args.init else [user_init if user_init != "default" else "megatron"]
    grid = Grid(_csv(args.placements, "--placements"), inits, axes, seeds, warmup_frac=args.warmup_frac)
    summary = run_experiment(base, grid, args.out, jobs=args.jobs, baseline=args.baseline,
                             command=command_line([a for a in (sys.argv[1:] if args.argv is None else args.argv)
                                                   if a != "--report-only"]),  # the command that trains it
                             title="Placement comparison" if args.command == "compare" else "Placement sweep",
                             train=not args.report_only)
    from hybridnorm.train.distributed import current_dist, leave
    if current_dist().is_main:
        print(f"report: {summary}")
    leave()  # under torchrun: every rank leaves the group together
    return 0


def _generate(args: argparse.Namespace, extra: list[str]) -> int:
    from hybridnorm.generate_command import run_generate

    return run_generate(args)


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


COMMANDS = {"train": _train, "compare": _experiment, "sweep": _experiment, "generate": _generate, "eval": _eval,
            "export": _export, "import": _import, "placements": _placements, "plan": _plan}


def main(argv: list[str] | None = None) -> int:
    words = sys.argv[1:] if argv is None else list(argv)
    command = next((w for w in words if not w.startswith("-")), None)
    escape_unencodable_output()  # a non-UTF-8 locale's stdout: an escape for what it lacks, not a crash
    from hybridnorm.train.stop import process_signals, stop_requested  # stdlib only: before torch is imported

    # every command: SIGTERM as well as Ctrl-C unwinds (a half-written export or import folder, an eval's
    # temporary file are removed on the way out) and ends in one "interrupted:" line and 130; in train's
    # loop a stop saves first; a repeated signal breaks neither
    with process_signals():
        try:
            rc = _main(words, command, argv)
            sys.stdout.flush()  # here, where a reader that went away is caught, not in Python's exit
        except BrokenPipeError:  # stdout's reader went away (`hybridnorm placements | head -1`): stop quietly
            _stdout_to_devnull()
            return EXIT_BROKEN_PIPE
        except KeyboardInterrupt:  # at any moment, while the command starts too (imports, options), as when
            print(_interrupted(command), file=sys.stderr)  # torchrun stops a rank whose peer failed first
            return EXIT_INTERRUPTED
        if rc == 0 and stop_requested():  # the signal's KeyboardInterrupt was caught by a library on its way
            print("interrupted: the signal reached the command while a library caught it, so it finished its "
                  "work first; what it wrote is complete", file=sys.stderr)
            return EXIT_INTERRUPTED
        return rc


def _stdout_to_devnull() -> None:
    """What is left in stdout's buffer goes nowhere: Python's exit would otherwise try to write it to the
    closed pipe and print a second error."""
    try:
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
    except (OSError, ValueError):  # no real stdout (a test's captured one): nothing to redirect
        pass


def _interrupted(command: str | None) -> str:
    """What an interrupted command leaves: true of the moment a KeyboardInterrupt reaches :func:`_main`."""
    if command == "train":  # outside the loop (start-up, the final evaluation): a stop in it saved and returned
        return ("interrupted: outside the training loop, so no checkpoint was lost; the same command with --resume "
                "continues the run (or starts it, where none was written)")
    if command in ("compare", "sweep"):
        return "interrupted: finished runs and checkpoints are kept; run the same command again to continue"
    return "interrupted: nothing was written (a partly written output is removed)"


ONE_PROCESS_COMMANDS = ("generate", "export", "import", "gradprofile", "placements", "plan")


def _one_process_only(command: str | None) -> str | None:
    """Why ``command`` must not run under a torchrun of several processes, or None. Only train, compare,
    sweep and eval (its documents, questions and batches split across the ranks) use torchrun's ranks; every
    other command would run once per rank, each writing the same files."""
    if "WORLD_SIZE" not in os.environ:  # not under torchrun: torch is not imported for this
        return None
    from hybridnorm.train.distributed import launched_world

    world = launched_world()
    if world <= 1 or command not in ONE_PROCESS_COMMANDS:
        return None
    return (f"hybridnorm {command} runs in one process, but torchrun started {world} (WORLD_SIZE={world}), "
            f"which would each run it and write the same files; run it without torchrun (train, compare, "
            f"sweep and eval are the commands that use several processes)")


def _main(words: list[str], command: str | None, argv: list[str] | None) -> int:
    if (why := _one_process_only(command)) is not None and not {"-h", "--help"} & set(words):
        print(f"error: {why}", file=sys.stderr)
        return EXIT_BAD_INPUT
    if command == "gradprofile":  # a measurement with its own options (experiments.gradprofile)
        from hybridnorm.experiments import gradprofile
        at = words.index(command)  # --debug before the command is the parser's; after it, gradprofile's own
        return gradprofile.main(words[at + 1:], debug="--debug" in words[:at])
    parser = build_parser(COMMANDS)
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
        print(f"error: {one_line(e)}", file=sys.stderr)
        return EXIT_BAD_INPUT
    args.argv = argv
    old_format = warnings.formatwarning
    if not args.debug:  # one line per warning (e.g. a skipped corrupt checkpoint), not two
        warnings.formatwarning = lambda message, *_a, **_k: f"warning: {message}\n"
    try:
        return args.func(args, extra)
    except BrokenPipeError:
        raise  # not bad input: main ends it quietly
    except (ConfigError, OSError, UnicodeDecodeError, ValueError, CollectiveError) as e:  # OSError: a bad path
        if args.debug:
            raise
        lost = isinstance(e, CollectiveError)  # a late or lost rank under torchrun: the input was fine
        resumable = args.command in ("train", "compare", "sweep")  # eval and generate just run again
        hint = "; resume from the newest complete checkpoint with --resume" if lost and resumable else ""
        print(f"error: {one_line(_path_option(e, parser, args, extra) or e)}{hint}", file=sys.stderr)  # one line
        return EXIT_FAILED if lost else EXIT_BAD_INPUT
    finally:
        warnings.formatwarning = old_format


def _path_option(e: BaseException, parser: argparse.ArgumentParser, args: argparse.Namespace,
                 extra: list[str]) -> str:
    """``"--out: File name too long: <its value>"`` when the OS refused a path (too long, not a folder, ...)
    that an option of this command line holds or leads to, so the line names the option as every other bad
    input does; else ``""``. The option whose value is the longest start of the refused path wins (``--out`` for
    ``<out>/checkpoints``); option and reason come first, as a line too long to print whole keeps its start."""
    failed = getattr(e, "filename", None) if isinstance(e, OSError) else None
    if not isinstance(failed, (str, os.PathLike)):
        return ""
    failed = os.fspath(failed)
    sub = next((a.choices[args.command] for a in parser._actions if isinstance(a, argparse._SubParsersAction)), None)
    given = [(f"--{w[2:].partition('=')[0]}", w.partition("=")[2]) for w in extra if w.startswith("--") and "=" in w]
    for action in sub._actions if sub is not None else []:
        value = getattr(args, action.dest, None)
        for v in value if isinstance(value, list) else [value]:
            if isinstance(v, (str, os.PathLike)):
                given.append((action.option_strings[-1] if action.option_strings else action.dest, os.fspath(v)))
    leads = [(len(v), name, v) for name, v in given
             if v and (failed == v or failed.startswith(v.rstrip(os.sep) + os.sep) or failed.startswith(v + "."))]
    if not leads:
        return ""
    _, name, value = max(leads)
    return f"{name}: {e.strerror or e}: {value}" + (f" (at {failed})" if failed != value else "")


if __name__ == "__main__":
    sys.exit(main())
