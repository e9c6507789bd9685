"""transformers' ``Trainer`` (and TRL's ``SFTTrainer``) on ``HybridNormForCausalLM`` under the real ``torchrun``
(2 gloo processes on CPU), with DDP and with accelerate's FSDP2 wrapping each ``HybridNormDecoderLayer`` (the
class our ``_no_split_modules`` names): the same 4 logged losses as one process with the whole batch. The worker is
``trainer_worker.py``; Trainer counts the scored tokens over both processes (``num_items_in_batch``), so the
two runs optimise the same objective. Measured: equal to ~1e-7 (float32 reduction order)."""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import pytest

pytest.importorskip("transformers", reason="the hf extra (transformers) is not installed")
pytest.importorskip("accelerate", reason="Trainer needs accelerate (in the dev extra)")
from train_helpers import TORCHRUN, run_bounded  # tests/: a subprocess killed with its children if it hangs

WORKER = str(Path(__file__).with_name("trainer_worker.py"))


def losses(cmd: list[str], tmp: Path) -> dict[str, list[float]]:
    env = {**os.environ, "OMP_NUM_THREADS": "1", "OUT": str(tmp)}
    done = run_bounded(cmd, 300, env=env)
    assert done.returncode == 0, done.stderr[-3000:]
    return {line.split()[1]: json.loads(line.split(maxsplit=2)[2])
            for line in done.stdout.splitlines() if line.startswith("LOSSES ")}


def test_trainer_under_torchrun_equals_one_process(tmp_path: Path) -> None:
    """Each variant (``lm``: HybridNorm*; ``moe``: HybridNorm with 4 experts; ``sft``: TRL's SFTTrainer, whose
    fused LM head reads the tied head's weight itself, under FSDP2 too; ``seqcls``: an untied sequence
    classifier with gradient checkpointing, so DDP looks for no unused parameter, one label per sample,
    counted over both ranks) under DDP and FSDP2 logs one process's losses."""
    variants = ["lm", "moe", "seqcls"]
    try:
        import trl  # noqa: F401

        variants.append("sft")
    except ImportError:
        pass  # TRL is in the dev extra; without it the other variants still run
    one = losses([sys.executable, WORKER, "single", *variants], tmp_path / "one")
    assert list(one) == variants
    for variant in variants:
        assert len(one[variant]) == 4 and one[variant][-1] < one[variant][0], variant
    assert len({tuple(v) for v in one.values()}) == len(variants)  # four different runs, not one printed four times
    for mode in ("ddp", "fsdp2"):
        two = losses([*TORCHRUN, "--standalone", "--nproc_per_node", "2", WORKER, mode, *variants], tmp_path / mode)
        assert list(two) == variants, mode
        for variant in variants:
            assert two[variant] == pytest.approx(one[variant], rel=1e-5), (mode, variant)
