"""Resuming a run with the model and tokenizer it was trained with.

``train --resume`` builds the model and the tokenizer from the command's config and then loads the newest
checkpoint into the model. Its weights only fix tensor shapes, so a command that differs from the run in
something shape-free (a Pre-Norm run resumed as Post-Norm has the same parameters; a new ``data.source``
trains a new BPE of the same size) would go on training a different model, or the same model on text cut
into different tokens, and say nothing; then it would overwrite the run's ``config.yaml`` and
``tokenizer.json`` with the new ones. This guard compares the command with what was recorded before anything
is written: the copies of ``config.yaml`` and ``tokenizer.json`` kept in the checkpoint being loaded (so a
run's ``config.yaml`` edited by hand since cannot vouch for it), or the run folder's for a checkpoint
written before those copies existed:

* the tokenizer must be the same one (its fingerprint; checked first, as a new tokenizer usually brings a
  new vocab size too), and a damaged recorded ``tokenizer.json`` is one error naming it;
* the model's architecture must be the same: every ``model`` field but the ones that do not change the
  function a checkpoint computes (:data:`FREE_MODEL_FIELDS`); otherwise one error listing each field with
  its recorded and requested value. ``model.placement`` is compared as the placement it builds, not as the
  text that names it: another spelling of it (``HybridNorm``, ``QKV-Post`` or the alias ``hybrid`` for
  ``hybridnorm``; a spec of one's own written with its defaults spelt out, or its Q/K letters as ``KQ``) is
  no change at all; its name, description or default init (a resume draws no fresh weights) may change, and so
  may how it is written where it builds the same blocks (``Placement.built``: an override equal to the block it
  replaces, ``first_fraction`` and ``first_n`` covering the same blocks, a field its blocks ignore), logged; a
  placement that builds anything else is refused naming the blocks and the fields that differ in them;
* every other field may change (more steps, a new learning rate; new data with the run's tokenizer for a
  model imported with ``hybridnorm import``, whose checkpoint holds no data position — a trained run's
  data position is checked against its data by the checkpoint loader): :func:`check_resume` returns those
  fields for the run's log, and :func:`resume_events` logs them with a change of the data's content.
"""

from __future__ import annotations

import dataclasses
import itertools
from pathlib import Path
from typing import Any

from hybridnorm.config import ModelConfig
from hybridnorm.config_base import config_differences, flatten_config
from hybridnorm.data.tokenizer import Tokenizer, load_tokenizer
from hybridnorm.errors import ConfigError
from hybridnorm.train.checkpoint import checked_run_file, checked_tokenizer_file
from hybridnorm.train.config import TrainConfig

# model fields a resumed run may change: how the math is run, how fresh weights would be drawn (a resumed
# run draws none), and the longest sequence RoPE tables are built for (no parameter depends on it). RoPE's
# frequencies too (rope_theta, rope_scaling.*): they change the function, but on purpose and by the standard
# recipe of a long-context stage (a longer max_seq_len with a larger θ or a YaRN / Llama 3.1 stretch, trained on)
FREE_MODEL_FIELDS = frozenset({"model.fast_kernels", "model.init", "model.init_std", "model.max_seq_len",
                               "model.rope_theta"})
FREE_MODEL_SECTIONS = ("model.rope_scaling",)
# fields that say where things are kept and when to log, save or pause, not what is trained: not reported.
# The batch split too: a resume keeps the run's global batch (a different one is refused) and logs the split
# it derives as a batch_split_derived event (hybridnorm.train.batch_split)
RUN_CONTROL_FIELDS = frozenset({"out_dir", "data.cache_dir", "max_minutes", "stop_after_steps", "log_interval",
                                "eval_interval", "ckpt_interval", "keep_last", "batch_size", "grad_accum",
                                "global_batch", "dist_timeout", "async_checkpoint"})


def check_resume(run_dir: Path, cfg: TrainConfig, tokenizer: Tokenizer, ckpt: Path) -> dict[str, list[Any]]:
    """Check that ``cfg`` (vocab and precision resolved) and ``tokenizer`` continue the run in ``run_dir``,
    whose checkpoint ``ckpt`` is about to be loaded. Returns the dotted fields that differ from the recorded
    ``config.yaml`` (``ckpt``'s copy, else the run's) and may (sorted), each with ``[recorded, requested]`` (a
    report of the run states what it trained with from then on); raises ConfigError for the ones that
    may not, or a tokenizer that is not the recorded one. Without a recorded config or tokenizer (an older
    layout) that is not checked."""
    recorded_tok = checked_tokenizer_file(ckpt)
    if recorded_tok.is_file():
        theirs = load_tokenizer(recorded_tok)  # ConfigError naming the file if it is damaged
        if theirs.fingerprint != tokenizer.fingerprint:
            raise ConfigError(f"cannot resume {run_dir} with another tokenizer: data.tokenizer="
                              f"{cfg.data.tokenizer!r} with data.source={cfg.data.source!r} gives a tokenizer "
                              f"that differs from the run's {recorded_tok}; resume with the run's data settings (its "
                              f"config.yaml), or pass --data.tokenizer={recorded_tok} to keep its tokenizer")
    recorded_cfg = checked_run_file(ckpt, "config.yaml")
    if not recorded_cfg.is_file():
        return {}
    recorded_config = TrainConfig.load(recorded_cfg)
    recorded, requested = recorded_config.to_dict(), cfg.to_dict()
    changed = [k for k in config_differences(recorded, requested) if k not in RUN_CONTROL_FIELDS]
    spec_change = _placement_change(recorded_config.model, cfg.model) if "model.placement" in changed else None
    if spec_change == "":  # another spelling of the run's own placement
        changed.remove("model.placement")
    fixed = [k for k in changed if k.startswith("model.") and k not in FREE_MODEL_FIELDS
             and not k.startswith(FREE_MODEL_SECTIONS) and (k != "model.placement" or spec_change)]
    before, after = flatten_config(recorded), flatten_config(requested)
    if fixed:
        what = ", ".join(f"{k}: {_show(before.get(k))} -> {_show(after.get(k))}" if k != "model.placement" else
                         f"{k}: {_show_placement(recorded_config.model)} -> {_show_placement(cfg.model)}, which "
                         f"computes otherwise: {spec_change}" for k in fixed)
        raise ConfigError(f"cannot resume {run_dir} as a different model ({what}; recorded in "
                          f"{recorded_cfg}): resume with the run's own model settings, or train the new "
                          "model in another --out")
    return {k: [before.get(k), after.get(k)] for k in changed}


def _placement_change(recorded: ModelConfig, requested: ModelConfig) -> str | None:
    """How the requested placement builds otherwise than the recorded one: the blocks (1-based, as the docs count
    them) whose fields differ as built, and the model-level norms that differ (``blocks 2-12: qkv_norm: 'QK' ->
    'QKV'; final_norm: True -> False``); ``None`` when both build the same model (a change allowed and logged:
    another name, description or default init, as model.init: a resume draws no fresh weights; blocks written
    otherwise), ``""`` when both resolve to one spec (another spelling: no change). The spellings are compared
    as specs, as the model is built from them: ``HybridNorm``, ``hybrid`` and ``QKV-Post`` all build
    ``hybridnorm``, so resuming with one of them is resuming the same model."""
    a, b = recorded.resolved_placement(), requested.resolved_placement()
    if a.to_dict() == b.to_dict():
        return ""
    # each at its own depth: a changed model.n_layers is refused as such
    built_a, built_b = a.built(recorded.n_layers), b.built(requested.n_layers)
    per_block = [_spec_differences(dataclasses.asdict(x), dataclasses.asdict(y))
                 for x, y in zip(built_a.pop("blocks"), built_b.pop("blocks"), strict=False)]
    said = []
    for diffs, run in itertools.groupby(enumerate(per_block), key=lambda item: item[1]):
        layers = [i + 1 for i, _ in run]
        if diffs:
            blocks = f"block {layers[0]}" if len(layers) == 1 else f"blocks {layers[0]}-{layers[-1]}"
            said.append(f"{blocks}: {', '.join(diffs)}")
    return "; ".join(said + _spec_differences(built_a, built_b)) or None


def _spec_differences(a: Any, b: Any, where: str = "") -> list[str]:
    """``field: before -> after`` for each leaf of two (nested) dicts that differs (of two lists of different
    lengths, their lengths)."""
    if isinstance(a, dict) and isinstance(b, dict):
        return [d for k in dict.fromkeys([*a, *b])
                for d in _spec_differences(a.get(k), b.get(k), f"{where}.{k}" if where else k)]
    if isinstance(a, (list, tuple)) and isinstance(b, (list, tuple)):
        if len(a) != len(b):
            return [f"{where}: {len(a)} -> {len(b)} entries"]
        return [d for i, (x, y) in enumerate(zip(a, b, strict=True)) for d in _spec_differences(x, y, f"{where}[{i}]")]
    return [] if a == b else [f"{where}: {_show(a)} -> {_show(b)}"]


def resume_events(changed: dict[str, list[Any]], extra: dict[str, Any], data_sha256: str) -> list[dict[str, Any]]:
    """The events a resume logs: the config fields that changed (:func:`check_resume`), and new data under
    the run's data settings, told by the sha256 of the data files that the checkpoint recorded (a file
    edited in place keeps ``data.source``, and may keep its size, mtime and token counts). Like a changed
    ``data.source`` it is allowed, and logged; a checkpoint from before the hash was kept has none."""
    events: list[dict[str, Any]] = []
    if changed:  # "values": {field: [before, after]} (since 2026-12-02; "fields" alone before)
        events.append({"event": "config_changed_on_resume", "fields": list(changed), "values": changed})
    recorded = extra.get("data_sha256")
    if isinstance(recorded, str) and recorded and data_sha256 and recorded != data_sha256:
        events.append({"event": "data_changed_on_resume", "recorded_data_sha256": recorded,
                       "data_sha256": data_sha256})
    return events


def _show_placement(model: ModelConfig) -> str:
    """A placement as the config gives it: its name, or for a spec written out, the spec's name."""
    raw = model.placement
    return repr(raw) if isinstance(raw, str) else f"the spec named {model.resolved_placement().name!r}"


def _show(value: Any) -> str:
    return "(absent)" if value is None else repr(value)
