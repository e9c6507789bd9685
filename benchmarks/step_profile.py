"""Where a training step's time goes, by kind of work: ``torch.profiler`` over a few steps, grouped.

On a GPU each kernel's time is attributed to the operator that launched it (the profiler links the two) and
that operator's callers; on the CPU each operator's self time is. A time goes to the first category of
:data:`CATEGORIES` whose rule matches, so its order is the precedence: the optimizer and the LM head + loss
are regions of the step (anything they run counts there, the head's matmul separately from the rest of the
loss), then attention, matmuls, norms, inductor's other compiled kernels, copies and casts, and whatever is left:
eager elementwise and reduction work (RoPE, SwiGLU, residual adds, gradient clipping).

The device's idle share (a step's wall time not covered by any kernel) says how much a faster kernel could
not buy: a host-bound step (launch overhead, a host sync) shows as idle time, not as a slow category. The
wall time includes the profiler's own overhead, so it is a little longer than an unprofiled step's.

    from step_profile import profile_steps, to_markdown
    prof = profile_steps(lambda n: step(n), n=3, device=torch.device("cuda"))
    print(to_markdown(prof, "550m hybridnorm_star, AC off, batch 10"))
"""

from __future__ import annotations

import re
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import Any

import torch

HEAD = "LM head matmul"
LOSS = "loss (not matmul)"
UNLINKED = "(kernels no operator launched)"
# (category, pattern on the kernel's or operator's own name, pattern on its own or any caller's name: a region);
# None: not used
CATEGORIES: tuple[tuple[str, str | None, str | None], ...] = (
    ("unattributed", None, re.escape(UNLINKED)),  # e.g. a kernel launched outside any profiled operator
    ("optimizer", r"multi_tensor_apply|adam", r"^Optimizer\."),
    (HEAD, r"gemm|cutlass|nvjet|xmma|cublas|^aten::(mm|addmm|bmm|matmul)$",
     r"CrossEntropyFn|cross_entropy|log_softmax|nll_loss"),
    (LOSS, None, r"CrossEntropyFn|cross_entropy|log_softmax|nll_loss"),
    ("attention", r"flash|fmha|attention|sdpa|mha", r"attention"),
    ("matmul", r"gemm|cutlass|nvjet|xmma|cublas|^aten::(mm|addmm|bmm|baddbmm|matmul|_grouped_mm)$|grouped_mm",
     None),
    # eager norm kernels (and QKVPrep: the per-head Q/K/V norms fused with RoPE), and the compiled kernels
    # whose names show a norm; a compiled norm's backward kernel rarely does, and counts as compiled
    ("norms", r"rms_?norm|layer_?norm|^triton_.*rsqrt", r"RMSNormFn|rms_norm|layer_norm|QKVPrep"),
    ("compiled (inductor)", r"^triton_|^cpp_fused|inductor", r"Torch-Compiled Region|CompiledFunction"),
    ("copy / cast", r"^Memcpy|^Memset|^aten::(copy_|_to_copy|to|clone|contiguous|fill_|zero_)$", None),
    ("other eager", r"", None),
)


def categorize(name: str, callers: Iterable[str] = ()) -> str:
    """The category of a kernel or operator ``name`` launched under ``callers`` (innermost first)."""
    callers = list(callers)
    for category, own, caller in CATEGORIES:
        hit_own = own is not None and re.search(own, name, re.IGNORECASE) is not None
        hit_caller = caller is not None and any(re.search(caller, c, re.IGNORECASE) for c in (name, *callers))
        if category == HEAD:
            if hit_own and hit_caller:  # a matmul inside the loss region
                return category
        elif hit_own or hit_caller:
            return category
    return "other eager"


@dataclass
class Record:
    """One kernel (GPU) or one operator's self time (CPU), in microseconds."""

    name: str
    callers: tuple[str, ...]  # the launching operator first, then its callers outwards
    us: float


@dataclass
class StepProfile:
    """Per-step milliseconds: by category, the busiest kernels/operators, and the device's idle share."""

    device: str
    steps: int
    wall_ms: float  # per step, profiler overhead included
    busy_ms: float  # per step: kernel time (GPU, overlaps merged) or operator self time (CPU)
    categories: dict[str, float] = field(default_factory=dict)
    top: list[dict[str, Any]] = field(default_factory=list)

    @property
    def idle_share(self) -> float:
        return max(0.0, 1.0 - self.busy_ms / self.wall_ms) if self.wall_ms > 0 else 0.0

    def as_dict(self) -> dict[str, Any]:
        return {"device": self.device, "steps": self.steps, "wall_ms": self.wall_ms, "busy_ms": self.busy_ms,
                "idle_share": self.idle_share, "categories": self.categories, "top": self.top}


def _callers(event: Any) -> tuple[str, ...]:
    out, e = [], event
    while e is not None:
        out.append(e.name)
        e = e.cpu_parent
    return tuple(out)


def records(prof: Any, device: torch.device) -> tuple[list[Record], float]:
    """The profile's time records and its busy microseconds (merged kernel intervals on a GPU)."""
    if device.type == "cpu":
        events = prof.events()
        recs = [Record(e.name, _callers(e.cpu_parent), e.self_cpu_time_total)
                for e in events if e.device_type == torch.autograd.DeviceType.CPU and e.self_cpu_time_total > 0]
        # self times of all operators, nested ones included, add up to the time spent in operators: the
        # step's own Python between them is idle time here, as launch overhead is on a GPU
        return recs, sum(r.us for r in recs)
    return device_records(prof.profiler.kineto_results, prof.events())


def device_records(results: Any, function_events: Iterable[Any]) -> tuple[list[Record], float]:
    """Each device kernel (or copy) once, with the operator that launched it and that operator's callers.

    Not ``FunctionEvent.kernels``: torch's profiler (2.11 on the H200) appends a kernel to every front-end
    event whose id equals the kernel's linked correlation id, and runtime calls carry ids from CUPTI's own
    counter, which collide with operator ids; the fused AdamW kernel came out at 9x its launches and the
    categories at 124 % of the kernel time. Here the kernels are ``results``' device activities (one per
    interval and stream), and of the CPU events holding the linked id the launcher is the one whose time
    contains the runtime call that launched the kernel (same CUPTI correlation id). Device-side user
    annotations (spans of a ``record_function`` on the GPU timeline) and synchronizations are not work and
    are left out, of the kernel time and of the busy time."""
    cpu = torch.autograd.DeviceType.CPU
    start = results.trace_start_ns()
    launched_at: dict[int, float] = {}  # CUPTI correlation id -> start of the runtime call, us from trace start
    kernels: dict[tuple, Any] = {}
    for k in results.events():
        if _flag(k, "is_hidden_event"):
            continue
        if k.device_type() == cpu:
            if k.linked_correlation_id() > 0:  # a runtime / driver call, linked to the operator that made it
                launched_at[k.correlation_id()] = (k.start_ns() - start) / 1e3
        elif _is_work(k):
            kernels.setdefault((k.device_index(), k.device_resource_id(), k.start_ns(), k.end_ns(), k.name()), k)
    by_id: dict[int, list[Any]] = {}
    for e in function_events:
        if e.device_type == cpu:
            by_id.setdefault(e.id, []).append(e)
    recs = []
    for k in kernels.values():
        op = _launcher(by_id.get(k.linked_correlation_id(), []), launched_at.get(k.correlation_id()))
        recs.append(Record(k.name(), _callers(op) if op is not None else (UNLINKED,), k.duration_ns() / 1e3))
    return recs, covered((k.start_ns() / 1e3, k.end_ns() / 1e3) for k in kernels.values())


def _launcher(candidates: list[Any], launched_at: float | None) -> Any:
    """Of the CPU events sharing a kernel's linked id, the operator that launched it: the longest one whose
    time contains the launch (a colliding runtime call is short and elsewhere), else the only one."""
    if launched_at is not None:
        around = [e for e in candidates if e.time_range.start <= launched_at <= e.time_range.end]
        if around:
            return max(around, key=lambda e: e.time_range.end - e.time_range.start)
    return candidates[0] if len(candidates) == 1 else None


# the device activities that are work (kineto's "kernel", "gpu_memcpy", "gpu_memset"); a synchronization
# ("cuda_sync": the GPU waiting on an event or the host) or an annotation on the GPU timeline
# ("gpu_user_annotation") spans time without doing any
DEVICE_WORK = re.compile(r"kernel|memcpy|memset", re.IGNORECASE)


def _is_work(event: Any) -> bool:
    kind = getattr(event, "activity_type", None)  # absent in older torch: then annotations are all we can tell
    if kind is not None:
        return DEVICE_WORK.search(str(kind())) is not None
    return not _flag(event, "is_user_annotation")


def _flag(event: Any, name: str) -> bool:
    method = getattr(event, name, None)  # absent in older torch
    return bool(method()) if method is not None else False


def covered(spans: Iterable[tuple[float, float]]) -> float:
    """The length of the union of [start, end) intervals: kernels on concurrent streams count once."""
    total, end = 0.0, float("-inf")
    for s, t in sorted(spans):
        if t > end:
            total += t - max(s, end)
            end = t
    return total


def summarize(recs: list[Record], busy_us: float, wall_s: float, steps: int, device: str,
              top: int = 15) -> StepProfile:
    """Group ``recs`` by :func:`categorize` and by name, per step, in milliseconds."""
    cats: dict[str, float] = {}
    names: dict[str, list[float | str]] = {}
    for r in recs:
        cat = categorize(r.name, r.callers)
        cats[cat] = cats.get(cat, 0.0) + r.us
        entry = names.setdefault(f"{cat}\0{r.name}", [0.0, 0])
        entry[0] += r.us
        entry[1] += 1
    per = 1e3 * steps  # microseconds in all steps -> milliseconds per step
    order = sorted(names.items(), key=lambda kv: -kv[1][0])[:top]
    return StepProfile(device=device, steps=steps, wall_ms=1e3 * wall_s / steps, busy_ms=busy_us / per,
                       categories={c: us / per for c, us in sorted(cats.items(), key=lambda kv: -kv[1])},
                       top=[{"category": k.split("\0")[0], "name": k.split("\0")[1], "ms": v[0] / per,
                             "calls": v[1] / steps} for k, v in order])


def profile_steps(step: Callable[[int], None], n: int, device: torch.device, first: int = 0,
                  top: int = 15) -> StepProfile:
    """Run ``step(first)``, ..., ``step(first + n - 1)`` under the profiler (already warmed up) and group."""
    from torch.profiler import ProfilerActivity, profile

    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device.type == "cuda" else [])
    sync()
    with profile(activities=activities) as prof:
        t0 = time.perf_counter()
        for i in range(n):
            step(first + i)
        sync()
        wall = time.perf_counter() - t0
    recs, busy = records(prof, device)
    return summarize(recs, busy, wall, n, device.type, top)


def to_markdown(p: StepProfile, title: str, rows: int = 15) -> str:
    """A category table and the ``rows`` busiest kernels (GPU) or operators (CPU), per step."""
    unit = "kernels" if p.device == "cuda" else "operators (self time)"
    summed = sum(p.categories.values())
    # kernels on concurrent streams overlap: their summed time then exceeds the time the device was busy
    overlap = f" ({summed:.1f} ms summed over kernels)" if abs(summed - p.busy_ms) > 0.01 * p.busy_ms else ""
    lines = [f"### {title}", "",
             f"{p.steps} profiled steps: {p.wall_ms:.1f} ms wall per step, {p.busy_ms:.1f} ms in {unit}{overlap}, "
             f"idle {p.idle_share:.0%} of the wall time", "",
             "| category | ms / step | share of busy |", "| --- | ---: | ---: |"]
    lines += [f"| {c} | {ms:.2f} | {ms / p.busy_ms:.0%} |" if p.busy_ms else f"| {c} | {ms:.2f} | - |"
              for c, ms in p.categories.items()]
    lines += ["", f"| busiest {unit} | category | ms / step | calls / step |", "| --- | --- | ---: | ---: |"]
    lines += [f"| `{_short(t['name'])}` | {t['category']} | {t['ms']:.2f} | {t['calls']:g} |" for t in p.top[:rows]]
    return "\n".join(lines) + "\n"


def _short(name: str, width: int = 90) -> str:
    name = name.replace("|", "/").replace("`", "'")
    return name if len(name) <= width else name[: width - 3] + "..."
