"""benchmarks/step_profile.py: the categories a kernel or operator lands in (GPU kernel names as H100
profiles print them, CPU operators with their callers), the union of kernel intervals, and a real CPU profile
of a training step whose categories add up."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import pytest
import torch

SCRIPT = Path(__file__).resolve().parents[1] / "benchmarks" / "step_profile.py"


@pytest.fixture(scope="module")
def sp():
    spec = importlib.util.spec_from_file_location("step_profile", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # its dataclasses look their module up there
    spec.loader.exec_module(module)
    return module


BLOCK = ("aten::linear", "autograd::engine::evaluate_function: MmBackward0")
LOSS = ("aten::mm", "LinearCrossEntropyFn")


@pytest.mark.parametrize(("name", "callers", "category"), [
    # GPU kernels (name) under the operator that launched them and its callers
    ("nvjet_tst_192x192_64x4_2x1_v_bz_coopB_TNN", ("aten::mm", *BLOCK), "matmul"),
    ("sm90_xmma_gemm_bf16bf16_bf16f32_f32_tn_n_tilesize128x256x64_warpgroupsize2x1x1", ("aten::addmm",),
     "matmul"),
    ("nvjet_tst_256x128_64x4_1x2_h_bz_coopA_NTT", LOSS, "LM head matmul"),
    ("void at::native::reduce_kernel<512, 1, at::native::ReduceOp<float, at::native::MaxOps<float>>>",
     ("aten::amax", "LinearCrossEntropyFn"), "loss (not matmul)"),
    ("void pytorch_flash::flash_fwd_kernel<Flash_fwd_kernel_traits<96, 128, 64, 4>, true>",
     ("aten::_flash_attention_forward", "aten::scaled_dot_product_attention"), "attention"),
    ("void pytorch_flash::flash_bwd_dq_dk_dv_loop_seqk_parallel_kernel<...>",
     ("aten::_flash_attention_backward", "ScaledDotProductFlashAttentionBackward0"), "attention"),
    ("triton_per_fused__to_copy_add_mean_mul_pow_rsqrt_0", ("Torch-Compiled Region: 0/0",), "norms"),
    ("triton_poi_fused_mul_silu_1", ("Torch-Compiled Region: 0/0",), "compiled (inductor)"),
    ("void at::native::(anonymous namespace)::multi_tensor_apply_kernel<FusedAdamMathFunctor<float, 4>>",
     ("aten::_fused_adamw_", "Optimizer.step#AdamW.step"), "optimizer"),
    ("Memcpy HtoD (Pinned -> Device)", ("aten::copy_", "aten::to"), "copy / cast"),
    ("void at::native::vectorized_elementwise_kernel<4, at::native::CUDAFunctor_add<float>>", ("aten::add",),
     "other eager"),
    ("(kernels no operator launched)", (), "unattributed"),
    # CPU operators (self time) with their callers
    ("aten::mm", ("aten::matmul", "aten::linear"), "matmul"),
    ("aten::mm", ("aten::matmul", "LinearCrossEntropyFn"), "LM head matmul"),
    ("LinearCrossEntropyFn", (), "loss (not matmul)"),
    ("aten::mul", ("RMSNormFn",), "norms"),
    ("aten::addcmul_", ("QKVPrepBackward", "autograd::engine::evaluate_function: QKVPrepBackward"), "norms"),
    ("aten::add_", ("aten::_foreach_add_", "Optimizer.step#AdamW.step"), "optimizer"),
    ("aten::silu", ("SwiGLUFn",), "other eager"),
])
def test_categories(sp, name, callers, category):
    assert sp.categorize(name, callers) == category


def test_covered_merges_overlapping_intervals(sp):
    assert sp.covered([]) == 0.0
    assert sp.covered([(0, 10), (20, 25)]) == 15  # disjoint
    assert sp.covered([(0, 10), (5, 12), (2, 3)]) == 12  # overlapping and nested
    assert sp.covered([(5, 12), (0, 10), (12, 14)]) == 14  # unsorted, touching


def test_a_cpu_training_step_profile_adds_up(sp):
    import hybridnorm as hn
    from hybridnorm.train.optim import OptimConfig, build_optimizer

    torch.manual_seed(0)
    model = hn.TransformerLM(hn.ModelConfig.from_preset("tiny", placement="hybridnorm_star"))
    opt = build_optimizer(model, OptimConfig(lr=1e-4, warmup_steps=0))
    batch = torch.randint(0, model.config.vocab_size, (2, 33))
    losses: list[int] = []

    def step(n: int) -> None:
        model(batch[:, :-1], targets=batch[:, 1:]).backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        losses.append(n)

    step(0)
    prof = sp.profile_steps(step, 2, torch.device("cpu"), first=1, top=5)
    assert losses == [0, 1, 2]  # the steps it was asked to run, numbered from `first`
    assert prof.steps == 2 and len(prof.top) == 5
    assert sum(prof.categories.values()) == pytest.approx(prof.busy_ms, rel=1e-9)
    assert prof.top == sorted(prof.top, key=lambda t: -t["ms"])
    assert prof.categories["LM head matmul"] > 0 and prof.categories["norms"] > 0
    # calls are per step, not in all: fused AdamW runs once per parameter group and step, in 1 step or in 2
    one = sp.summarize(sp.records(_profile(step), torch.device("cpu"))[0], 1.0, 1.0, 1, "cpu", top=100)
    two = sp.profile_steps(step, 2, torch.device("cpu"), first=4, top=100)
    for p in (one, two):
        assert [t["calls"] for t in p.top if t["name"] == "aten::_fused_adamw_"] == [len(opt.param_groups)]
    md = sp.to_markdown(prof, "tiny")
    assert md.startswith("### tiny\n") and "| norms |" in md


def _profile(step):
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU]) as prof:
        step(9)
    return prof


class _Kineto:
    """A kineto activity as ``prof.profiler.kineto_results.events()`` holds it (times in ns)."""

    def __init__(self, name, start_us, end_us, corr, linked, device=False, annotation=False, kind=None):
        kind = kind or ("gpu_user_annotation" if annotation else "kernel" if device else "cuda_runtime")
        self._v = (name, start_us, end_us, corr, linked, device, annotation, kind)

    def name(self): return self._v[0]
    def start_ns(self): return 10**6 + int(self._v[1] * 1e3)
    def end_ns(self): return 10**6 + int(self._v[2] * 1e3)
    def duration_ns(self): return self.end_ns() - self.start_ns()
    def correlation_id(self): return self._v[3]
    def linked_correlation_id(self): return self._v[4]
    def device_type(self): return torch.autograd.DeviceType.CUDA if self._v[5] else torch.autograd.DeviceType.CPU
    def device_index(self): return 0
    def device_resource_id(self): return 7  # the stream
    def is_user_annotation(self): return self._v[6]
    def is_hidden_event(self): return False
    def activity_type(self): return self._v[7]


class _OldKineto(_Kineto):
    """As an older torch's events: no activity_type, so only the annotation flag tells work apart."""

    def __getattribute__(self, name):
        if name == "activity_type":
            raise AttributeError(name)
        return super().__getattribute__(name)


class _Results:
    def __init__(self, events):
        self._events = events

    def trace_start_ns(self): return 10**6
    def events(self): return self._events


def _op(id_, name, start, end, parent=None):
    from types import SimpleNamespace

    return SimpleNamespace(id=id_, name=name, device_type=torch.autograd.DeviceType.CPU,
                           time_range=SimpleNamespace(start=start, end=end), cpu_parent=parent)


def test_each_device_kernel_counts_once_under_the_operator_that_launched_it(sp):
    """The H200 profile's fault, built by hand: a runtime call whose CUPTI id (2) equals the fused AdamW
    operator's id, so torch's own linking hands AdamW's kernels to it too (they showed up 9x); a kernel
    delivered twice; a device-side annotation over the optimizer's kernels; a kernel no operator launched;
    a synchronization on the GPU timeline (time without work)."""
    step = _op(1, "Optimizer.step#AdamW.step", 0, 100)
    adam = _op(2, "aten::_fused_adamw_", 10, 90, step)
    linear = _op(4, "aten::linear", 190, 270)
    mm = _op(3, "aten::mm", 200, 260, linear)
    collider = _op(2, "cudaStreamIsCapturing", 205, 206, mm)  # a runtime call: CUPTI's counter, not the ops'
    fused = "void at::native::multi_tensor_apply_kernel<FusedOptimizerTensorListMetadata<4>, FusedAdamMathFunctor>"
    gemm = "nvjet_sm90_tst_192x192_64x4_2x1_v_bz_coopB_TNN"
    kineto = [
        _Kineto("cudaLaunchKernel", 20, 21, corr=50, linked=2), _Kineto("cudaLaunchKernel", 30, 31, corr=51, linked=2),
        _Kineto("cudaLaunchKernel", 210, 211, corr=52, linked=3), _Kineto("cudaStreamIsCapturing", 205, 206, 2, 0),
        _Kineto(fused, 300, 340, corr=50, linked=2, device=True), _Kineto(fused, 340, 380, 51, 2, device=True),
        _Kineto(fused, 340, 380, corr=51, linked=2, device=True),  # the same activity delivered twice
        _Kineto("Optimizer.step#AdamW.step", 300, 380, 1, 1, device=True, annotation=True),
        _Kineto(gemm, 400, 500, corr=52, linked=3, device=True),
        _Kineto("void stray_kernel", 600, 610, corr=60, linked=0, device=True),
        _Kineto("Context Sync", 610, 900, corr=61, linked=0, device=True, kind="cuda_sync"),  # waits, no work
    ]
    recs, busy = sp.device_records(_Results(kineto), [collider, step, adam, linear, mm])  # collider first
    old = [_OldKineto(*k._v[:7]) for k in kineto if k._v[7] != "cuda_sync"]  # older torch: no activity types
    assert sorted(sp.device_records(_Results(old), [collider, step, adam, linear, mm])[0], key=repr) == sorted(
        recs, key=repr)
    assert busy == pytest.approx(40 + 40 + 100 + 10)
    assert sum(r.us for r in recs) == pytest.approx(busy)  # one stream: summed kernel time == busy time
    assert sorted((r.name, r.callers[0], r.us) for r in recs) == sorted([
        (fused, "aten::_fused_adamw_", 40), (fused, "aten::_fused_adamw_", 40), (gemm, "aten::mm", 100),
        ("void stray_kernel", sp.UNLINKED, 10)])
    prof = sp.summarize(recs, busy, wall_s=1e-3, steps=1, device="cuda")
    assert prof.categories == pytest.approx({"optimizer": 0.08, "matmul": 0.1, "unattributed": 0.01})
    assert [(t["name"], t["calls"]) for t in prof.top] == [(gemm, 1), (fused, 2), ("void stray_kernel", 1)]
    md = sp.to_markdown(prof, "hand-built", rows=2)
    assert "summed over kernels" not in md and "stray_kernel" not in md  # adds up; 2 rows asked for


def test_concurrent_kernels_show_their_summed_time_beside_the_busy_time(sp):
    a, b = _op(1, "aten::mm", 0, 10), _op(2, "aten::_flash_attention_forward", 0, 10)
    kineto = [_Kineto("cudaLaunchKernel", 1, 2, 50, 1), _Kineto("cudaLaunchKernel", 3, 4, 51, 2),
              _Kineto("gemm_a", 100, 200, 50, 1, device=True), _Kineto("flash_fwd", 150, 250, 51, 2, device=True)]
    recs, busy = sp.device_records(_Results(kineto), [a, b])
    assert busy == pytest.approx(150) and sum(r.us for r in recs) == pytest.approx(200)
    md = sp.to_markdown(sp.summarize(recs, busy, 1e-3, 1, "cuda"), "two streams")
    assert "0.1 ms in kernels (0.2 ms summed over kernels)" in md


def _fused_launches(numels: list[int], max_tensors: int, max_blocks: int, chunk: int = 65536) -> int:
    """Launches of torch's multi_tensor_apply_for_fused_optimizer over tensors of ``numels``: a launch when the
    tensor list or the block list (one block per chunk) is full, and one for the rest (MultiTensorApply.cuh)."""
    launches = blocks = tensors = 0
    for numel in numels:
        tensors += 1
        chunks = -(-numel // chunk)
        for c in range(chunks):
            blocks += 1
            if (tensors == max_tensors and c == chunks - 1) or blocks == max_blocks:
                launches, blocks, tensors = launches + 1, 0, (0 if c == chunks - 1 else 1)
    return launches + (blocks > 0)


@pytest.mark.cuda
def test_on_cuda_the_fused_adamw_kernel_counts_as_many_launches_as_its_chunking_makes(sp):
    """A real profile on the GPU: the fused AdamW kernel's calls per step lie between what its chunking
    makes with CUDA 13's launch limits (252 tensors / 2240 blocks) and older CUDA's (36 / 320), per
    parameter group; and the kernels' summed time is the busy time (one stream)."""
    import hybridnorm as hn
    from hybridnorm.train.optim import OptimConfig, build_optimizer

    torch.manual_seed(0)
    device = torch.device("cuda")
    model = hn.TransformerLM(hn.ModelConfig.from_preset("tiny", placement="hybridnorm_star")).to(device)
    opt = build_optimizer(model, OptimConfig(lr=1e-4, warmup_steps=0), fused=True)
    batch = torch.randint(0, model.config.vocab_size, (2, 33), device=device)

    def step(n: int) -> None:
        model(batch[:, :-1], targets=batch[:, 1:]).backward()
        opt.step()
        opt.zero_grad(set_to_none=True)

    step(0)
    prof = sp.profile_steps(step, 2, device, first=1, top=1000)
    calls = sum(t["calls"] for t in prof.top if "FusedOptimizerTensorListMetadata" in t["name"])
    sizes = [[p.numel() for p in g["params"]] for g in opt.param_groups]
    low = sum(_fused_launches(s, 252, 2240) for s in sizes)
    high = sum(_fused_launches(s, 36, 320) for s in sizes)
    assert low <= calls <= high, (calls, low, high)
    assert sum(prof.categories.values()) == pytest.approx(prof.busy_ms, rel=0.02)
