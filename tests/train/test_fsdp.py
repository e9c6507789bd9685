"""FSDP2 (``--parallel=fsdp``) on 2 CPU processes (gloo) and checkpoints that reshard.

One spawn of 2 processes runs every multi-process training of this module in turn (a process pair costs far
more to start than a tiny run costs to train); the tests then read what each run left. Each job is compared
with one process training the same global batch (batch 4 = 2 ranks x 2).

Tolerance: fp32 throughout, so the only difference from one process is the order of the sums — each rank
averages the loss of its half batch and the reduce-scatter averages the two halves' gradients, and the
gradient norm is a sum over each rank's shard of squares, then over ranks. That moves results by fp32
rounding (~1e-7 relative per operation); six AdamW steps amplify it, not to 1e-5. So losses, gradient norms
and validation losses must agree within rel 1e-5, weights within rtol 1e-4 / atol 1e-6 (the DDP test's
bounds). Where the very same computation is repeated (a resume of the same 2-rank run) they must agree
bitwise.
"""

from __future__ import annotations

import json
import os
import pickle
import shutil
from pathlib import Path

import pytest
import torch
from checkpoint_helpers import flip_byte, rewrite
from safetensors.torch import load_file, save
from train_helpers import rank_env, read_metrics, spawn_ranks, tiny_overrides

from hybridnorm.train.checkpoint import (
    CheckpointError,
    check_checkpoint,
    latest_checkpoint,
    list_checkpoints,
    load_weights,
)
from hybridnorm.train.checkpoint.retention import checkpoint_for_resume
from hybridnorm.train.config import TrainConfig, apply_overrides

STEPS = 6
COMMON = (f"--max_steps={STEPS}", "--ckpt_interval=3", "--grad_accum=2")  # accum: no_sync on micro-batch 1
MOE = ("--model.moe={num_experts: 8, top_k: 2}", "--model.ffn_hidden_size=32", "--model.tie_embeddings=false")
FSDP = ("--parallel=fsdp", "--batch_size=2")


def _jobs(corpus: Path, cache: Path, root: Path) -> dict[str, tuple[list[str], bool]]:
    """Each 2-process run, in order: its label -> (overrides, resume). The run folder is the label's first word."""
    def job(label: str, *extra: str, resume: bool = False) -> tuple[str, tuple[list[str], bool]]:
        out = root / label.split()[0]
        return label, ([*tiny_overrides(corpus, cache, out), *COMMON, *FSDP, *extra], resume)

    return dict([job("fsdp"),                                         # 6 steps straight: sharded at 3 and 6
                 job("fsdp_resumed first", "--stop_after_steps=3", "--keep_last=1"),
                 job("fsdp_resumed", "--keep_last=1", resume=True),   # 2 ranks -> 2 ranks, exact
                 job("from_single", resume=True),                     # 1 process -> 2 ranks
                 job("moe", *MOE),
                 job("moe_ddp", *MOE, "--parallel=ddp"),
                 job("hsdp", "--parallel_replicate=2", "--stop_after_steps=3"),  # 2 replicas x 1 shard
                 # last: the only job that compiles (dynamo's counters are per process). Inductor's real code
                 # for the blocks and the LM head + loss, on FSDP's sharded model, with checkpointing
                 job("compiled", "--compile=true", "--head_loss=compiled", "--activation_checkpointing=true")])


def _worker(rank: int, world: int, port: int, jobs: list, report_dir: str) -> None:
    rank_env(rank, world, port)
    from torch.distributed.fsdp._fully_shard import _fsdp_param_group as group

    import hybridnorm.train.trainer as trainer

    trainer.measured_peak_flops = lambda *a, **k: 1e12  # skip the slow matmul benchmark
    reduces, reduce = [0], group.foreach_reduce

    def counted(*a, **k):  # FSDP's gradient reduce-scatter of one unit
        reduces[0] += 1
        return reduce(*a, **k)

    group.foreach_reduce = counted
    try:
        for i, (overrides, resume) in enumerate(jobs):
            reduces[0] = 0
            result = trainer.train(TrainConfig.from_dict(apply_overrides({}, overrides)), resume=resume, quiet=True)
            report = {"step": result.step, "train_loss": result.train_loss, "val_loss": result.val_loss,
                      "reduce_scatters": reduces[0]}
            Path(report_dir, f"job{i}.rank{rank}.json").write_text(json.dumps(report), encoding="utf-8")
    finally:
        if torch.distributed.is_initialized():
            torch.distributed.destroy_process_group()


def _spawn(jobs: list, report_dir: Path, timeout_s: float = 600) -> list[list[dict]]:
    """Run ``jobs`` in 2 gloo processes; each job's per-rank results. A deadlock fails instead of hanging."""
    report_dir.mkdir(parents=True, exist_ok=True)
    spawn_ranks(_worker, 2, (jobs, str(report_dir)), timeout_s, "FSDP runs")
    return [[json.loads((report_dir / f"job{i}.rank{r}.json").read_text(encoding="utf-8")) for r in range(2)]
            for i in range(len(jobs))]


@pytest.fixture(scope="module")
def runs(corpus: Path, cache_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> dict:
    """Every run of the module: one-process references, the 2-process jobs, and the 2 -> 1 resumes."""
    from hybridnorm.train import trainer

    root = tmp_path_factory.mktemp("fsdp")
    for var in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE"):
        os.environ.pop(var, None)

    def single(name: str, *extra: str, resume: bool = False):
        cfg = TrainConfig.from_dict(apply_overrides({}, [*tiny_overrides(corpus, cache_dir, root / name), *COMMON,
                                                         "--batch_size=4", *extra]))
        return trainer.train(cfg, resume=resume, quiet=True)

    with pytest.MonkeyPatch.context() as mpatch:
        mpatch.setattr(trainer, "measured_peak_flops", lambda *a, **k: 1e12)
        out = {"single": single("single")}
        # the MoE jobs' micro-batches (batch 2) in one process: 2 ranks x 2 micro-batches = 4 micro-batches here
        single("moe_single", *MOE, "--batch_size=2", "--grad_accum=4")
        single("from_single", "--stop_after_steps=3")  # resumed by the 2-process job of that name
        jobs = _jobs(corpus, cache_dir, root)
        out["jobs"] = dict(zip(jobs, _spawn(list(jobs.values()), root / "reports"), strict=True))
        # 2 ranks -> 1 process: the sharded step-3 checkpoints of the straight and the HSDP run, resumed alone;
        # a half-written sharded save (a kill -9) left beside one of them must not matter
        for src, dst in (("fsdp", "to_single"), ("hsdp", "hsdp_to_single")):
            shutil.copytree(root / src, root / dst, ignore=shutil.ignore_patterns("step_000006"))
        (stale := root / "to_single" / "checkpoints" / ".tmp_step_000006_sharded").mkdir()
        (stale / "model-r00000.safetensors").write_bytes(b"half")
        out["to_single"] = single("to_single", resume=True)
        out["hsdp_to_single"] = single("hsdp_to_single", resume=True)
    out["root"] = root
    return out


def _close(a: list[dict], b: list[dict], keys: tuple[str, ...] = ("loss", "grad_norm")) -> None:
    assert [r["step"] for r in a] == [r["step"] for r in b]
    for key in keys:
        assert [r[key] for r in a] == pytest.approx([r[key] for r in b], rel=1e-5), key


def _after(records: list[dict], step: int) -> list[dict]:
    return [r for r in records if r["step"] > step]


def test_two_fsdp_ranks_match_one_process(runs):
    root = runs["root"]
    r0, r1 = runs["jobs"]["fsdp"]
    assert r0 == r1 and r0["step"] == STEPS  # loss and val loss are all-reduced: every rank reports the same
    # grad_accum=2 but one reduce-scatter per FSDP unit (2 blocks + the root) and step: none on micro-batch 1
    assert r0["reduce_scatters"] == STEPS * 3
    assert r0["val_loss"] == pytest.approx(runs["single"].val_loss, rel=1e-5)
    fsdp, single = read_metrics(root / "fsdp"), read_metrics(root / "single")
    _close(fsdp, single)
    assert [r["lr"] for r in fsdp] == [r["lr"] for r in single]
    assert [r["tokens"] for r in fsdp] == [r["tokens"] for r in single]
    assert len({r["loss"] for r in fsdp}) == STEPS  # it trained

    ckpt = root / "fsdp" / "checkpoints" / f"step_{STEPS:06d}"
    assert sorted(p.name for p in ckpt.iterdir()) == [
        "config.yaml", "manifest.json", "model-r00000.safetensors", "model-r00001.safetensors",
        "optimizer-r00000.safetensors", "optimizer-r00001.safetensors", "rng.safetensors", "state.json",
        "tokenizer.json"]
    assert (ckpt / "config.yaml").read_bytes() == (root / "fsdp" / "config.yaml").read_bytes()
    sharded = TrainConfig.load(ckpt / "config.yaml").model.build()
    load_weights(ckpt, sharded)  # 2 ranks' pieces assembled into one process's model
    whole = TrainConfig.load(root / "single" / "config.yaml").model.build()
    load_weights(root / "single" / "checkpoints" / f"step_{STEPS:06d}", whole)
    for (k, a), (_, b) in zip(sharded.state_dict().items(), whole.state_dict().items(), strict=True):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-6, msg=k)


def test_compiled_blocks_and_head_loss_under_fsdp_train_like_the_eager_run(runs):
    """--compile=true --head_loss=compiled --activation_checkpointing=true on 2 FSDP ranks: the same losses and
    grad norms as the eager FSDP run (inductor fuses differently: 1e-5), compiled once at step 1 and never
    again (no graph break, the frame count flat across 6 steps and 2 evaluations)."""
    root = runs["root"]
    compiled, eager = read_metrics(root / "compiled"), read_metrics(root / "fsdp")
    _close(compiled, eager)
    counts = {(r["compile/frames"], r["compile/graphs"], r["compile/graph_breaks"]) for r in compiled}
    (_frames, graphs, breaks), = counts  # one value for every step: nothing recompiled after step 1
    assert graphs == 3 and breaks == 0  # HybridNorm*'s two block structures and the head + loss
    assert runs["jobs"]["compiled"][0]["val_loss"] == pytest.approx(runs["jobs"]["fsdp"][0]["val_loss"], rel=1e-5)


def test_fsdp_resume_is_exact_and_prunes_sharded_checkpoints(runs):
    root = runs["root"]
    straight, resumed = read_metrics(root / "fsdp"), read_metrics(root / "fsdp_resumed")
    assert [r["step"] for r in resumed] == list(range(1, STEPS + 1))
    for key in ("loss", "grad_norm", "lr", "tokens"):
        assert [r[key] for r in resumed] == [r[key] for r in straight], key  # bitwise: the same computation
    assert runs["jobs"]["fsdp_resumed"][0]["val_loss"] == runs["jobs"]["fsdp"][0]["val_loss"]
    # keep_last=1 pruned the sharded step 3 once step 6 was written
    assert [p.name for p in list_checkpoints(root / "fsdp_resumed" / "checkpoints")] == [f"step_{STEPS:06d}"]


@pytest.mark.parametrize("run", ["to_single", "from_single"])
def test_a_checkpoint_reshards_between_one_and_two_processes(runs, run):
    """2 ranks -> 1 process and 1 process -> 2 ranks: the next steps are those of one straight process."""
    root = runs["root"]
    resumed = _after(read_metrics(root / run), 3)
    _close(resumed, _after(read_metrics(root / "single"), 3))
    assert [r["lr"] for r in resumed] == [r["lr"] for r in _after(read_metrics(root / "single"), 3)]
    final = runs[run].val_loss if run == "to_single" else runs["jobs"]["from_single"][0]["val_loss"]
    assert final == pytest.approx(runs["single"].val_loss, rel=1e-5)
    last = latest_checkpoint(root / run / "checkpoints")
    assert last.name == f"step_{STEPS:06d}"
    assert (last / "model.safetensors").exists() == (run == "to_single")  # each writes its own layout
    assert not list((root / run / "checkpoints").glob(".tmp_*"))  # the planted half-written save was cleared


def test_tiny_moe_trains_under_fsdp_like_ddp(runs):
    """The load-balancing loss is computed on each micro-batch's own tokens (it is not linear in the batch), in
    DDP and FSDP alike, so neither equals one process on the whole batch in one micro-batch; both equal one
    process that runs the same micro-batches (batch 2) one after another: the step's gradients and the logged
    router losses, each the mean over the step's micro-batches. Before, each process logged its last
    micro-batch's router losses, so one process logged 1 of 4 micro-batches where 2 ranks logged 2 of 4."""
    root = runs["root"]
    moe, ddp = read_metrics(root / "moe"), read_metrics(root / "moe_ddp")
    keys = ("loss", "grad_norm", "aux_loss", "lb_loss", "z_loss")
    _close(moe, ddp, keys)
    _close(moe, read_metrics(root / "moe_single"), keys)
    assert len({r["loss"] for r in moe}) == STEPS
    assert runs["jobs"]["moe"][0]["val_loss"] == pytest.approx(runs["jobs"]["moe_ddp"][0]["val_loss"], rel=1e-5)
    assert (root / "moe" / "checkpoints" / f"step_{STEPS:06d}" / "model-r00001.safetensors").exists()


def test_an_expert_without_tokens_still_has_a_gradient():
    """Why FSDP needs no unused-parameter handling for MoE: the experts of a layer are one (E, d, 2h) weight,
    so an expert no token was routed to gets a zero slice of that gradient, never a missing one; every rank
    then reduce-scatters the same gradients whatever its tokens chose (DDP still finds unused parameters,
    harmlessly). All tokens equal: every position routes to the same top-2 of 8 experts."""
    from hybridnorm.config import ModelConfig
    from hybridnorm.nn.model import lm_loss

    torch.manual_seed(0)
    model = ModelConfig.from_preset("tiny-moe").build()
    ids = torch.full((2, 16), 7)
    lm_loss(model(ids)[:, :-1], ids[:, 1:]).backward()
    for block in model.blocks:
        used = block.ffn.expert_counts > 0
        assert 0 < int(used.sum()) < len(used)  # some experts got no token
        for w in (block.ffn.w_in, block.ffn.w_out):
            assert w.grad is not None and w.grad.shape == w.shape
            assert not w.grad[~used].any() and w.grad[used].abs().sum() > 0


def test_hsdp_replicas_write_one_copy_and_resume_alone(runs):
    """parallel_replicate=2 on 2 ranks: a 2 x 1 mesh (2 replicas of 1 shard), the arithmetic of DDP."""
    root = runs["root"]
    hsdp = read_metrics(root / "hsdp")
    _close(hsdp, read_metrics(root / "single")[:3])
    ckpt = root / "hsdp" / "checkpoints" / "step_000003"
    assert json.loads((ckpt / "state.json").read_text(encoding="utf-8"))["shards"]["ranks"] == [0]
    assert not (ckpt / "model-r00001.safetensors").exists()  # rank 1 holds a copy of rank 0's shard
    _close(_after(read_metrics(root / "hsdp_to_single"), 3), _after(read_metrics(root / "single"), 3))


def test_eval_opens_a_sharded_checkpoint_without_unpickling(runs, monkeypatch):
    """``hybridnorm eval`` (load_run -> open_run -> load_weights) on the 2-rank run scores what the run did."""
    from hybridnorm.loading import evaluate_run, load_run

    def refuse(*a, **k):
        raise AssertionError("a checkpoint was unpickled")

    for name in ("load", "loads", "Unpickler"):
        monkeypatch.setattr(pickle, name, refuse)
    monkeypatch.setattr(torch, "load", refuse)
    run = load_run(runs["root"] / "fsdp")
    assert run.checkpoint.name == f"step_{STEPS:06d}"
    # by default, the windows the trainer validated on: eval_batches 2 global batches of 2 ranks x
    # grad_accum 2 x batch 2 windows; in batches of 4 windows, the same 16
    loss, _ = evaluate_run(run)
    assert loss == pytest.approx(runs["jobs"]["fsdp"][0]["val_loss"], rel=1e-5)
    loss, _ = evaluate_run(run, batch_size=4, max_batches=4)
    assert loss == pytest.approx(runs["jobs"]["fsdp"][0]["val_loss"], rel=1e-5)


def _sharded_copy(runs: dict, tmp_path: Path) -> Path:
    ckpt = tmp_path / "checkpoints" / f"step_{STEPS:06d}"
    shutil.copytree(runs["root"] / "fsdp" / "checkpoints" / f"step_{STEPS:06d}", ckpt)
    return ckpt


def _without(path: Path, drop: str) -> bytes:
    """The bytes of the safetensors file ``path`` with its tensor ``drop`` left out."""
    return save({k: v for k, v in load_file(path).items() if k != drop})


def test_a_sharded_checkpoint_missing_a_piece_or_a_rank_is_refused_by_name(runs, tmp_path):
    ckpt = _sharded_copy(runs, tmp_path)
    check_checkpoint(ckpt)
    good = {n: (ckpt / n).read_bytes() for n in ("model-r00001.safetensors", "manifest.json")}
    pieces = load_file(ckpt / "model-r00001.safetensors")
    embed = next(k for k in pieces if k.startswith("embed.weight@"))  # rank 1's rows of the embedding
    # a piece lost (the manifest rewritten to match, as a buggy writer would): the others no longer tile it
    rewrite(ckpt, "model-r00001.safetensors", _without(ckpt / "model-r00001.safetensors", embed))
    with pytest.raises(CheckpointError, match=r"model-r\*\.safetensors do not cover embed\.weight"):
        check_checkpoint(ckpt)
    # a piece that claims to lie outside its tensor
    for name, data in good.items():
        (ckpt / name).write_bytes(data)
    pieces["embed.weight@200,0"] = pieces.pop(embed)
    rewrite(ckpt, "model-r00001.safetensors", save(pieces))
    with pytest.raises(CheckpointError, match=r"model-r00001\.safetensors is malformed: piece 'embed\.weight@200,0'"):
        check_checkpoint(ckpt)
    # a whole rank gone from the folder and the manifest: state.json still names it
    for name, data in good.items():
        (ckpt / name).write_bytes(data)
    manifest = json.loads((ckpt / "manifest.json").read_text(encoding="utf-8"))
    for name in ("model-r00001.safetensors", "optimizer-r00001.safetensors"):
        (ckpt / name).unlink()
        del manifest[name]
    (ckpt / "manifest.json").write_text(json.dumps(manifest), encoding="utf-8")
    with pytest.raises(CheckpointError, match=r"state\.json is malformed: 'shards\.ranks' is \[0, 1\]"):
        check_checkpoint(ckpt)


def test_resume_sets_a_corrupt_sharded_checkpoint_aside(runs, tmp_path):
    shutil.copytree(runs["root"] / "fsdp" / "checkpoints", tmp_path / "checkpoints")
    flip_byte(tmp_path / "checkpoints" / f"step_{STEPS:06d}" / "optimizer-r00001.safetensors")
    found = checkpoint_for_resume(tmp_path / "checkpoints")
    assert found.path.name == "step_000003"
    assert [m.moved_to for m in found.set_aside] == [tmp_path / "checkpoints" / "corrupt" / f"step_{STEPS:06d}"]
    assert "optimizer-r00001.safetensors is corrupt" in found.set_aside[0].reason


def test_fsdp_options_are_checked(make_cfg, tmp_path):
    from hybridnorm.errors import ConfigError
    from hybridnorm.train.distributed import Dist
    from hybridnorm.train.parallel import shard_model

    with pytest.raises(ConfigError, match="parallel_replicate=2 needs parallel='fsdp'"):
        make_cfg(tmp_path, "--parallel_replicate=2")
    with pytest.raises(ConfigError, match="parallel='zero'"):
        make_cfg(tmp_path, "--parallel=zero")
    cpu, two = torch.device("cpu"), Dist(0, 2)
    cfg = make_cfg(tmp_path, "--parallel=fsdp", "--diagnostics.every=5")
    assert not shard_model(cfg.model.build(), cfg, cpu, Dist())  # a single process ignores --parallel
    with pytest.raises(ConfigError, match=r"diagnostics\.every=5: per-layer diagnostics are not supported"):
        shard_model(cfg.model.build(), cfg, cpu, two)  # refused before any process group is touched
    cfg = make_cfg(tmp_path, "--parallel=fsdp", "--parallel_replicate=3")
    with pytest.raises(ConfigError, match="parallel_replicate=3 does not divide the 2 processes"):
        shard_model(cfg.model.build(), cfg, cpu, two)
