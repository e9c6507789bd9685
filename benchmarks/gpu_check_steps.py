"""The checks of ``benchmarks/gpu_check.py``, one function each: ``check(ctx) -> (status, summary, details)``.

Each runs what a user runs (the ``hybridnorm`` CLI and ``torchrun`` in subprocesses, transformers' own
``from_pretrained`` / ``generate``) and compares it with an oracle that does not share the path under
test: float64 on the CPU, the uninterrupted run, a full forward per generated token, the planner's
estimate. See gpu_check.py for the command and what it writes.
"""

from __future__ import annotations

import math
import re
import sys
from pathlib import Path
from typing import Any

import torch

import hybridnorm as hn
from hybridnorm.experiments.runs import _metric_records  # the reader the reports use (checks each record)
from hybridnorm.train.config import TrainConfig

PASS, FAIL, SKIP = "pass", "fail", "skip"
Result = tuple[str, str, dict[str, Any]]
CLI = [sys.executable, "-m", "hybridnorm.cli"]
TORCHRUN = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "1"]


def read_metrics(run: Path) -> list[dict[str, Any]]:
    """The training records of a run folder's metrics.jsonl, in order (none if the run wrote no file)."""
    path = run / "metrics.jsonl"
    return [r for r in _metric_records(path) if r["kind"] == "train"] if path.exists() else []


# -- numerics: CPU vs CUDA, fp32 and bf16 --------------------------------------------------------------------

def _train_losses(master: hn.TransformerLM, batches: list, device: str, dtype: torch.dtype, bf16: bool) -> list[float]:
    """20 AdamW steps of a copy of ``master`` on ``device`` in ``dtype`` (bf16 autocast if asked)."""
    cfg = master.config
    model = hn.TransformerLM(cfg).to(dtype)
    model.load_state_dict(master.state_dict())
    model.to(device)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3, betas=(0.9, 0.95), weight_decay=0.1, foreach=False)
    losses = []
    for x, y in batches:
        with torch.autocast(torch.device(device).type, dtype=torch.bfloat16, enabled=bf16):
            loss = model(x.to(device), targets=y.to(device))
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        opt.zero_grad(set_to_none=True)
        losses.append(loss.item())
    return losses


def _jittered(master: hn.TransformerLM, seed: int) -> hn.TransformerLM:
    """A copy of ``master`` whose weights are each moved by up to one fp32 rounding: w·(1 + eps32·u), u in
    [-1, 1). Training it in fp32 shows how far one rounding of every weight carries the losses."""
    g = torch.Generator().manual_seed(seed)
    copy = hn.TransformerLM(master.config).double()
    eps = torch.finfo(torch.float32).eps
    copy.load_state_dict({k: v * (1 + eps * (2 * torch.rand(v.shape, generator=g, dtype=v.dtype) - 1))
                          for k, v in master.state_dict().items()})
    return copy


def numerics(ctx: Any) -> Result:
    """The tiny default-placement model trained 20 steps on identical weights and batches: fp32 on the
    device (TF32 off) against float64 on the CPU, then bf16 autocast against fp32 on the same device.

    fp32 bound: CPU and device fp32 are two roundings of one float64 trajectory that differ by reduction
    order, so the device may be at most 4x as far from float64 as fp32 on the CPU gets, measured as the
    largest distance of the CPU run and of 3 CPU runs from weights jittered by one fp32 rounding (floor:
    8 fp32 epsilons of the loss). bf16 bound: the device's bf16-vs-fp32 gap may be at
    most 4x the CPU's, with a floor of one bf16 epsilon (2^-8) of the loss, which is as close as a bf16
    loss can be expected to come (the CPU keeps this small-head attention in fp32 under autocast, see
    nn/kernels' sdpa_in_fp32, so its own gap can be far below that)."""
    dev = ctx.device
    old = torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = torch.backends.cudnn.allow_tf32 = False
    try:
        torch.manual_seed(0)
        master = hn.TransformerLM(hn.ModelConfig.from_preset("tiny")).double()
        g = torch.Generator().manual_seed(1)
        rows = [torch.randint(0, master.config.vocab_size, (4, 65), generator=g) for _ in range(20)]
        batches = [(r[:, :-1], r[:, 1:]) for r in rows]
        runs = {"cpu_fp64": _train_losses(master, batches, "cpu", torch.float64, False),
                "cpu_fp32": _train_losses(master, batches, "cpu", torch.float32, False),
                "dev_fp32": _train_losses(master, batches, dev, torch.float32, False),
                "cpu_bf16": _train_losses(master, batches, "cpu", torch.float32, True),
                "dev_bf16": _train_losses(master, batches, dev, torch.float32, True),
                **{f"cpu_fp32_jitter{k}": _train_losses(_jittered(master, k), batches, "cpu", torch.float32, False)
                   for k in range(3)}}
    finally:
        torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32 = old

    def gap(a: str, b: str) -> float:
        return max(abs(x - y) for x, y in zip(runs[a], runs[b], strict=True))

    scale = sum(runs["cpu_fp64"]) / len(runs["cpu_fp64"])
    # fp32's own noise: the CPU's distance from float64, and that of 3 CPU runs from weights jittered by
    # one fp32 rounding (the spread a different reduction order could reach)
    fp32_noise = max(gap(k, "cpu_fp64") for k in runs if k.startswith("cpu_fp32"))
    fp32_bound = 4 * max(fp32_noise, 8 * torch.finfo(torch.float32).eps * scale)
    bf16_bound = 4 * max(gap("cpu_bf16", "cpu_fp32"), 2.0**-8 * scale)
    finite = all(math.isfinite(x) for r in runs.values() for x in r)
    learned = runs["dev_bf16"][-1] < runs["dev_bf16"][0] and runs["dev_fp32"][-1] < runs["dev_fp32"][0]
    d = {"losses": runs, "fp32": {"device_vs_fp64": gap("dev_fp32", "cpu_fp64"),
                                  "cpu_vs_fp64": gap("cpu_fp32", "cpu_fp64"), "cpu_noise": fp32_noise,
                                  "bound": fp32_bound},
         "bf16": {"device_vs_fp32": gap("dev_bf16", "dev_fp32"), "cpu_vs_fp32": gap("cpu_bf16", "cpu_fp32"),
                  "bound": bf16_bound}}
    ok = finite and learned and d["fp32"]["device_vs_fp64"] <= fp32_bound and d["bf16"]["device_vs_fp32"] <= bf16_bound
    summary = (f"fp32 max|Δloss| vs fp64 {d['fp32']['device_vs_fp64']:.2e} (CPU {fp32_noise:.2e}, "
               f"bound {fp32_bound:.2e}); bf16 vs fp32 {d['bf16']['device_vs_fp32']:.2e} "
               f"(CPU {d['bf16']['cpu_vs_fp32']:.2e}, bound {bf16_bound:.2e}); 20 steps"
               + ("" if learned else "; loss did not fall") + ("" if finite else "; non-finite loss"))
    return (PASS if ok else FAIL), summary, d


# -- the CUDA tests ------------------------------------------------------------------------------------------

# the files holding ``cuda``-marked tests: collecting all of tests/ imports modules (datasets, lm_eval) the
# GPU image lacks, and one import error fails the whole pytest run
CUDA_TEST_FILES = ("tests/nn/test_cuda_parity.py", "tests/nn/test_float8.py", "tests/train/test_host_sync.py",
                   "tests/test_step_profile.py", "tests/test_cli_environment.py", "tests/hf/test_hf_sampling.py",
                   "tests/eval/test_eval_auto_batch.py", "tests/eval/test_eval_batched_generation.py",
                   "tests/nn/test_attention_backend.py", "tests/train/test_checkpoint_schema.py")


def cuda_tests(ctx: Any) -> Result:
    """``pytest -m cuda``: every test marked as needing a GPU (they skip without one)."""
    rc, out = ctx.sh([sys.executable, "-m", "pytest", "-m", "cuda", "-p", "no:cacheprovider", *CUDA_TEST_FILES],
                     "cuda_tests", limit=300)
    counts = {k: int(n) for n, k in re.findall(r"(\d+) (passed|failed|skipped|error|errors|deselected)", out)}
    gpu = ctx.device.startswith("cuda")
    ok = rc == 0 and (counts.get("passed", 0) > 0 or not gpu)
    summary = ", ".join(f"{n} {k}" for k, n in counts.items()) or f"exit {rc}"
    return (PASS if ok else FAIL), summary + ("" if gpu else " (no GPU: they skip)"), {"rc": rc, "counts": counts}


# -- the README's GPU command at reduced steps ---------------------------------------------------------------

def head_loss(device: str) -> str:
    """The LM head + loss the trainer runs under --compile=true on ``device`` (TrainConfig.head_loss=auto), as
    gpu_mfu's and the planner's ``loss`` name it: "compiled" on CUDA, else the eager fused kernel, "fast"."""
    return "compiled" if TrainConfig(compile=True).compiles_head_loss(torch.device(device).type) else "fast"


def expected_graphs(size: str, placement: str, device: str) -> int:
    """Block structures of a model: regional compile makes one graph for each (HybridNorm*: 2), and one more
    for the LM head + loss where the trainer compiles it (:func:`head_loss`)."""
    mc = hn.ModelConfig.from_preset(size, placement=placement)
    return len(set(mc.resolved_placement().blocks(mc.n_layers))) + int(head_loss(device) == "compiled")


def train_run(ctx: Any, placement: str, ac: bool) -> Result:
    """``hybridnorm train`` as the README's "1 GPU" line writes it (bf16, compile), fewer steps and
    micro-batches: finite losses, one compiled graph per block structure, no graph break, no recompile after
    the first step; peak memory recorded."""
    s = ctx.settings
    run = ctx.work / f"train_{placement}_ac_{'on' if ac else 'off'}"
    cmd = [*CLI, "train", "--size", s.size, "--placement", placement, "--precision=bf16", "--compile=true",
           f"--activation_checkpointing={'true' if ac else 'false'}", f"--batch_size={s.batch}",
           f"--grad_accum={s.grad_accum}", f"--seq_len={s.seq}", f"--max_steps={s.train_steps}", "--log_interval=1",
           f"--device={ctx.device}", "--out", str(run)]
    rc, _ = ctx.sh(cmd, run.name, limit=300)
    rows = read_metrics(run)
    ctx.runs[(placement, ac)] = run if rc == 0 else None
    d: dict[str, Any] = {"command": " ".join(cmd[2:]), "rc": rc, "losses": [r["loss"] for r in rows]}
    if rc != 0 or len(rows) != s.train_steps:
        return FAIL, f"exit {rc}, {len(rows)} of {s.train_steps} steps logged", d
    first, last = rows[0], rows[-1]
    want = expected_graphs(s.size, placement, ctx.device)
    d.update(graphs=last["compile/graphs"], frames=last["compile/frames"], graph_breaks=last["compile/graph_breaks"],
             recompiles_after_step_1=last["compile/frames"] - first["compile/frames"], expected_graphs=want,
             tokens_per_s=last["tokens_per_s"], peak_mem_gib=last.get("peak_mem_gib"))
    problems = [p for p, bad in (("non-finite loss", not all(math.isfinite(x) for x in d["losses"])),
                                 (f"{d['graphs']} graphs, expected {want}", d["graphs"] != want),
                                 (f"{d['graph_breaks']} graph breaks", d["graph_breaks"]),
                                 (f"{d['recompiles_after_step_1']} recompiles", d["recompiles_after_step_1"])) if bad]
    mem = f", peak {d['peak_mem_gib']:.1f} GiB" if d["peak_mem_gib"] is not None else ""
    summary = (f"loss {d['losses'][0]:.3f} → {d['losses'][-1]:.3f}; {d['graphs']} graphs, {d['graph_breaks']} breaks, "
               f"{d['recompiles_after_step_1']} recompiles; {d['tokens_per_s']:,.0f} tok/s{mem}")
    return (FAIL if problems else PASS), summary + ("; " + "; ".join(problems) if problems else ""), d


# -- FSDP2 on one rank: nccl, the bf16 mixed-precision policy, a sharded save, an exact resume ---------------

def fsdp_resume(ctx: Any) -> Result:
    """torchrun, one rank, ``--parallel=fsdp --precision=bf16``: 6 steps straight, against 3 steps, a stop
    (a sharded checkpoint), and a resume to 6. The resumed losses must equal the straight run's bitwise;
    where they do not, a repeat of the straight run tells GPU run-to-run noise from a resume bug."""
    s = ctx.settings
    common = ["train", "--size", "tiny", "--parallel=fsdp", "--precision=bf16", f"--device={ctx.device}",
              f"--seq_len={s.fsdp_seq}", f"--batch_size={s.batch}", "--max_steps=6", "--ckpt_interval=3",
              "--log_interval=1"]
    runs = {k: ctx.work / f"fsdp_{k}" for k in ("straight", "resumed", "repeat")}

    def torchrun(run: str, name: str, *extra: str) -> int:
        return ctx.sh([*TORCHRUN, "-m", "hybridnorm.cli", *common, *extra, "--out", str(runs[run])], name)[0]

    rc = [torchrun("straight", "fsdp_straight"), torchrun("resumed", "fsdp_stop", "--stop_after_steps=3"),
          torchrun("resumed", "fsdp_resume", "--resume")]
    ckpt = runs["resumed"] / "checkpoints" / "step_000003"
    sharded = sorted(p.name for p in ckpt.glob("*-r*.safetensors")) if ckpt.is_dir() else []
    resumed = read_metrics(runs["resumed"])
    a, b = [r["loss"] for r in read_metrics(runs["straight"])], [r["loss"] for r in resumed]
    d: dict[str, Any] = {"rc": rc, "sharded_files": sharded, "straight": a, "resumed": b}
    if any(rc) or len(a) != 6 or [r["step"] for r in resumed] != list(range(1, 7)):
        return FAIL, f"exits {rc}; {len(a)} straight and {len(b)} resumed steps logged", d
    if not sharded:
        return FAIL, f"no sharded files (*-rNNNNN.safetensors) in {ckpt}", d
    if a == b:
        return PASS, f"resumed steps 4-6 equal the straight run bitwise; sharded save: {', '.join(sharded)}", d
    rc.append(torchrun("repeat", "fsdp_repeat"))
    c = [r["loss"] for r in read_metrics(runs["repeat"])]
    d.update(repeat=c, resume_gap=max(abs(x - y) for x, y in zip(a, b, strict=False)),
             noise=max((abs(x - y) for x, y in zip(a, c, strict=False)), default=float("nan")))
    same_start = a[3] == b[3]  # the first resumed step's forward sees exactly the saved weights
    ok = same_start and len(c) == 6 and d["resume_gap"] <= d["noise"]
    return ((PASS if ok else FAIL), f"resumed step 4 {'equals' if same_start else 'DIFFERS from'} the straight run; "
            f"later steps differ by {d['resume_gap']:.2e}, two straight runs by {d['noise']:.2e} (GPU run-to-run)", d)


# -- export and generate of the GPU run ----------------------------------------------------------------------

def generate_export(ctx: Any) -> Result:
    """``hybridnorm generate`` and ``hybridnorm export`` of the first training run; the exported folder
    loaded by ``AutoModelForCausalLM.from_pretrained`` on the device (fp32, TF32 off): its logits against
    hybridnorm's own model on the CPU, and its greedy ``generate()`` against a full forward per token."""
    run = next((r for r in ctx.runs.values() if r is not None), None)
    if run is None:
        return SKIP, "no training run finished", {}
    rc_g, text = ctx.sh([*CLI, "generate", str(run), "--prompt", "In the beginning", "--max-new-tokens", "16",
                         "--temperature", "0"], "generate")
    hf_dir = ctx.work / "hf_export"
    rc_e, _ = ctx.sh([*CLI, "export", str(run), "--to", "hf", str(hf_dir)], "export")
    d: dict[str, Any] = {"run": run.name, "generate_rc": rc_g, "export_rc": rc_e, "generated": text.strip()[-300:]}
    if rc_g or rc_e:
        return FAIL, f"generate exit {rc_g}, export exit {rc_e}", d
    import transformers

    import hybridnorm.hf  # noqa: F401  (registers the model class with the Auto* factories; no remote code)
    from hybridnorm.loading import load_run

    old = torch.backends.cuda.matmul.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = False
    try:
        model = transformers.AutoModelForCausalLM.from_pretrained(hf_dir, dtype=torch.float32).to(ctx.device).eval()
        tok = transformers.AutoTokenizer.from_pretrained(hf_dir)
        ids = tok("In the beginning God created", return_tensors="pt").input_ids
        ours = load_run(str(run)).model.float().eval()
        with torch.no_grad():
            ref = ours(ids).double()
            got = model(ids.to(ctx.device)).logits.double().cpu()
            out = model.generate(ids.to(ctx.device), max_new_tokens=16, do_sample=False,
                                 pad_token_id=tok.eos_token_id)[0].cpu()
            n_new = len(out) - ids.shape[1]  # fewer than 16 where it chose end-of-text: so must the oracle
            seq, compared, tie = ids.to(ctx.device), 0, False
            for _ in range(n_new):
                logits = model(seq).logits[0, -1].double()
                top2 = logits.topk(2).values
                if tie := (top2[0] - top2[1]).item() < 1e-4 * top2.abs().max().item():
                    break  # a tie: either token is right, and the rest would follow a different prefix
                nxt = logits.argmax()
                if out[seq.shape[1]].item() != nxt.item():
                    break
                seq, compared = torch.cat([seq, nxt.view(1, 1)], dim=1), compared + 1
    finally:
        torch.backends.cuda.matmul.allow_tf32 = old
    rel = ((got - ref).abs().max() / ref.abs().max()).item()
    d.update(logits_rel_diff=rel, greedy_tokens_checked=compared, stopped_at_a_tie=tie)
    # 1e-4: fp32 through a few dozen layers differs by reduction order alone, orders of magnitude below it
    ok = rel <= 1e-4 and n_new > 0 and (compared == n_new or tie)
    return ((PASS if ok else FAIL), f"HF logits on {ctx.device} vs ours on CPU: rel diff {rel:.1e}; greedy generate() "
            f"= full forward for {compared}/{n_new} tokens" + (" (then a tie)" if tie else ""), d)
