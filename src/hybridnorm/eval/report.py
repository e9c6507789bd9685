"""Results of ``hybridnorm eval`` as one table (rich) and as a JSON file: rows of
(task, metric, value, stderr, n) from the multiple-choice, perplexity and lm-eval evaluators."""

from __future__ import annotations

import json
import math
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from hybridnorm.data.tokenizer import atomic_file
from hybridnorm.errors import ConfigError
from hybridnorm.eval.multiple_choice import MCResult
from hybridnorm.eval.perplexity import PerplexityResult

Row = tuple[str, str, float, float, int | None]  # task, metric, value, stderr (NaN: none), n


def mc_rows(result: MCResult, name: str) -> list[Row]:
    return [(name, "acc", result.acc, result.acc_stderr, result.n),
            (name, "acc_norm", result.acc_norm, result.acc_norm_stderr, result.n)]


def perplexity_rows(result: PerplexityResult, name: str) -> list[Row]:
    return [(name, metric, getattr(result, metric), math.nan, result.n_docs)
            for metric in ("token_perplexity", "bits_per_byte", "word_perplexity", "byte_perplexity")]


def _fmt(x: float) -> str:
    if not math.isfinite(x):
        return "" if math.isnan(x) else str(x)
    return f"{x:.4f}" if abs(x) < 1e3 else f"{x:,.1f}" if abs(x) < 1e9 else f"{x:.4e}"


def print_results(rows: Sequence[Row], header: str, notes: Sequence[str] = ()) -> None:
    """``header`` (the checkpoint), a rich table, then ``notes``, on stdout (plain text when redirected)."""
    from rich.console import Console
    from rich.table import Table
    from rich.text import Text

    table = Table()
    for col, justify in (("task", "left"), ("metric", "left"), ("value", "right"), ("± stderr", "right"),
                         ("n", "right")):
        table.add_column(col, justify=justify)  # type: ignore[arg-type]
    for task, metric, value, stderr, n in rows:  # as Text: a file or task name may hold brackets ('t[red].txt')
        table.add_row(Text(task), Text(metric), _fmt(value), _fmt(stderr), "" if n is None else f"{n:,}")
    console = Console()
    for line in (header, table, *notes):  # long paths stay whole lines: copy-pasteable
        # printed as they are, not as rich markup: a run folder 'x[/y]' raised MarkupError after the evaluation
        # ran (nothing written), and one like 'runs[v2]' lost its brackets, as the trainer's lines did
        console.print(line, highlight=False, markup=False, soft_wrap=isinstance(line, str))


def jsonable(obj: Any) -> Any:
    """``obj`` with numpy scalars/arrays, paths, tuples and other odd values made JSON-safe."""
    if isinstance(obj, dict):
        return {str(k): jsonable(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple, set)):
        return [jsonable(v) for v in obj]
    if obj is None or isinstance(obj, (bool, int, str)):
        return obj
    if isinstance(obj, float):
        return obj if math.isfinite(obj) else None  # strict JSON has no NaN
    if hasattr(obj, "tolist"):  # numpy scalar / array, torch tensor
        return jsonable(obj.tolist())
    return str(obj)


def write_json(path: str | Path, data: dict[str, Any]) -> Path:
    """Write ``data`` atomically (temporary file + rename), creating parent folders."""
    path = Path(path)
    try:
        with atomic_file(path) as f:
            json.dump(jsonable(data), f, indent=1, allow_nan=False)
    except OSError as e:
        raise ConfigError(f"cannot write --output {path}: {e.strerror or e}") from None
    return path


def write_samples(output: str | Path, samples: dict[str, list[dict[str, Any]]]) -> list[Path]:
    """lm-eval's per-document records (``simple_evaluate(log_samples=True)["samples"]``), one JSONL file per task
    beside ``output`` (``r.json`` -> ``r_samples_TASK.jsonl``), each line as ``lm_eval --log_samples`` writes it
    (its ``EvaluationTracker``'s sanitizing: a request's arguments as ``gen_args_i.arg_j``, responses as plain
    lists, the target as text, so that ``datasets.load_dataset("json", ...)`` reads the file); each written
    atomically, a failure one error naming the file."""
    from lm_eval.utils import handle_non_serializable, sanitize_list

    output, written = Path(output), []
    for task, records in samples.items():
        path = output.with_name(f"{output.stem}_samples_{task}.jsonl")
        try:
            with atomic_file(path) as f:
                for record in records:
                    record = {**record, "resps": sanitize_list(record["resps"]),
                              "filtered_resps": sanitize_list(record["filtered_resps"]),
                              "target": str(record["target"]),
                              "arguments": {f"gen_args_{i}": {f"arg_{j}": a for j, a in enumerate(args)}
                                            for i, args in enumerate(record["arguments"])}}
                    f.write(json.dumps(record, default=handle_non_serializable, ensure_ascii=False) + "\n")
        except OSError as e:
            raise ConfigError(f"cannot write --log-samples file {path}: {e.strerror or e}") from None
        written.append(path)
    return written
