"""Float8 training of the blocks' linears (``nn/kernels/float8.py``), on the CPU, where ``torch._scaled_mm``
runs too: the forward and both gradients against the recipe's equations written out here in float64 on
hand-quantized operands; the operand layouts and shapes CUDA's kernel demands; shapes it cannot take fall
back to ``F.linear`` exactly; the conversion keeps parameters and names; a short training run tracks bf16;
the compiled layer equals the eager one without graph breaks; and the trainer's ``float8`` option."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

import hybridnorm as hn
from hybridnorm.nn.kernels import float8 as f8
from hybridnorm.nn.kernels.float8 import Float8Linear, convert_to_float8, float8_linear
from hybridnorm.nn.moe import Router

E4M3_MAX, E5M2_MAX = 448.0, 57344.0  # the formats' largest finite values (OCP FP8 spec)
# torch < 2.7-ish has no CPU kernel for torch._scaled_mm: the trainer refuses float8 there (tested below)
cpu_scaled_mm = pytest.mark.skipif(not f8._cpu_scaled_mm_runs(), reason="this torch has no CPU torch._scaled_mm")


def recipe_quantized(t: torch.Tensor, dtype: torch.dtype, fmax: float) -> torch.Tensor:
    """The recipe by hand: scale by fmax / max|t| (the correctly rounded fp32 quotient), round to the
    float8 format; returned as the float8 values times the scale, in float64 (= t up to float8 rounding)."""
    scale = torch.tensor(fmax, dtype=torch.float32) / t.detach().abs().max().float().cpu()
    return (t.detach().float().cpu() * scale).clamp(-fmax, fmax).to(dtype).double()


def own_operand(t: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """What the kernel multiplies: its own float8 operand times its own inverse scale, in float64 (CPU)."""
    q, inv = f8.to_float8(t.detach(), dtype)
    return q.double().cpu() * inv.double().cpu()


def _operands(M: int = 64, K: int = 96, N: int = 48, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(M // 16, 16, K, generator=g).requires_grad_()
    w = (torch.randn(N, K, generator=g) / K**0.5).requires_grad_()
    dy = torch.randn(M // 16, 16, N, generator=g)
    return x, w, dy


@pytest.mark.parametrize(("dtype", "fmax"), [(torch.float8_e4m3fn, E4M3_MAX), (torch.float8_e5m2, E5M2_MAX)])
def test_quantization_is_the_recipe(dtype, fmax):
    t = torch.randn(256, 1536, generator=torch.Generator().manual_seed(3)) * 0.02
    q, inv = f8.to_float8(t, dtype)
    ours, recipe = q.double(), recipe_quantized(t, dtype, fmax)
    assert q.dtype == dtype and inv.dtype == torch.float32 and inv.numel() == 1
    assert ours.abs().max().item() == fmax  # the largest element lands on the format's largest value
    # equal, except where t * scale sits on a rounding tie between two float8 values and one fp32 ulp of
    # the scale (its division may round the other way: x / y vs x * (1 / y)) tips it: rare, one step apart
    differ = ours != recipe
    assert differ.sum().item() <= 1e-5 * t.numel()
    mbits = 3 if dtype == torch.float8_e4m3fn else 2
    step = 2.0**-mbits  # one float8 step, relative to the value (normal range)
    assert ((ours - recipe).abs() <= step * torch.maximum(ours.abs(), recipe.abs()))[differ].all()
    # and the inverse scale undoes the scale: q * inv is t up to half a float8 step (or, below the
    # smallest normal, half the smallest subnormal)
    half_subnormal = 0.5 * torch.finfo(dtype).tiny * 2.0**-mbits * inv.double()
    assert ((q.double() * inv.double() - t.double()).abs() <= step / 2 * t.double().abs() + half_subnormal).all()


@cpu_scaled_mm
def test_forward_and_gradients_are_the_three_products_of_the_float8_operands():
    x, w, dy = _operands()
    with torch.autocast("cpu", torch.bfloat16):
        y = float8_linear(x, w)
    assert y.dtype == torch.bfloat16 and y.shape == (4, 16, 48)
    y.backward(dy.to(y.dtype))
    xd, wd = own_operand(x, torch.float8_e4m3fn), own_operand(w, torch.float8_e4m3fn)
    gd = own_operand(dy.to(torch.bfloat16), torch.float8_e5m2)
    y_ref, dx_ref, dw_ref = xd @ wd.T, gd @ wd, (gd.reshape(-1, 48).T @ xd.reshape(-1, 96))
    # forward: fp32 accumulation, rounded once to bf16 (8 significant bits)
    torch.testing.assert_close(y.double(), y_ref, rtol=2**-8, atol=1e-6 * y_ref.abs().max().item())
    # gradients come back in the parameters' / inputs' dtype (fp32 here): only accumulation error
    assert x.grad.dtype == w.grad.dtype == torch.float32
    torch.testing.assert_close(x.grad.double(), dx_ref, rtol=1e-5, atol=1e-5 * dx_ref.abs().max().item())
    torch.testing.assert_close(w.grad.double(), dw_ref, rtol=1e-5, atol=1e-5 * dw_ref.abs().max().item())


@cpu_scaled_mm
def test_it_is_bf16_linear_up_to_float8_rounding():
    x, w, _ = _operands(seed=1)
    with torch.autocast("cpu", torch.bfloat16):
        y8 = float8_linear(x, w)
        y16 = F.linear(x, w)
    err = ((y8.float() - y16.float()).norm() / y16.float().norm()).item()
    # E4M3 keeps 3 mantissa bits (relative rounding up to 2^-4 per operand); a sum of 96 products averages it
    assert 0 < err < 0.05


@cpu_scaled_mm
def test_operands_have_the_layouts_and_shapes_cuda_takes(monkeypatch):
    calls = []
    real = torch._scaled_mm

    def spy(a, b, **kw):
        calls.append((a.dtype, b.dtype, a.shape, b.shape, a.stride(), b.stride(), kw["scale_a"], kw["scale_b"]))
        return real(a, b, **kw)

    monkeypatch.setattr(torch, "_scaled_mm", spy)
    x, w, dy = _operands()
    with torch.autocast("cpu", torch.bfloat16):
        y = float8_linear(x, w)
    y.backward(dy.to(y.dtype))
    assert len(calls) == 3  # forward, dx, dw
    pairs = [(a, b) for a, b, *_ in calls]
    e4, e5 = torch.float8_e4m3fn, torch.float8_e5m2
    assert pairs == [(e4, e4), (e5, e4), (e5, e4)]  # never e5m2 x e5m2 (cuBLAS has no such kernel)
    for _, _, sa, sb, ta, tb, scale_a, scale_b in calls:
        assert ta[1] == 1 and tb[0] == 1, "first operand row-major, second column-major"
        assert sa[1] == sb[0] and all(n % 16 == 0 for n in (*sa, *sb))
        assert scale_a.dtype == scale_b.dtype == torch.float32 and scale_a.numel() == scale_b.numel() == 1


@pytest.mark.parametrize(("lead", "K", "N"), [((2, 5), 64, 32), ((4, 16), 40, 32), ((4, 16), 64, 24)])
def test_shapes_it_cannot_take_are_plain_linear_exactly(lead, K, N):
    x, w = torch.randn(*lead, K), torch.randn(N, K)
    assert not f8.fits(x, w)
    with torch.autocast("cpu", torch.bfloat16):
        assert torch.equal(float8_linear(x, w), F.linear(x, w))


@cpu_scaled_mm
def test_an_all_zero_input_gives_zeros_not_nan():
    x, w = torch.zeros(16, 32, requires_grad=True), torch.randn(16, 32, requires_grad=True)
    with torch.autocast("cpu", torch.bfloat16):
        y = float8_linear(x, w)
    y.backward(torch.ones_like(y))
    assert torch.equal(y, torch.zeros_like(y)) and torch.equal(w.grad, torch.zeros_like(w.grad))
    assert torch.isfinite(x.grad).all()


def test_conversion_swaps_only_the_block_linears_and_keeps_parameters_and_names():
    model = hn.TransformerLM(hn.ModelConfig.from_preset("tiny-moe", placement="hybridnorm_star"))
    before = dict(model.named_parameters())
    state = {k: v.clone() for k, v in model.state_dict().items()}
    swapped = convert_to_float8(model)
    # the MoE FFN keeps its experts (3-D parameters) and router; attention's two linears swap in each block
    assert swapped == [f"blocks.{i}.attn.{n}" for i in range(2) for n in ("w_qkv", "w_o")]
    assert all(type(model.get_submodule(n)) is Float8Linear for n in swapped)
    assert type(model.lm_head) is torch.nn.Linear and type(model.blocks[0].ffn.router) is Router
    after = dict(model.named_parameters())
    assert after.keys() == before.keys() and all(after[k] is before[k] for k in before)
    assert all(torch.equal(v, state[k]) for k, v in model.state_dict().items())
    dense = hn.TransformerLM(hn.ModelConfig.from_preset("tiny", placement="pre"))
    assert len(convert_to_float8(dense)) == 4 * 2


def _rule_batch(g: torch.Generator, rows: int, length: int) -> torch.Tensor:
    """Rows that follow next = (3 * token + 1) mod 256 from a random start: learnable in a few steps."""
    tokens = [torch.randint(0, 256, (rows,), generator=g)]
    for _ in range(length - 1):
        tokens.append((3 * tokens[-1] + 1) % 256)
    return torch.stack(tokens, dim=1)  # (rows, length)


def _train(float8: bool, steps: int = 20) -> list[float]:
    torch.manual_seed(0)
    model = hn.TransformerLM(hn.ModelConfig.from_preset("tiny", placement="hybridnorm_star"))
    if float8:
        convert_to_float8(model)
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
    g = torch.Generator().manual_seed(1)
    losses = []
    for _ in range(steps):  # a fresh batch each step; 4 x 32 tokens (CPU float8 matmuls are emulated: slow)
        data = _rule_batch(g, 4, 33)
        with torch.autocast("cpu", torch.bfloat16):
            loss = model(data[:, :-1], targets=data[:, 1:])
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        losses.append(loss.item())
    return losses


@cpu_scaled_mm
def test_training_in_float8_tracks_bf16():
    bf16, fp8 = _train(False), _train(True)
    assert fp8[0] == pytest.approx(bf16[0], rel=0.01)  # same init, same batch: only rounding differs
    progress = bf16[0] - sum(bf16[-5:]) / 5
    assert progress > 1.0  # the rule is being learned
    # float8 makes at least 90 % of bf16's progress (mean of the last 5 steps' losses)
    assert abs(sum(fp8[-5:]) / 5 - sum(bf16[-5:]) / 5) < 0.1 * progress


@cpu_scaled_mm
def test_compiled_float8_layer_equals_eager_without_graph_breaks():
    from torch._dynamo.utils import counters

    torch._dynamo.reset()
    counters.clear()
    layer = Float8Linear(64, 48, bias=False)
    x, _, dy = _operands(K=64)

    def run(fn):
        xi = x.detach().clone().requires_grad_()
        layer.weight.grad = None
        with torch.autocast("cpu", torch.bfloat16):
            y = fn(xi)
        y.backward(dy.to(y.dtype))
        return y.detach(), xi.grad, layer.weight.grad.clone()

    eager = run(layer)
    compiled = run(torch.compile(layer, fullgraph=True))
    assert sum(counters["graph_break"].values()) == 0
    for e, c in zip(eager, compiled, strict=True):  # the same quantization; fused arithmetic may round apart
        torch.testing.assert_close(c.float(), e.float(), rtol=2**-7, atol=1e-3 * e.float().abs().max().item())


def test_the_option_needs_bf16_and_a_device_with_scaled_mm():
    from hybridnorm.train.config import TrainConfig

    with pytest.raises(hn.ConfigError, match=r"float8=true .* precision='bf16'"):
        TrainConfig.from_cli(overrides=["--float8=true", "--precision=fp32"])
    assert f8.float8_unsupported("fp32", torch.device("cpu")) is not None
    cpu = f8.float8_unsupported("bf16", torch.device("cpu"))
    assert cpu is None if f8._cpu_scaled_mm_runs() else "no CPU kernel for torch._scaled_mm" in cpu
    assert "mps" in f8.float8_unsupported("bf16", torch.device("mps"))


@cpu_scaled_mm
def test_a_float8_training_run_saves_the_plain_model_and_tracks_bf16(make_cfg, tmp_path, capsys):
    from safetensors.torch import load_file
    from train_helpers import read_metrics

    import hybridnorm.train.trainer as trainer

    common = ("--max_steps=3", "--precision=bf16", "--batch_size=4", "--seq_len=32")
    trainer.train(make_cfg(tmp_path / "bf16", *common))
    trainer.train(make_cfg(tmp_path / "fp8", *common, "--float8=true"))
    assert "float8 matmuls in the blocks' linears" in capsys.readouterr().err  # the console log
    bf16, fp8 = (read_metrics(tmp_path / run) for run in ("bf16", "fp8"))
    losses = [(a["loss"], b["loss"]) for a, b in zip(bf16, fp8, strict=True) if "loss" in a]
    assert len(losses) == 3 and all(b == pytest.approx(a, rel=0.02) for a, b in losses)
    files = [load_file(tmp_path / run / "checkpoints" / "step_000003" / "model.safetensors") for run in ("bf16", "fp8")]
    assert files[0].keys() == files[1].keys()  # a float8 run's checkpoint is an ordinary model's
    # precision=auto picks fp32 for this tiny width on a CPU: the trainer says float8 cannot run, and why
    with pytest.raises(hn.ConfigError, match=r"float8=true: it needs precision='bf16'.*trains in fp32"):
        trainer.train(make_cfg(tmp_path / "auto", "--max_steps=1", "--precision=auto", "--float8=true"))


def _cuda_float8_or_skip() -> torch.device:
    device = torch.device("cuda")
    if torch.cuda.get_device_capability(device) < f8.MIN_CAPABILITY:
        pytest.skip(f"{torch.cuda.get_device_name(device)} has no float8 tensor cores")
    return device


@pytest.mark.cuda
def test_on_cuda_the_550m_shapes_are_the_products_of_the_float8_operands():
    """cuBLAS's float8 kernels on the 550M preset's QKV shape against float64 products of the kernel's own
    float8 operands: the forward accumulates with Hopper's fast accumulation, so its bound is two bf16
    steps. The gradients are fp32 out, but Hopper's float8 tensor cores keep ~14 mantissa bits while they
    accumulate (DeepSeek-V3 report, sec. 3.3.2): measured on an H200, dx over 2304 terms 1.75e-4 of its
    largest value, so their bound is 2**-11 (a few of those roundings). A wrong scale or operand layout is
    off by far more (order 1)."""
    device = _cuda_float8_or_skip()
    x, w, dy = _cuda_operands(device)
    y, dx, dw = _run_on(float8_linear, x, w, dy)
    xd, wd = own_operand(x, torch.float8_e4m3fn), own_operand(w, torch.float8_e4m3fn)
    gd = own_operand(dy.to(torch.bfloat16), torch.float8_e5m2)
    refs = {"y": (y, xd @ wd.T, 2**-7), "dx": (dx, gd @ wd, 2**-11),
            "dw": (dw, gd.reshape(-1, 2304).T @ xd.reshape(-1, 1536), 2**-11)}
    for name, (got, ref, bound) in refs.items():
        err = ((got.double().cpu() - ref).abs().max() / ref.abs().max()).item()
        assert err < bound, f"{name}: {err:.2e} of its largest value from the float64 products"


@pytest.mark.cuda
def test_on_cuda_the_compiled_layer_equals_eager():
    """Inductor's lowering (the casts fused, ``_scaled_mm`` as its template or cuBLAS) against eager. The
    scales are computed in generated code, whose fp32 division may round one ulp apart and tip an element
    sitting on a float8 rounding tie to its neighbour: hence a bound of 0.5 % of the largest value, which a
    wrong scale or layout exceeds many times over."""
    device = _cuda_float8_or_skip()
    torch._dynamo.reset()
    x, w, dy = _cuda_operands(device)
    eager = _run_on(float8_linear, x, w, dy)
    compiled = _run_on(torch.compile(float8_linear, fullgraph=True), x, w, dy)
    for name, e, c in zip(("y", "dx", "dw"), eager, compiled, strict=True):
        err = ((c.double() - e.double()).abs().max() / e.double().abs().max()).item()
        assert err < 5e-3, f"{name}: compiled is {err:.2e} of its largest value from eager"


def _cuda_operands(device: torch.device) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    g = torch.Generator(device=device).manual_seed(0)
    x = torch.randn(2, 128, 1536, device=device, generator=g)  # (B, T, d_model)
    w = torch.randn(2304, 1536, device=device, generator=g) / 1536**0.5  # (q + k + v, d_model)
    return x, w, torch.randn(2, 128, 2304, device=device, generator=g)


def _run_on(fn, x: torch.Tensor, w: torch.Tensor, dy: torch.Tensor) -> tuple[torch.Tensor, ...]:
    x, w = x.clone().requires_grad_(), w.clone().requires_grad_()
    with torch.autocast(x.device.type, torch.bfloat16):
        y = fn(x, w)
    y.backward(dy.to(y.dtype))
    return y.detach(), x.grad, w.grad
