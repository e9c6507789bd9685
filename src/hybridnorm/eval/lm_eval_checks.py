"""What ``hybridnorm eval --tasks`` checks of its lm-eval inputs before any request is scored: the values of
``--gen-kwargs`` (lm-eval would apply them at the first generation batch, after every other task had been
scored), integer arguments given as text, and task files under ``--include-path`` that do not parse (lm-eval
skips them without a word, so a task defined in one is only "unknown")."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch

from hybridnorm.errors import ConfigError
from hybridnorm.eval.dataset_log import datasets_log_held
from hybridnorm.train.tensor_check import CAST_DTYPES as DTYPES  # HFLM's names too

MAX_GEN_TOKS_KEYS = ("max_gen_toks", "max_new_tokens", "max_tokens", "max_completion_tokens")  # lm-eval's order


def positive_int(value: object, name: str) -> int:
    """``value`` (a model arg, a generation kwarg: often a string) as an integer >= 1, else one ConfigError."""
    try:
        n = int(value)  # model_args arrive as strings from the lm-eval command line
    except (TypeError, ValueError):
        n = 0
    if n < 1 or (isinstance(value, float) and value != n):
        raise ConfigError(f"{name}={value!r} must be a positive integer")
    return n




def check_dtype(dtype: str | torch.dtype | None, name: str = "dtype") -> torch.dtype | None:
    """The model arg ``dtype`` as HFLM's (``auto``, a dtype's name, or a ``torch.dtype``): the torch dtype, or
    None for ``auto`` (the weights as the run stores them); anything else is one ConfigError."""
    if dtype is None or dtype == "auto":
        return None
    if isinstance(dtype, torch.dtype) and dtype in DTYPES.values():
        return dtype
    if isinstance(dtype, str) and dtype.removeprefix("torch.") in DTYPES:
        return DTYPES[dtype.removeprefix("torch.")]
    raise ConfigError(f"{name}={dtype!r} is not one of auto, {', '.join(DTYPES)} (as lm-eval's HF backend takes it)")


def check_gen_kwargs(lm: Any, gen_kwargs: str | dict[str, Any]) -> None:
    """The values of ``gen_kwargs`` as ``lm`` (a :class:`~hybridnorm.eval.lm_eval_adapter.HybridNormLM`) checks
    them at its first generation batch (lm-eval merges them into each generation task's own, and parses a
    string as ``lm_eval --gen_kwargs`` does)."""
    from lm_eval.utils import simple_parse_args_string

    given = simple_parse_args_string(gen_kwargs) if isinstance(gen_kwargs, str) else dict(gen_kwargs)
    try:
        for key in MAX_GEN_TOKS_KEYS:
            if given.get(key) is not None:
                positive_int(given[key], key)
        lm._sampling(given)
    except ConfigError as e:
        raise ConfigError(f"gen_kwargs={gen_kwargs!r}"[:300] + f": {e}") from None


def unreadable_yaml(folders: Sequence[str | Path]) -> str:
    """``"; ... do not parse ..."`` naming the task files under ``folders`` that are not YAML (lm-eval skips
    them without a word, so a task defined there is just "unknown"); else ``""``. Composed, not constructed:
    lm-eval's tags (``!function``) need no resolving to find a syntax error, nor an alias bomb expanding."""
    import yaml

    bad = []
    for folder in folders:
        for f in sorted(Path(folder).rglob("*.y*ml")):
            try:
                list(yaml.compose_all(f.read_text(encoding="utf-8"), Loader=yaml.SafeLoader))
            except (OSError, UnicodeDecodeError, yaml.YAMLError) as e:
                bad.append(f"{f} ({' '.join(str(e).split())[:160]})")
    if not bad:
        return ""
    return f"; these task files do not parse, and lm-eval skipped them: {'; '.join(bad[:3])}" + (
        f" and {len(bad) - 3} more" if len(bad) > 3 else "")


def close_names(tm: Any, unknown: Sequence[str]) -> str:
    """`` (did you mean ...?)`` with the names ``tm`` knows (tasks, groups, tags) closest to each unknown one
    (difflib's), else ``""``; lm-eval itself suggests none."""
    import difflib

    near = {t: difflib.get_close_matches(t, tm.all_tasks, n=3) for t in unknown}
    said = [f"{t!r}: {', '.join(map(repr, m))}" if len(unknown) > 1 else ", ".join(map(repr, m))
            for t, m in near.items() if m]
    return f" (did you mean {'; '.join(said)}?)" if said else ""


def build_tasks(tm: Any, names: Sequence[str]) -> list[Any]:
    """``names`` built by ``tm`` (lm-eval's ``TaskManager.load``: the tasks, groups and tags, their datasets
    read) and their metrics checked, for ``simple_evaluate(tasks=...)``, which takes them built: a metric or
    aggregation lm-eval does not know is one ConfigError naming the task and the metric now, where lm-eval
    fails with ``KeyError: None`` while building the task or with ``'NoneType' object is not callable``
    after every request has been scored (its progress bars printed first). An aggregation is checked before
    any dataset is read where lm-eval's task index holds the task's config (:func:`check_aggregations`)."""
    check_aggregations(tm, names)
    built: list[Any] = []
    for name in names:
        try:
            with datasets_log_held():  # a failed load: its log lines go into the one error line
                loaded = tm.load([name])
        except KeyError as e:
            if e.args != (None,):  # lm-eval's lookup of a metric's default aggregation found none
                raise
            raise ConfigError(_unknown_metric(e, name)) from None
        tasks = list(loaded["tasks"].values())
        for task in tasks:
            check_metrics(task)
        # the object lm-eval built for the name: a group (with its subtasks in it), a task, or a tag's tasks
        built += [loaded["groups"][name]] if name in loaded["groups"] else tasks
    return built


def check_aggregations(tm: Any, names: Sequence[str]) -> None:
    """The ``aggregation`` names in the metric_list of each task that ``names`` names directly or as a tag, read
    from ``tm.task_index`` (lm-eval's index of its YAML files: includes merged, ``!function`` tags not
    resolved, so no task code runs), before ``TaskManager.load`` reads a dataset (a hub download can take
    minutes). lm-eval builds such a task from the same file with no overrides. A group's tasks are left to
    :func:`check_metrics` after the load: a group's YAML may override its tasks' fields, merged only by
    lm-eval's building of the group, which this does not re-implement; a task given as a YAML path likewise."""
    import lm_eval.api.metrics  # noqa: F401  (registers lm-eval's aggregations, as its own lookup does first)
    from lm_eval.api import registry

    index = getattr(tm, "task_index", {})
    for name in names:
        entry = index.get(name)
        kind = entry.kind.name if entry is not None else None
        for member in sorted(entry.tags) if kind == "TAG" else [name] if kind == "TASK" else []:
            task = index.get(member)
            if task is None or task.kind.name != "TASK":
                continue  # a Python task class ("class:"): its own code decides its metrics
            for item in (task.cfg or {}).get("metric_list") or []:
                agg = item.get("aggregation") if isinstance(item, dict) else None
                # a !function aggregation is unresolved here: the absolute path of the function lm-eval imports
                if isinstance(agg, str) and not Path(agg).is_absolute() and agg not in registry.aggregation_registry:
                    raise ConfigError(_unknown_aggregation(task.cfg.get("task", member), item.get("metric"), agg))


def check_metrics(task: Any) -> None:
    """Each metric of ``task``'s ``metric_list`` has the function and aggregation lm-eval looked up for it."""
    from lm_eval.api import registry

    cfg = task.config
    functions, aggregations = getattr(task, "_metric_fn_list", {}), task.aggregation() or {}
    for entry in cfg.metric_list or []:
        metric, agg = entry.get("metric"), entry.get("aggregation")
        if not isinstance(metric, str):  # a !function metric: lm-eval calls it as given
            continue
        if cfg.process_results is None and metric in functions and functions[metric] is None:
            raise ConfigError(f"lm-eval task {cfg.task!r}: metric {metric!r} in its metric_list is not one lm-eval "
                              f"knows (nor one the HF evaluate library loads here); lm-eval's metrics: "
                              f"{', '.join(sorted(registry.metric_registry.keys()))}")
        if isinstance(agg, str) and aggregations.get(metric) is None:
            raise ConfigError(_unknown_aggregation(cfg.task, metric, agg))


def _unknown_aggregation(task: str, metric: object, agg: str) -> str:
    from lm_eval.api import registry

    return (f"lm-eval task {task!r}: aggregation {agg!r} of metric {metric!r} is not one lm-eval knows; its "
            f"aggregations: {', '.join(sorted(registry.aggregation_registry.keys()))}")


def fewshot_shortfall(e: BaseException) -> str | None:
    """What lm-eval's sampler means when it cannot draw a task's few-shot examples (``ValueError: Sample larger
    than population``, or the ``first_n`` sampler's AssertionError): the task, the number asked for and the
    documents there are, read from the frame of lm-eval's ``fewshot_context`` that drew them; None for an
    error raised elsewhere."""
    task, n, tb = None, None, e.__traceback__
    while tb is not None:
        local = tb.tb_frame.f_locals
        if tb.tb_frame.f_code.co_name == "fewshot_context" and hasattr(local.get("self"), "config"):
            task, n = local["self"], local.get("num_fewshot")
        tb = tb.tb_next
    docs = getattr(getattr(task, "sampler", None), "df", None)
    if task is None or not isinstance(n, int) or docs is None:
        return None
    split, same = task.fewshot_cfg.split, task.fewshot_cfg.split == task.config.test_split
    most = len(docs) - (1 if same else 0)  # the document asked about is not its own example
    return (f"lm-eval task {task.config.task!r}: {n} few-shot examples asked for (--num-fewshot, or the task's "
            f"num_fewshot), but its few-shot documents (split {split!r}) are {len(docs)}"
            + (", less the one asked about (the split evaluated)" if same else "")
            + f": at most {most} ({type(e).__name__} in lm-eval: {' '.join(str(e).split())})")


def _unknown_metric(e: KeyError, name: str) -> str:
    """What lm-eval's ``KeyError: None`` means: a metric in a task's metric_list that has no default
    aggregation, i.e. one not in lm-eval's registry that names no ``aggregation``. The task and the metric
    are read from the frame of the task being built (its ``self`` and ``metric_name``) where it is there."""
    from lm_eval.api import registry

    task, metric, tb = name, None, e.__traceback__
    while tb is not None:  # the innermost frame that holds both is the task's __init__
        local = tb.tb_frame.f_locals
        if isinstance(local.get("metric_name"), str) and hasattr(local.get("self"), "config"):
            task, metric = getattr(local["self"].config, "task", name), local["metric_name"]
        tb = tb.tb_next
    what = f"metric {metric!r} in its metric_list" if metric else "a metric in its metric_list"
    return (f"lm-eval task {task!r}: {what} is not one lm-eval knows, and names no aggregation (lm-eval's metrics, "
            f"which have their own: {', '.join(sorted(registry.metric_registry.keys()))}; another metric needs "
            f"aggregation: one of {', '.join(sorted(registry.aggregation_registry.keys()))})")
