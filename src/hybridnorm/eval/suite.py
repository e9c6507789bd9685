"""``hybridnorm eval``: which evaluations a request asks for, run on one checkpoint, printed as one table.

Without ``mc``/``text``/``tasks``: the validation loss and perplexity of the run's corpus (or ``data``).
With them: zero-shot multiple choice, document perplexity and lm-eval tasks, in that order.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from hybridnorm.config_base import Config, bounded
from hybridnorm.data import chat_templates, scored_references
from hybridnorm.errors import ConfigError
from hybridnorm.eval.auto_batch import MAX_BATCH, AutoBatch, BatchSize
from hybridnorm.eval.limit import check_limit
from hybridnorm.eval.lm_eval_checks import check_dtype
from hybridnorm.eval.perplexity import perplexity_of_nll
from hybridnorm.eval.report import mc_rows, perplexity_rows, print_results, write_json, write_samples
from hybridnorm.loading import Run, evaluate_on, inference_device, load_run, validation_data
from hybridnorm.train.distributed import Dist, current_dist, launched_world

SCORING_BATCH = 8  # sequences per forward of --mc / --text / --tasks unless --batch-size says otherwise


@dataclass
class EvalRequest(Config):
    """The options of ``hybridnorm eval`` (field names are the CLI's, with ``_`` for ``-``)."""

    checkpoint: str
    data: str | None = None            # corpus of the validation loss (default: the run's own)
    batches: int | None = bounded(None, ge=1)     # validation loss: None = the windows training validated on
    batch_size: int | str | None = None  # None: the run's (validation loss), else SCORING_BATCH; or auto[:N]
    max_batch_size: int | None = bounded(None, ge=1)  # where --batch-size auto starts (auto_batch.MAX_BATCH)
    seq_len: int | None = bounded(None, ge=1)
    mc: str | None = None              # HellaSwag-style JSONL
    text: str | None = None            # .txt/.jsonl file, folder, or 'kjv'
    text_field: str | None = None      # of --text's / --data's .jsonl records or parquet columns
    tasks: str | None = None           # comma-separated lm-eval tasks
    include_path: str | None = None
    limit: str | int | float | None = None  # N documents, or a fraction in (0, 1): eval.limit (text: the CLI's)
    num_fewshot: int | None = bounded(None, ge=0)
    apply_chat_template: str | None = None  # lm-eval prompts as chat: the run's template of this name
    fewshot_as_multiturn: bool = False
    system_instruction: str | None = None
    chat_template_args: str | None = None  # JSON object of template variables
    seed: int | None = bounded(None, ge=0, le=2**32 - 1)  # lm-eval's four seeds (None: lm-eval's); NumPy's bound
    gen_kwargs: str | None = None      # lm-eval's --gen_kwargs: key=value,... over every generation task's own
    device: str | None = None
    dtype: str = "auto"                # the weights cast to float32 / bfloat16 / float16 (auto: as stored)
    output: str | None = None          # also write the results as JSON
    log_samples: bool = False          # lm-eval's per-document records, a JSONL file per task beside output
    debug: bool = False                # keep lm-eval's own warnings

    @classmethod
    def label(cls, name: str) -> str:
        return f"--{name.replace('_', '-')}"  # as typed on the command line

    def check(self) -> None:
        lm_eval_only = {"--include-path": self.include_path, "--num-fewshot": self.num_fewshot is not None,
                        "--apply-chat-template": self.apply_chat_template, "--system-instruction":
                        self.system_instruction is not None, "--fewshot-as-multiturn": self.fewshot_as_multiturn,
                        "--chat-template-args": self.chat_template_args is not None, "--seed": self.seed is not None,
                        "--gen-kwargs": self.gen_kwargs is not None, "--log-samples": self.log_samples}
        if not self.tasks and any(lm_eval_only.values()):
            raise ConfigError(f"{', '.join(k for k, v in lm_eval_only.items() if v)}: only for lm-eval tasks "
                              f"(--tasks a,b)")
        for flag, given in (("--fewshot-as-multiturn", self.fewshot_as_multiturn),
                            ("--chat-template-args", self.chat_template_args is not None)):
            if given and not self.apply_chat_template:
                raise ConfigError(f"{flag} needs --apply-chat-template (chat turns and their template's variables)")
        chat_templates.template_args(self.chat_template_args, "--chat-template-args")  # before the run loads
        check_dtype(self.dtype, "--dtype")
        if self.text_field is not None and not (self.text or self.data):
            raise ConfigError("--text-field names the text of --text's or --data's records: give one of them")
        self._check_batch_size()
        if self.log_samples and not self.output:
            raise ConfigError("--log-samples writes its files beside --output FILE.json: give --output")
        if self.limit is not None and not (self.mc or self.tasks):  # --text scores every document it is given
            raise ConfigError("--limit only applies to --mc and --tasks")
        object.__setattr__(self, "limit", check_limit(self.limit, "--limit"))
        loss_only = {"--data": self.data, "--batches": self.batches is not None, "--seq-len": self.seq_len is not None}
        if (self.mc or self.text or self.tasks) and any(loss_only.values()):  # they were ignored without a word
            raise ConfigError(f"{', '.join(k for k, v in loss_only.items() if v)}: only for the validation loss "
                              "(eval without --mc, --text or --tasks); --text scores whole documents, lm-eval "
                              "tasks the model's window")
        if self.tasks is not None and not task_names(self.tasks):
            raise ConfigError(f"--tasks must be a comma-separated list, got {self.tasks!r}")

    def _check_batch_size(self) -> None:
        """``--batch-size`` N, auto or auto:N (normalized: an int, or the auto text); auto only for scoring."""
        if self.batch_size is not None:
            spec = BatchSize.parse(self.batch_size, "--batch-size")
            object.__setattr__(self, "batch_size", spec.rows or str(spec))
            if spec.rows is None and not (self.mc or self.text or self.tasks):
                raise ConfigError("--batch-size auto sizes the scoring batches of --mc, --text and --tasks; the "
                                  "validation loss takes a number (default: the run's batch_size, which fits "
                                  "wherever it trained)")
        if self.max_batch_size is not None and not isinstance(self.batch_size, str):
            raise ConfigError("--max-batch-size is where --batch-size auto starts: give --batch-size auto")


def task_names(text: str) -> list[str]:
    return [t.strip() for t in text.split(",") if t.strip()]


def run_eval(req: EvalRequest) -> dict[str, Any]:
    """Run what ``req`` asks for, print it, write ``req.output`` if set; returns the results dict. Under a
    torchrun of several processes the ranks share the work (lm-eval's documents; the questions of ``--mc``,
    the documents of ``--text``, the batches of the validation loss); rank 0 prints and writes the results of
    all of them and returns them, the others return an empty dict. In a process group already joined (a
    script's), every rank must call it: the ranks' scores are gathered."""
    device = inference_device(req.device)  # before the minutes of loading, and for every kind of evaluation
    if req.output:  # so is where the results go: an evaluation of hours is not lost to a typo in a path, nor
        # written over what it reads (the checkpoint's weights, the questions, the text, the task folder)
        from hybridnorm.train.preflight import check_output_file

        check_output_file(req.output, "--output", example="results.json", inputs=[
            ("the checkpoint", req.checkpoint), ("--data", req.data), ("--mc", req.mc),
            ("--text", None if req.text == "kjv" else req.text), ("--include-path", req.include_path)])
    if launched_world() > 1:
        from hybridnorm.eval.lm_eval_ranks import RANK_WAIT_S, launched_local_rank
        from hybridnorm.train.distributed import init_distributed, leave, resolve_device

        device = resolve_device(req.device or "auto", launched_local_rank())  # this rank's GPU
        init_distributed(device, RANK_WAIT_S)  # which makes it the current device
        out = _run_eval(req, device)
        leave()  # only after success: a rank that failed exits, and the others' collectives fail with it
        return out
    return _run_eval(req, device)


def _run_eval(req: EvalRequest, device: Any) -> dict[str, Any]:
    run = load_run(req.checkpoint)
    run.model.to(device, check_dtype(req.dtype, "--dtype"))  # None, None ("auto", no --device): as loaded
    ranks = current_dist()  # under torchrun: this rank's share of every evaluation
    if not (req.mc or req.text or req.tasks):
        return _validation_loss(run, req, ranks)
    table: list = []
    notes: list[str] = []
    samples = None
    out: dict[str, Any] = {"checkpoint": str(run.checkpoint)}
    scoring_batch = req.batch_size or SCORING_BATCH  # --mc / --text / --tasks
    sizer = AutoBatch(run.model, BatchSize.parse(scoring_batch), req.max_batch_size or MAX_BATCH)
    if req.mc:
        from hybridnorm.eval.multiple_choice import evaluate_mc

        mc = evaluate_mc(run.model, run.tokenizer, req.mc, batch_size=sizer.scoring(), limit=req.limit,
                         ranks=ranks)
        table += mc_rows(mc, f"mc:{Path(req.mc).name}")
        out["mc"] = mc.to_dict(per_item=True)
    if req.text:
        from hybridnorm.eval.perplexity import perplexity_of_run

        ppl = perplexity_of_run(run, req.text, batch_size=sizer.scoring(), text_field=req.text_field or "text",
                                ranks=ranks)
        table += perplexity_rows(ppl, f"text:{Path(req.text).name}")
        notes.append(f"text: {ppl.n_docs:,} documents, {ppl.n_tokens:,} tokens, {ppl.n_bytes:,} bytes, "
                     f"{ppl.n_words:,} words")
        out["text"] = ppl.to_dict()
    if req.tasks:
        from hybridnorm.eval.lm_eval_adapter import metric_rows, run_lm_eval

        if not req.debug:  # lm-eval's per-task warnings would bury the table (and a one-line error)
            logging.getLogger("lm_eval").setLevel(logging.ERROR)
            # a metric or aggregation it did not find: the error line names it (lm_eval_checks.build_tasks)
            logging.getLogger("lm_eval.api.registry").setLevel(logging.CRITICAL)
        res = run_lm_eval(run, task_names(req.tasks), include_path=req.include_path, limit=req.limit,
                          num_fewshot=req.num_fewshot, batch_size=scoring_batch, max_batch_size=sizer.max_batch,
                          apply_chat_template=req.apply_chat_template or False,
                          fewshot_as_multiturn=req.fewshot_as_multiturn, system_instruction=req.system_instruction,
                          chat_template_args=req.chat_template_args, seed=req.seed,  # JSON, checked by check()
                          gen_kwargs=req.gen_kwargs, log_samples=req.log_samples)
        if res is None:  # another rank's share of a data-parallel evaluation: rank 0 reports it
            return {}
        sizer.sizes += res["config"].get("batch_sizes") or []
        rows = metric_rows(res)
        table += rows
        scored = {r[0] for r in rows}
        for task in (t for t in res.get("results", {}) if t not in scored and t not in res.get("groups", {})):
            if task in res.get("group_subtasks", {}):  # a group that names no aggregate: lm-eval scores no group
                notes.append(f"{task}: a group without aggregate_metric_list (lm-eval scores its tasks, not it)")
                continue
            # lm-eval reports such a task without a word: an empty row where a number was expected
            notes.append(f"{task}: lm-eval computed no metric (does its metric_list apply to its output_type?)")
        if req.apply_chat_template or req.system_instruction is not None:
            notes.append(f"lm-eval prompts: {_prompt_note(res['config'])}")
        out["lm_eval"] = {k: v for k, v in res.items() if k != "samples"}
        samples = res.get("samples") if req.log_samples else None
    if not ranks.is_main:  # another rank's share of a data-parallel evaluation: rank 0 reports it
        return {}
    if req.dtype != "auto":  # a score of bf16 weights is not the score of the stored ones
        notes.append(f"weights in {req.dtype} (--dtype)")
    if sizer.sizes:
        notes.append(f"batch sizes found by --batch-size {scoring_batch}: {', '.join(map(str, sizer.sizes))}"
                     + (" (rank 0's; each rank sizes its own)" if ranks.world_size > 1 else ""))
    print_results(table, f"{run.checkpoint}", notes)
    if req.output:
        print(f"results: {write_json(req.output, out)}")
    if samples is not None:
        print(f"samples: {', '.join(map(str, write_samples(req.output, samples)))}")
    return out


def _prompt_note(config: dict[str, Any]) -> str:
    """How lm-eval's prompts were built (:func:`~hybridnorm.eval.lm_eval_adapter.run_lm_eval`'s record)."""
    parts = [f"chat template {config['chat_template']!r}" if config["chat_template"] else "no chat template"]
    if config["chat_template_args"]:
        parts.append(f"template variables {config['chat_template_args']}")
    if config["fewshot_as_multiturn"]:
        parts.append("few-shot as turns")
    if config["system_instruction"] is not None:
        parts.append("a system instruction")
    return ", ".join(parts)


def _validation_loss(run: Run, req: EvalRequest, ranks: Dist) -> dict[str, Any]:
    data = validation_data(run, req.data, req.text_field)
    loss, n_tokens = evaluate_on(run, data, batch_size=req.batch_size, seq_len=req.seq_len, max_batches=req.batches,
                                 ranks=ranks)
    if not ranks.is_main:  # rank 0 reports the loss of every rank's batches
        return {}
    source = req.data or run.config.data.source
    # for scale, what two count-based models score on exactly those tokens
    unigram, bigram = scored_references(data.train_tokens(), data.val_tokens(), n_tokens, data.tokenizer.vocab_size)
    print(f"{run.checkpoint}: val loss {loss:.4f}, perplexity {perplexity_of_nll(loss):.2f} over {n_tokens:,} tokens "
          f"of {source}; on those tokens a unigram model scores {unigram:.4f}, a Kneser-Ney bigram {bigram:.4f}"
          + (f" (weights in {req.dtype}, --dtype)" if req.dtype != "auto" else ""))
    out = {"checkpoint": str(run.checkpoint),
           "val": {"source": source, "loss": loss, "perplexity": perplexity_of_nll(loss), "tokens": n_tokens,
                   "unigram_entropy": unigram, "bigram_entropy": bigram}}
    if data.found_note:  # the run's data.source is not here: which cache entry was scored
        print(f"note: {data.found_note}")
        out["val"]["found_note"] = data.found_note
    if data.changed_note:  # the run's data.source holds other files than it trained on: not its validation loss
        print(f"note: {data.changed_note}")
        out["val"]["changed_note"] = data.changed_note
    if note := data.split_note():  # a validation split far from its share, as train's log says it
        print(f"note: {note}")
        out["val"]["split_note"] = note
    if req.output:
        write_json(req.output, out)
    return out
