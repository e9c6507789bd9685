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
