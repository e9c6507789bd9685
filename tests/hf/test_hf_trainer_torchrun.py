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


def losses(cmd: list[str], tmp: Path) -> list[float]:
    env = {**os.environ, "OMP_NUM_THREADS": "1", "OUT": str(tmp)}
    done = run_bounded(cmd, 300, env=env)
    assert done.returncode == 0, done.stderr[-3000:]
    line = next(x for x in done.stdout.splitlines() if x.startswith("LOSSES "))
    return json.loads(line.removeprefix("LOSSES "))


@pytest.mark.parametrize(("placement", "flags"), [("hybridnorm_star", []), ("hybridnorm", ["moe"]),
                                                   ("hybridnorm_star", ["sft"]), ("hybridnorm_star", ["seqcls"])],
                         ids=["lm", "moe", "sft", "seqcls"])
def test_trainer_under_torchrun_equals_one_process(tmp_path: Path, placement: str, flags: list[str]) -> None:
    """``sft``: TRL's SFTTrainer, whose fused LM head reads the tied head's weight itself (under FSDP2 too).
    ``seqcls``: an untied sequence classifier with gradient checkpointing, so DDP looks for no unused
    parameter (an LM head held but never used would fail it); one label per sample, counted over both ranks."""
    if "sft" in flags:
        pytest.importorskip("trl", reason="TRL is not installed (it is in the dev extra)")
    one = losses([sys.executable, WORKER, placement, "single", *flags], tmp_path / "one")
    assert len(one) == 4 and one[-1] < one[0]
    for mode in ("ddp", "fsdp2"):
        two = losses([*TORCHRUN, "--standalone", "--nproc_per_node", "2", WORKER, placement, mode, *flags],
                     tmp_path / mode)
        assert two == pytest.approx(one, rel=1e-5), mode
