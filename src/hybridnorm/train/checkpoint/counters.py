"""The counters a checkpoint records, held to what a run could have reached.

``state.json`` holds integers that nothing else in the checkpoint vouches for — the manifest only says the
file is the one written, and a hand edit re-signs it: ``step`` and ``tokens``, and the data loader's position
(``data``: ``epoch``, ``step`` within it, and the sizes it was counted in). A resume trusts them: an ``epoch``
of 10**20 was read back and trained on another data order without a word. So each counter is a non-negative
integer and, where the sizes say it, no larger than any run could have made it:

- ``data.step`` lies inside its epoch (the loader's own arithmetic);
- every finished epoch trained ``steps_per_epoch`` steps of ``global_batch`` windows of ``seq_len`` tokens, and
  ``tokens`` counts them all: ``epoch * steps_per_epoch * global_batch * seq_len <= tokens``. That holds for a
  position counted per optimizer step and for an older one counted per micro-batch alike (either product is
  the tokens the windows held); without the sizes, each epoch still took at least one token;
- a position counted per optimizer step (``per_step``) bounds ``tokens`` by ``step`` in turn: each step trains
  ``global_batch * seq_len`` tokens, never more (fewer only after a divergence rolled steps back). An older
  position's micro-batches per step are not recorded, so its ``tokens`` has no such bound.

These are checks of the checkpoint against itself, from JSON alone: a checkpoint failing one is corrupt (set
aside on resume, like a tensor whose shape disagrees with its weight; :mod:`.retention`). AdamW's own step
count is a tensor value, read only when the optimizer is loaded: :func:`check_optimizer_step`, called there,
refuses a bad one with an error, as a non-finite weight is refused (:mod:`.load` says why).
"""

from __future__ import annotations

from pathlib import Path

import torch

from hybridnorm.train.checkpoint.layout import CheckpointError, is_int, malformed, short_int

# the data-loader position TokenBatches.state_dict writes: all integers
DATA_KEYS = ("epoch", "step", "seed", "seq_len", "global_batch", "n_tokens", "per_step")  # per_step: see loader


def check_data(path: Path, data: object, step: int, tokens: int) -> None:
    """The data-loader position of ``state.json`` (``path``), whose ``step`` and ``tokens`` (both integers >= 0,
    checked before) it must agree with: empty (an imported model's step 0) or TokenBatches' integers, within
    the bounds of the module docstring."""
    if not isinstance(data, dict):
        raise malformed(path, f"'data' must be an object, got {type(data).__name__}")
    if not data:
        return
    for key, value in data.items():
        if key not in DATA_KEYS or not is_int(value) or value < 0:
            raise malformed(path, f"'data' holds {key!r}: {value!r}; expected integers >= 0 among {DATA_KEYS}"[:300])
    for key in ("epoch", "step"):
        if key not in data:
            raise malformed(path, f"'data' has no {key!r}")
    if not all(data.get(k, 0) > 0 for k in ("n_tokens", "seq_len", "global_batch")):
        if data["epoch"] > tokens:
            raise malformed(path, f"'data' epoch {short_int(data['epoch'])} is more epochs than the {tokens} tokens "
                             "trained could finish")
        return
    # the same arithmetic as TokenBatches: a position past the end of its own epoch is not a position
    steps_per_epoch = ((data["n_tokens"] - 1) // data["seq_len"]) // data["global_batch"]
    if data["step"] >= max(steps_per_epoch, 1):
        raise malformed(path, f"'data' step {short_int(data['step'])} is past its epoch of {steps_per_epoch} steps")
    step_tokens = data["global_batch"] * data["seq_len"]
    if data.get("per_step") and tokens > step * step_tokens:
        raise malformed(path, f"'tokens' is {short_int(tokens)}, more than {step} steps of {step_tokens} tokens "
                         "('data': global_batch x seq_len) could train")
    if data["epoch"] * max(steps_per_epoch, 1) * step_tokens > tokens:
        raise malformed(path, f"'data' epoch {short_int(data['epoch'])} is more epochs of {steps_per_epoch} steps of "
                         f"{step_tokens} tokens than the {short_int(tokens)} tokens trained could finish")


def check_optimizer_step(file: Path | str, key: str, count: torch.Tensor, step: int, state_path: Path) -> None:
    """AdamW's step count ``count`` (0-d, finite; tensor ``key`` of ``file``) is a whole number from 0 to the
    checkpoint's ``step`` (recorded in ``state_path``): one optimizer step per training step at most, fewer
    where updates were skipped. Compared in the count's own dtype, as float32 rounds counts past 2**24."""
    value, bound = float(count), float(torch.tensor(float(step), dtype=count.dtype))
    if not (value.is_integer() and 0 <= value <= bound):
        raise CheckpointError(f"checkpoint file {file}: tensor {key!r} counts {value:g} optimizer steps, but "
                              f"{state_path} records step {step}: refused (expected a whole number from 0 to "
                              f"{step})")

