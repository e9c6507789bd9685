"""lm-eval-harness adapter: any lm-eval task on a hybridnorm run, scored by :mod:`hybridnorm.eval.scoring`.

    >>> from hybridnorm.eval import run_lm_eval
    >>> results = run_lm_eval("runs/kjv-hybridnorm-star", ["kjv_mc"], limit=50)
    >>> results["results"]["kjv_mc"]["acc_norm,none"]

Importing this module registers the model class as ``hybridnorm`` in lm-eval's registry, so
``lm_eval.simple_evaluate(model="hybridnorm", model_args="pretrained=RUN,batch_size=8", ...)`` works too, without
:func:`run_lm_eval`'s checks of the tasks' metrics (lm-eval shows a model only the requests): pass it tasks built
by :func:`~hybridnorm.eval.lm_eval_checks.build_tasks` for those.

Chat formatting (lm-eval's ``apply_chat_template``, ``fewshot_as_multiturn``, ``system_instruction``) renders
the run's chat templates (an imported instruct folder's) with transformers' own ``apply_chat_template``, as
lm-eval's HF backend does; ``chat_template=NAME`` picks a named one (default: ``default``).

lm-eval is optional (``pip install 'hybridnorm[eval]'``): without it this module still imports, and
:func:`run_lm_eval` / :class:`HybridNormLM` raise a :class:`ConfigError` saying what to install.

Offline by default: ``HF_DATASETS_OFFLINE`` and ``HF_HUB_OFFLINE`` are set to 1 unless already set, before
lm-eval imports ``datasets`` (which reads them once). Local tasks — the shipped ``kjv_mc``, or a task
whose ``dataset_path: json`` reads local ``data_files`` — need no network; set both variables to 0 to let
lm-eval download hub datasets (hellaswag, ...).
"""

from __future__ import annotations

import math
import os
import warnings
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch

from hybridnorm.data import chat_templates
from hybridnorm.errors import ConfigError
from hybridnorm.eval.auto_batch import MAX_BATCH, AutoBatch, BatchSize
from hybridnorm.eval.batched_generation import generate_until_batch
from hybridnorm.eval.limit import check_limit
from hybridnorm.eval.lm_eval_checks import (
    MAX_GEN_TOKS_KEYS,
    build_tasks,
    check_dtype,
    check_gen_kwargs,
    close_names,
    fewshot_shortfall,
    positive_int,
    unreadable_yaml,
)
from hybridnorm.eval.lm_eval_ranks import RANK_WAIT_S, RankedLM, launched_local_rank
from hybridnorm.eval.paths import TASKS_DIR
from hybridnorm.eval.scoring import encode_pair, loglikelihood, loglikelihood_rolling
from hybridnorm.loading import Run, load_run
from hybridnorm.nn.sampling import Sampling, check_sampling
from hybridnorm.nn.sampling_defaults import FIELDS
from hybridnorm.train.distributed import collective_error, current_dist

PIP_HINT = "pip install 'hybridnorm[eval]'"
OFFLINE_ENV = ("HF_DATASETS_OFFLINE", "HF_HUB_OFFLINE")

try:  # the optional extra; lm_eval.api.* does not import datasets, so this stays cheap
    from lm_eval.api.model import LM as _LMBase
    from lm_eval.api.registry import register_model as _register_model

    _IMPORT_ERROR: ImportError | None = None
except ImportError as e:
    _LMBase, _register_model, _IMPORT_ERROR = object, None, e  # type: ignore[assignment,misc]


def require_lm_eval() -> None:
    """Raise :class:`ConfigError` with the install command when lm-eval is not importable."""
    if _IMPORT_ERROR is not None:
        raise ConfigError(f"lm-eval tasks need the optional lm_eval package ({_IMPORT_ERROR}): {PIP_HINT}")


def use_offline_defaults() -> None:
    for var in OFFLINE_ENV:
        os.environ.setdefault(var, "1")


class HybridNormLM(RankedLM, _LMBase):
    """An lm-eval ``LM`` over a hybridnorm run: ``pretrained`` is a run folder, a ``checkpoints/step_*``
    folder, or a loaded :class:`~hybridnorm.loading.Run`. ``device`` defaults to CUDA when available
    for a run loaded here and to the model's current device for a given ``Run``. ``batch_size``: rows per
    forward, or ``"auto"`` / ``"auto:N"`` (the largest that fits, from ``max_batch_size``, default 64, down;
    :mod:`~hybridnorm.eval.auto_batch`), as lm-eval's HF backend takes them.
    ``chat_template``: the name of the run's chat template that ``apply_chat_template`` renders (checked
    when lm-eval first asks for it; the run's ``default`` when not given). ``chat_template_args`` (a dict, or
    its JSON) and ``enable_thinking=False`` are extra template variables, as HFLM's; ``enable_thinking=True``
    is refused: HFLM then cuts each generation's reasoning at its ``think_end_token``, which this adapter
    does not. ``dtype``: ``auto`` (the weights as the run stores them), ``float32``, ``bfloat16`` or
    ``float16``, the weights and activations cast to it as HFLM's ``dtype`` does (a given ``Run``'s model
    in place); the norms' statistics and the scored log-softmax stay in float32. Under ``torchrun`` it is one
    rank of a data-parallel evaluation (it joins the process group if none is joined yet, as HFLM does through
    accelerate; :mod:`~hybridnorm.eval.lm_eval_ranks`); its default device is then this rank's GPU."""

    def __init__(self, pretrained: str | Path | Run, batch_size: int | str = 8, device: str | None = None,
                 max_gen_toks: int | str = 256, max_batch_size: int | None = None, chat_template: str | None = None,
                 chat_template_args: dict[str, Any] | str | None = None, enable_thinking: bool | str | None = None,
                 dtype: str | torch.dtype | None = "auto", **kwargs: Any) -> None:
        require_lm_eval()
        super().__init__()
        if kwargs:
            raise ConfigError(f"unknown hybridnorm model_args {', '.join(map(repr, kwargs))}; valid: pretrained, "
                              f"batch_size, max_batch_size, device, dtype, max_gen_toks, chat_template, "
                              f"chat_template_args, enable_thinking")
        self.chat_template_name = chat_template
        self.chat_template_args = chat_templates.template_args(chat_template_args, "chat_template_args")
        if enable_thinking is not None:
            if str(enable_thinking).lower() not in ("false", "0"):
                raise ConfigError(f"enable_thinking={enable_thinking!r}: only False is supported (True needs each "
                                  f"generation's reasoning cut at a think_end_token, as lm-eval's HF backend does; "
                                  f"this adapter does not); chat_template_args passes any template variable as is")
            self.chat_template_args["enable_thinking"] = False
        self._chat: Any = None  # the run's ChatFormatter, built on first use
        spec = BatchSize.parse(batch_size)  # bad values: before the minutes of loading
        weights = check_dtype(dtype)
        max_batch = MAX_BATCH if max_batch_size is None else positive_int(max_batch_size, "max_batch_size")
        run = pretrained if isinstance(pretrained, Run) else load_run(pretrained)
        self.run, self.model, self.tokenizer = run, run.model, run.tokenizer
        self.batch_size: int | str = spec.rows or str(spec)  # as given: what lm-eval records
        self.rows = AutoBatch(self.model, spec, max_batch)
        self.max_gen_toks = positive_int(max_gen_toks, "max_gen_toks")
        if device is None:
            device = str(self.model.embed.weight.device) if isinstance(pretrained, Run) else \
                (f"cuda:{launched_local_rank()}" if torch.cuda.is_available() else "cpu")
        try:
            self._device = torch.device(device)
            self.model.to(self._device, weights).eval()  # weights None ("auto"): as loaded
        except (RuntimeError, AssertionError) as e:  # a malformed name, or CUDA not built in / not present
            raise ConfigError(f"device={device!r}: {e}") from None
        self.join_ranks(self._device)
        self._warned: set[str] = set()  # what was said not to be applied

    @property
    def tokenizer_name(self) -> str:
        return f"hybridnorm-{self.tokenizer.kind}-{self.tokenizer.fingerprint[:16]}"

    def chat_template(self, chat_template: bool | str = False) -> str | None:
        """lm-eval's hook: the Jinja text of the template ``apply_chat_template`` renders (a name: that one;
        True: the one chosen by ``chat_template=``, else ``default``); None when not applying one."""
        if chat_template is False or chat_template is None:
            return None
        name = chat_template if isinstance(chat_template, str) else self.chat_template_name
        return chat_templates.select(self.run.chat_templates, name, f"{self.run.checkpoint}")

    def apply_chat_template(self, chat_history: list[dict[str, str]], add_generation_prompt: bool = True) -> str:
        """The conversation as the run's chat template formats it (:class:`~hybridnorm.hf.chat.ChatFormatter`),
        with HFLM's arguments (a final assistant message is continued, not closed, when no generation prompt
        is asked for) and its one fall-back: a template that rejects the system role is retried without the
        system messages."""
        from jinja2.exceptions import TemplateError

        from hybridnorm.hf.chat import ChatFormatter

        if self._chat is None:
            self._chat = ChatFormatter(self.run)
        kwargs = dict(name=self.chat_template_name, template_args=self.chat_template_args,
                      add_generation_prompt=add_generation_prompt, continue_final_message=not add_generation_prompt)
        try:
            return self._chat(chat_history, **kwargs)
        except TemplateError:
            warnings.warn("the chat template failed; retrying without the system messages (as lm-eval's HF "
                          "backend does)", stacklevel=2)
            return self._chat([m for m in chat_history if m["role"] != "system"], **kwargs)

    @property
    def batch_sizes(self) -> dict[int, int]:
        """The batch sizes ``batch_size="auto"`` detected, in order (``results["config"]["batch_sizes"]``)."""
        return dict(enumerate(self.rows.sizes))

    def get_model_info(self) -> dict[str, Any]:
        """Provenance that ``simple_evaluate`` copies into ``results["config"]``."""
        return {"model_num_parameters": self.model.num_params(), "model_dtype": str(self.model.embed.weight.dtype),
                "run_dir": str(self.run.run_dir), "checkpoint": str(self.run.checkpoint),
                "placement": self.model.placement.name}

    def loglikelihood(self, requests: list, disable_tqdm: bool = False) -> list[tuple[float, bool]]:
        pairs = [encode_pair(self.tokenizer, req.args[0], req.args[1]) for req in requests]
        out = loglikelihood(self.model, pairs, self.rows.scoring())
        for req, res in zip(requests, out, strict=True):
            self.cache_hook.add_partial("loglikelihood", req.args, res)
        return out

    def loglikelihood_rolling(self, requests: list, disable_tqdm: bool = False) -> list[float]:
        docs = self.tokenizer.encode_batch([req.args[0] for req in requests])
        out = loglikelihood_rolling(self.model, docs, self.tokenizer.start_id, self.rows.scoring())
        for req, res in zip(requests, out, strict=True):
            self.cache_hook.add_partial("loglikelihood_rolling", req.args, res)
        return out

    def generate_until(self, requests: list, disable_tqdm: bool = False) -> list[str]:
        """As lm-eval's HF backend (``HFLM``) generates: each request's ``generation_kwargs`` decide as HFLM
        hands them to transformers' ``generate`` (``do_sample`` as given, else temperature > 0), over the run's
        decoding defaults (an HF folder's ``generation_config.json``, an imported run's copy: a Qwen folder's
        ``repetition_penalty`` acts on greedy requests too), then transformers' own. Requests run in HFLM's
        batches (lm-eval's ``Collator``: grouped by their kwargs, longest context first, ``batch_size`` at a
        time; :func:`~hybridnorm.eval.batched_generation.generate_until_batch`), drawing from torch's global
        generator, which ``simple_evaluate`` seeds: a sampled request draws the tokens HFLM draws at the same
        ``batch_size``, and a greedy reply does not depend on its batch."""
        from lm_eval.models.utils import Collator

        eot = self.tokenizer.decode([self.tokenizer.eot_id])  # a stop string too, as in HFLM
        order = Collator([req.args for req in requests], sort_fn=lambda a: (-len(self.tokenizer.encode(a[0])), a[0]),
                         group_by="gen_kwargs", group_fn=lambda a: a[1])
        out = []
        for chunk in order.get_batched(n=self.rows.generation()):
            contexts, all_kwargs = zip(*chunk, strict=True)
            kwargs = dict(all_kwargs[0] or {})  # one group: the same kwargs for the whole chunk
            until = kwargs.get("until") or []
            until = [until] if isinstance(until, str) else until
            if not isinstance(until, (list, tuple)) or not all(isinstance(u, str) for u in until):
                raise ConfigError(f"lm-eval generation_kwargs {kwargs}: until={until!r} must be a string or a list "
                                  f"of strings (the stop strings)")
            max_gen = next((kwargs[k] for k in MAX_GEN_TOKS_KEYS if kwargs.get(k) is not None), self.max_gen_toks)
            texts = generate_until_batch(self.model, self.tokenizer, contexts, [*until, eot],
                                         positive_int(max_gen, "max_gen_toks"), stop_ids=self.run.stop_ids,
                                         sampling=self._sampling(kwargs))
            for args, text in zip(chunk, texts, strict=True):
                self.cache_hook.add_partial("generate_until", args, text)
            out.extend(texts)
        return order.get_original(out)

    def _sampling(self, kwargs: dict[str, Any]) -> Sampling:
        """How a request's tokens are chosen (:meth:`generate_until`); what is not applied is said once."""
        temperature, do_sample = kwargs.get("temperature", 0.0), kwargs.get("do_sample")
        try:
            check_sampling(Sampling(temperature=0.0 if temperature is None else temperature))
            if do_sample is not None and not isinstance(do_sample, bool):
                raise ConfigError(f"do_sample={do_sample!r} must be true or false")
            given = {**kwargs, "do_sample": bool(temperature) if do_sample is None else do_sample}
            sampling = self.run.generation.for_transformers(given)
            check_sampling(sampling)
        except ConfigError as e:
            raise ConfigError(f"lm-eval generation_kwargs {kwargs!r}"[:300] + f": {e}") from None
        ignored = [k for k in kwargs if k not in ("until", "do_sample", *FIELDS, *MAX_GEN_TOKS_KEYS)]
        for what in ([f"generation_kwargs {', '.join(ignored)}"] if ignored else []) + [
                f"{self.run.generation.source}'s {x}" for x in self.run.generation.not_applied]:
            if what not in self._warned:
                warnings.warn(f"hybridnorm's lm-eval adapter does not apply {what} (transformers' generate "
                              "would)", stacklevel=3)
                self._warned.add(what)
        return sampling


if _register_model is not None:
    _register_model("hybridnorm")(HybridNormLM)


def _task_known(tm: Any, name: str) -> bool:
    return name in tm.all_tasks or (name.endswith((".yaml", ".yml")) and Path(name).is_file())


def task_manager(tasks: Sequence[str], include_path: str | Path | Sequence[str | Path] | None = None,
                 include_defaults: bool | None = None) -> Any:
    """A ``TaskManager`` over the package's tasks folder, ``include_path`` and — when ``include_defaults``
    is True, or None and some task is not found locally — lm-eval's own tasks (indexing those takes
    seconds). An unknown task name raises :class:`ConfigError`."""
    require_lm_eval()
    from lm_eval.tasks import TaskManager

    extra = [include_path] if isinstance(include_path, (str, Path)) else list(include_path or [])
    for p in extra:
        if not Path(p).is_dir():
            raise ConfigError(f"--include-path {p} is not a folder of lm-eval task YAML files")
    paths = [str(TASKS_DIR), *map(str, extra)]
    tm = TaskManager(include_path=paths, include_defaults=bool(include_defaults))
    if include_defaults is None and not all(_task_known(tm, t) for t in tasks):
        tm = TaskManager(include_path=paths, include_defaults=True)
        include_defaults = True
    unknown = [t for t in tasks if not _task_known(tm, t)]
    if unknown:
        where = ", ".join(paths) + (" and lm-eval's built-in tasks" if include_defaults else "")
        raise ConfigError(f"unknown lm-eval task(s) {', '.join(map(repr, unknown))}{close_names(tm, unknown)}; "
                          f"looked in {where}" + unreadable_yaml(extra))
    return tm


def run_lm_eval(run_or_path: str | Path | Run | HybridNormLM, tasks: str | Sequence[str],
                include_path: str | Path | Sequence[str | Path] | None = None, limit: int | float | None = None,
                num_fewshot: int | None = None, batch_size: int | str = 8, *, max_batch_size: int | None = None,
                include_defaults: bool | None = None, log_samples: bool = False, bootstrap_iters: int = 100_000,
                device: str | None = None, apply_chat_template: bool | str = False, fewshot_as_multiturn: bool = False,
                system_instruction: str | None = None, chat_template_args: dict[str, Any] | str | None = None,
                seed: int | None = None, gen_kwargs: str | dict[str, Any] | None = None,
                dtype: str | torch.dtype | None = "auto") -> dict[str, Any] | None:
    """``lm_eval.simple_evaluate`` of a run on ``tasks`` (names or a comma-separated string), with a
    ``TaskManager`` that also finds the shipped ``kjv_mc`` and any ``include_path`` folders. ``limit`` keeps
    the first N documents of each task, or a fraction of them in (0, 1), as lm-eval
    (:mod:`~hybridnorm.eval.limit`). ``batch_size``: an integer, ``"auto"`` or ``"auto:N"`` (from
    ``max_batch_size`` down; :class:`HybridNormLM`). ``apply_chat_template`` (True: the run's default chat template; a
    name: that one), ``fewshot_as_multiturn`` and ``system_instruction`` are lm-eval's; ``chat_template_args``
    are extra template variables (``{"enable_thinking": False}``, or its JSON). ``seed`` sets lm-eval's four
    seeds (Python, NumPy, torch, few-shot) as ``lm_eval --seed SEED`` does (None: lm-eval's). ``gen_kwargs``
    (``"do_sample=true,temperature=0.7"`` or a dict) update every generation task's ``generation_kwargs``, as
    ``lm_eval --gen_kwargs`` does (lm-eval applies them). ``dtype``: :class:`HybridNormLM`'s (auto, float32,
    bfloat16, float16; not applied to a given ``HybridNormLM``). Returns lm-eval's
    results dict (``results``, ``n-samples``, ``config``, ... and ``samples`` when ``log_samples``); in a joined
    process group of several ranks (``torchrun``) the documents are split across the ranks, and rank 0 gets
    the results of all of them, every other rank None."""
    require_lm_eval()
    use_offline_defaults()
    names = [t.strip() for t in tasks.split(",")] if isinstance(tasks, str) else [str(t).strip() for t in tasks]
    names = [t for t in names if t]
    if not names:
        raise ConfigError("no lm-eval tasks given")
    limit = check_limit(limit)
    if num_fewshot is not None and (not isinstance(num_fewshot, int) or num_fewshot < 0):
        raise ConfigError(f"num_fewshot={num_fewshot!r} must be a non-negative integer")
    if seed is not None and (not isinstance(seed, int) or isinstance(seed, bool) or not 0 <= seed < 2**32):
        raise ConfigError(f"seed={seed!r} must be an integer from 0 to 2**32 - 1 (NumPy's seeds, which lm-eval sets)")
    if fewshot_as_multiturn and not apply_chat_template:
        raise ConfigError("fewshot_as_multiturn needs apply_chat_template (the turns are chat messages)")
    if chat_template_args is not None and not apply_chat_template:
        raise ConfigError("chat_template_args needs apply_chat_template (they are the template's variables)")
    template_args = chat_templates.template_args(chat_template_args, "chat_template_args")
    if isinstance(gen_kwargs, str) and (bad := [p for p in gen_kwargs.split(",") if p.strip() and "=" not in p]):
        raise ConfigError(f"gen_kwargs={gen_kwargs!r}: {bad[0].strip()!r} is not key=value (expected key=value "
                          f"pairs separated by commas, as lm_eval --gen_kwargs)")
    tm = task_manager(names, include_path, include_defaults)
    lm = run_or_path if isinstance(run_or_path, HybridNormLM) else \
        HybridNormLM(run_or_path, batch_size=batch_size, device=device, max_batch_size=max_batch_size, dtype=dtype)
    if isinstance(apply_chat_template, str):
        lm.chat_template_name = apply_chat_template
    if chat_template_args is not None:
        lm.chat_template_args = template_args
    if apply_chat_template:
        lm.chat_template(True)  # no template of that name: one error now, not after the tasks are built
    if gen_kwargs:
        check_gen_kwargs(lm, gen_kwargs)  # now, not after every other task has been scored
    from datasets.exceptions import DatasetsError
    from jinja2.exceptions import TemplateError
    from lm_eval import simple_evaluate

    try:
        built = build_tasks(tm, names)  # its metrics checked before any request is scored
        results = simple_evaluate(model=lm, tasks=built, num_fewshot=num_fewshot, limit=limit, task_manager=tm,
                                  log_samples=log_samples, bootstrap_iters=bootstrap_iters,
                                  apply_chat_template=apply_chat_template, fewshot_as_multiturn=fewshot_as_multiturn,
                                  system_instruction=system_instruction, gen_kwargs=gen_kwargs,
                                  **({} if seed is None else dict(random_seed=seed, numpy_random_seed=seed,
                                                                   torch_random_seed=seed, fewshot_random_seed=seed)),
                                  batch_size=lm.batch_size, max_batch_size=lm.rows.max_batch,
                                  device=str(lm.device))  # recorded in "config" only
    except ConfigError:
        raise
    except AssertionError as e:  # lm-eval's first_n sampler asserts that there are enough few-shot documents
        raise (ConfigError(short) if (short := fewshot_shortfall(e)) else e) from e
    except RuntimeError as e:  # another rank failed and left (its own line says why): this one's collective ends
        lost = collective_error(e, current_dist(), RANK_WAIT_S)
        if lost is None:
            raise
        raise lost from e
    # a task's YAML, template, dataset or !function module: bad input, one line
    except (OSError, ValueError, KeyError, ImportError, TypeError, SyntaxError, TemplateError, DatasetsError) as e:
        if short := fewshot_shortfall(e):
            raise ConfigError(short) from e
        cause = e.__cause__ if isinstance(e, DatasetsError) else None  # "An error occurred ...": its cause says what
        notes = "".join(f"; {n}" for n in getattr(e, "__notes__", []))  # datasets' log of a failed load names the file
        msg = " ".join(f"{e}{f' ({type(cause).__name__}: {cause})' if cause else ''}{notes}".split())
        if lm.world_size > 1 and "did not find any docs" in msg:  # this rank's share of a task is empty
            msg += (f" (rank {lm.rank} of {lm.world_size}: lm-eval splits each task's documents across the "
                    f"{lm.world_size} processes, one in {lm.world_size} each, so every task needs at least "
                    f"{lm.world_size} documents after --limit; use a larger --limit or fewer processes)")
        raise ConfigError(f"lm-eval could not run {', '.join(names)}: {type(e).__name__}: {msg}") from e
    if results is None:
        if lm.world_size > 1 and lm.rank != 0:
            return None  # rank 0 holds the results of every rank's documents
        raise ConfigError("lm-eval returned no results")
    # how the prompts were built, which lm-eval records only through its EvaluationTracker: a score of
    # chat-formatted prompts is not comparable with one of plain ones, so the results say which they are
    results["config"].update(
        chat_template=(lm.chat_template_name or chat_templates.DEFAULT) if apply_chat_template else None,
        chat_template_args=lm.chat_template_args if apply_chat_template else None,
        fewshot_as_multiturn=fewshot_as_multiturn, system_instruction=system_instruction)
    return results


def metric_rows(results: dict[str, Any]) -> list[tuple[str, str, float, float, int | None]]:
    """(task, metric, value, stderr, n) for every metric of an lm-eval results dict, in task order."""
    rows = []
    n_samples = results.get("n-samples", {})
    for task, metrics in results.get("results", {}).items():
        n = n_samples.get(task, {}).get("effective")
        for key, value in metrics.items():  # metrics are "name,filter"; alias, name, sample_len are not
            name, comma, filt = key.partition(",")
            if not comma or name.endswith("_stderr") or not isinstance(value, (int, float)):
                continue
            stderr = metrics.get(f"{name}_stderr,{filt}")
            label = name if filt in ("", "none") else f"{name} ({filt})"
            rows.append((task, label, float(value), float(stderr) if isinstance(stderr, (int, float)) else math.nan,
                         n))
    return rows
