"""What a run shows besides its checkpoints: the console lines (paths printed as they are, a line per log interval
on a terminal that cannot redraw, no crash on a stdout that is not UTF-8) and TensorBoard's view of the run,
read with TensorBoard's own ``EventAccumulator`` and compared, scalar by scalar, with ``metrics.jsonl``."""

from __future__ import annotations

import shutil
from pathlib import Path

from train_helpers import tiny_overrides

from hybridnorm import cli
from hybridnorm.train.checkpoint import latest_checkpoint

ROOT = Path(__file__).resolve().parents[2]


def test_paths_with_brackets_are_printed_as_they_are(corpus, cache_dir, tmp_path, capsys, no_peak_measure):
    """A data folder named ``docs[v2]`` was printed as ``docs`` (rich took ``[v2]`` for a style), and a run folder
    under ``x[/y]`` could not be resumed at all: rich raised MarkupError on the ``[/y]`` of the checkpoint path."""
    source = tmp_path / "docs[v2]"
    shutil.copytree(corpus, source)  # the same files under the same names: the cached tokens are reused
    run = tmp_path / "x[" / "y]"
    args = ["train", *tiny_overrides(source, cache_dir, run), "--ckpt_interval=1"]
    assert cli.main([*args, "--max_steps=1"]) == 0
    assert f"data: {source} (" in capsys.readouterr().err
    assert cli.main([*args, "--max_steps=2", "--resume"]) == 0
    err = capsys.readouterr().err
    assert f"resumed from {run / 'checkpoints' / 'step_000001'}" in err and "Traceback" not in err
    assert latest_checkpoint(run / "checkpoints").name == "step_000002"
