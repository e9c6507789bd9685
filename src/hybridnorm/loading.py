"""Open a trained run OR a local Hugging Face model folder for generation and evaluation.

This is the one loader above both kinds of folder: runs through :mod:`hybridnorm.train.run`, HF folders
through :mod:`hybridnorm.hf.export` (imported only for an HF folder: it needs the optional
``transformers``). Nothing below it imports it, so ``hybridnorm.hf`` and the run loader never form a cycle.
"""

from __future__ import annotations

import math
from pathlib import Path

import torch

from hybridnorm.data import PreparedData, prepare_data, resolve_cache_dir, val_batch_count, val_batches
from hybridnorm.data.corpus import KJV_SOURCES, for_option
from hybridnorm.data.prepare import find_prepared
from hybridnorm.errors import ConfigError
from hybridnorm.nn.model import lm_loss
from hybridnorm.train.checkpoint.format import read_state
from hybridnorm.train.distributed import Dist
from hybridnorm.train.rank_share import gather_rows, share
from hybridnorm.train.run import Run, check_exists, check_run_fits, is_hf_folder, open_run

__all__ = ["Run", "evaluate_run", "load_run"]


def inference_device(name: str | None) -> torch.device | None:
    """``--device`` of ``eval`` / ``generate``, parsed and probed with an empty tensor: a malformed name, a
    device type this torch was built without, CUDA with no GPU present or an index past the last GPU is one
    ConfigError naming it. Not given: the GPU where one is visible (as ``train``'s ``auto``, transformers'
    pipelines and lm-eval's HF backend), else None (the CPU, where a run loads)."""
    if name is None:
        return torch.device("cuda") if torch.cuda.is_available() else None
    try:
        device = torch.device(name)
        torch.empty(0, device=device)
        if device.type == "meta":
            raise ValueError("the meta device holds shapes, no numbers")
    except (RuntimeError, AssertionError, ValueError) as e:  # AssertionError: "Torch not compiled with CUDA"
        raise ConfigError(f"--device={name!r} cannot be used here: {' '.join(str(e).split())[:200]}") from None
    return device


def load_run(path: str | Path) -> Run:
    """``path`` is a run folder (its newest good checkpoint is used), a ``checkpoints/step_*`` folder, or a
    local Hugging Face model folder (stock Llama/Qwen3/OLMo-2/... or exported by hybridnorm)."""
    path = check_exists(path)
    if is_hf_folder(path):
        try:
            from hybridnorm.hf.export import load_hf_run
        except ImportError:
            raise ConfigError(f"{path} is a Hugging Face model folder: reading it needs transformers "
                              "(pip install 'hybridnorm[hf]')") from None
        return load_hf_run(path)
    check_run_fits(path, copies=2)  # from config.yaml, before the model (and the file tensors read into it) exist
    return open_run(path)


def validation_data(run: Run, source: str | None = None, text_field: str | None = None) -> PreparedData:
    """``source`` (default: the run's own corpus) prepared with the run's tokenizer (the shared token
    cache), checked against the model's vocabulary: what :func:`evaluate_on` scores. The cache is the run's
    ``data.cache_dir`` where that folder is here, else this machine's (``$HYBRIDNORM_CACHE``, else
    ``~/.cache/hybridnorm``): a run copied from another machine does not recreate its trainer's cache path.
    The run's own corpus whose ``data.source`` is not here (the run was moved or copied, or the path is
    relative to another folder) is found in the cache by the content its checkpoint recorded; one that is here
    but whose content is not what the checkpoint recorded (edited since, or a relative path that names other
    files from this folder) is scored with ``changed_note`` saying so."""
    recorded_cache = run.config.data.cache_dir
    cache_dir = recorded_cache if recorded_cache and Path(recorded_cache).expanduser().is_dir() else None
    text_field = text_field or run.config.data.text_field
    if source is None and (data := _moved_corpus(run, cache_dir, text_field)) is not None:
        data.check_vocab(run.config.model.vocab_size, f"model vocab_size of {run.checkpoint}")
        return data
    try:
        data = prepare_data(source or run.config.data.source, tokenizer=str(run.tokenizer_file),
                            cache_dir=cache_dir, text_field=text_field)
    except ConfigError as e:  # a corpus the user named with eval's --data, not a run's data.source
        raise (for_option(e, source, "--data") if source else e) from None
    data.check_vocab(run.config.model.vocab_size, f"model vocab_size of {run.checkpoint}")
    if source is None:  # --data is the user's choice of corpus; the run's own must be what it trained on
        data.changed_note = _changed_note(run, data)
    return data


def _recorded_sha(run: Run) -> str | None:
    """The sha256 of the data files the trainer recorded in the checkpoint (None: an HF folder, or a
    checkpoint from before the trainer recorded it)."""
    if not (run.checkpoint / "state.json").is_file():
        return None
    sha = read_state(run.checkpoint)["extra"].get("data_sha256")
    return sha or None


def _relative_note(src: str) -> str:
    return "" if Path(src).is_absolute() else f" (a relative path, read from the current folder {Path.cwd()})"


def _changed_note(run: Run, data: PreparedData) -> str | None:
    """What to say beside a loss on the run's ``data.source`` whose files now hold other content than the
    checkpoint recorded: the loss is not the run's validation loss. Not refused: scoring an edited corpus can be
    meant. None where the content is the same, or either hash is unknown."""
    recorded = _recorded_sha(run)
    if not recorded or not data.data_sha256 or recorded == data.data_sha256:
        return None
    src = run.config.data.source
    return (f"data.source={src}{_relative_note(src)} now holds other data (sha256 {data.data_sha256[:16]}) than "
            f"{run.checkpoint} recorded it trained on (sha256 {recorded[:16]}): this loss is on other data than "
            "the run's validation split (give --data to score a corpus on purpose)")


def _moved_corpus(run: Run, cache_dir: str | None, text_field: str) -> PreparedData | None:
    """The run's own corpus from the cache when its local ``data.source`` is not there (None where it is, or
    for ``kjv``/``hf:`` sources); a ConfigError saying what to pass where the cache holds no copy either."""
    src = run.config.data.source
    if src in KJV_SOURCES or src.startswith("hf:") or Path(src).exists():
        return None
    sha = _recorded_sha(run)
    where = f"data.source={src}, the corpus {run.checkpoint} was trained on, is not here{_relative_note(src)}"
    if not sha:  # nothing to find a cached copy by: say that, not that there is none
        raise ConfigError(f"{where}, and {run.checkpoint} records no data sha256 (written before checkpoints "
                          "recorded it) by which to find a cached copy: pass --data PATH, the corpus where it lies now")
    data = find_prepared(src, sha, run.tokenizer, cache_dir, text_field=text_field)
    if data is None:
        raise ConfigError(f"{where}, and the data cache {resolve_cache_dir(cache_dir)} holds no prepared copy of it "
                          f"(data sha256 {sha[:16]}): pass --data PATH, the corpus where it lies now")
    data.found_note = f"{where}: its validation split was read from the data cache {data.dir} (data sha256 {sha[:16]})"
    return data


def evaluate_run(run: Run, source: str | None = None, batch_size: int | None = None, seq_len: int | None = None,
                 max_batches: int | None = None, text_field: str | None = None, ranks: Dist | None = None,
                 ) -> tuple[float, int]:
    """Mean next-token loss of ``run`` on the validation split of ``source`` (default: the run's own),
    tokenized with the run's tokenizer: :func:`evaluate_on` of :func:`validation_data`."""
    return evaluate_on(run, validation_data(run, source, text_field), batch_size, seq_len, max_batches, ranks)


@torch.no_grad()
def evaluate_on(run: Run, data: PreparedData, batch_size: int | None = None, seq_len: int | None = None,
                max_batches: int | None = None, ranks: Dist | None = None) -> tuple[float, int]:
    """Mean next-token loss of ``run`` on the validation split of ``data``. Returns (loss, tokens scored).
    By default the windows are those the run's training validated on (``TrainConfig.eval_windows``, in
    batches of the run's ``batch_size``), so the loss is the one its log shows for that checkpoint;
    ``max_batches`` scores that many batches of ``batch_size`` instead. ``ranks``: a joined process group
    whose ranks share the batches (each calls this and gets the loss, the one-process sum of the same
    per-batch values)."""
    seq_len = seq_len or run.config.seq_len
    batch_size = batch_size or run.config.batch_size
    windows = max_batches * batch_size if max_batches is not None else run.config.eval_windows
    val = data.val_tokens()
    if len(val) < seq_len + 1:
        raise ConfigError(f"validation split of {data.source} has {len(val)} tokens, "
                          f"fewer than seq_len + 1 = {seq_len + 1}")
    d = ranks or Dist()
    n_batches = val_batch_count(val, batch_size, seq_len, -(-windows // batch_size))
    device = next(run.model.parameters()).device  # where `eval --device` put the model
    mine = []  # (sum of token losses, tokens) of this rank's batches
    for i, (x, y) in zip(share(n_batches, d), val_batches(val, batch_size, seq_len, n_batches, d.rank,
                                                           d.world_size), strict=True):
        keep = min(len(x), windows - i * batch_size)  # the last batch: only the windows still asked for
        x, y = x[:keep].to(device), y[:keep].to(device)
        mine.append((lm_loss(run.model(x), y).item() * y.numel(), y.numel()))
    total, count = 0.0, 0
    for loss_sum, n in gather_rows(mine, n_batches, d):  # one process's order, whatever the ranks
        total += loss_sum
        count += int(n)
    return (total / count if count else math.nan), count
