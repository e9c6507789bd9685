"""``TrainConfig.attention`` / ``nn.attention.attention_backend``: the SDPA kernel tried first. On the CPU torch
runs its flash kernel wherever it can (a priority changes nothing there), so what can be seen here is
``math`` (the plain composite only: the kernel the fused ones are checked against) against ``auto``, eager and
in a compiled block, with the same loss and gradients; and that the trainer holds the preference while it
compiles, trains and validates, and lets it go after. On a GPU: which kernel the preference makes torch call
for the 550M presets' attention, and that cuDNN's fused attention gives the math kernel's output."""

from __future__ import annotations

import pytest
import torch
from torch.nn.attention import SDPBackend

from hybridnorm import ModelConfig, TransformerLM, lm_loss
from hybridnorm.nn.attention import SDPA, attention_backend, set_attention_backend
from hybridnorm.nn.regional import compile_blocks

FLASH_CPU = "aten::_scaled_dot_product_flash_attention_for_cpu"


def _tiny(seed: int = 0) -> TransformerLM:
    torch.manual_seed(seed)
    return TransformerLM(ModelConfig(vocab_size=64, d_model=32, n_layers=2, n_heads=4, n_kv_heads=2,
                                     ffn_hidden_size=64, max_seq_len=32, placement="hybridnorm_star"))


def _loss_grads_code(model: TransformerLM) -> tuple[torch.Tensor, list[torch.Tensor], str]:
    """Loss and gradients of one step, and the code inductor generated for it ("" when nothing compiled)."""
    from torch._inductor.utils import run_and_get_code

    ids = torch.randint(0, 64, (2, 17), generator=torch.Generator().manual_seed(1))  # (B, T + 1)
    model.zero_grad(set_to_none=True)

    def step() -> torch.Tensor:
        loss = lm_loss(model(ids[:, :-1]), ids[:, 1:])
        loss.backward()
        return loss.detach()
    loss, code = run_and_get_code(step)
    return loss, [p.grad.clone() for p in model.parameters()], "\n".join(code)


def _ops(model: TransformerLM) -> set[str]:
    with torch.profiler.profile() as prof:
        model(torch.zeros(1, 8, dtype=torch.long))
    return {e.name for e in prof.events()}


@pytest.mark.parametrize("compiled", [False, True], ids=["eager", "compiled"])
def test_math_runs_the_plain_kernel_with_the_fused_kernels_loss_and_gradients(compiled, dynamo):
    """``math`` on every SDPA module (as the trainer sets it) calls the plain composite, not torch's flash kernel,
    in eager and in a compiled block (the preference is held inside the forward, so dynamo traces it), with the
    same loss and gradients."""
    fused, plain = _tiny(), _tiny()
    set_attention_backend(plain, "math")
    if compiled:
        compile_blocks(fused)
        compile_blocks(plain)
    loss_auto, grads_auto, code_auto = _loss_grads_code(fused)
    loss_math, grads_math, code_math = _loss_grads_code(plain)
    if compiled:
        assert "flash_attention" in code_auto and code_math and "flash_attention" not in code_math
    else:
        assert FLASH_CPU in _ops(fused) and FLASH_CPU not in _ops(plain)
    torch.testing.assert_close(loss_math, loss_auto, rtol=1e-5, atol=1e-6)
    for a, b in zip(grads_math, grads_auto, strict=True):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-6)


def test_each_preference_is_torchs_priority_order_while_held_and_only_then():
    default = torch._C._get_sdp_priority_order()
    for name, first in (("cudnn", SDPBackend.CUDNN_ATTENTION), ("flash", SDPBackend.FLASH_ATTENTION),
                        ("efficient", SDPBackend.EFFICIENT_ATTENTION)):
        with attention_backend(name):
            assert torch._C._get_sdp_priority_order()[0] == int(first)
            assert torch.backends.cuda.math_sdp_enabled() and torch.backends.cuda.flash_sdp_enabled()  # fallbacks
        assert torch._C._get_sdp_priority_order() == default
    with attention_backend("math"):
        assert not torch.backends.cuda.flash_sdp_enabled() and torch.backends.cuda.math_sdp_enabled()
    assert torch.backends.cuda.flash_sdp_enabled()
    with attention_backend("auto"):
        assert torch._C._get_sdp_priority_order() == default


@pytest.mark.parametrize("attention", ["cudnn", "math"])
def test_the_trainer_sets_the_preference_on_every_attention_kernel(make_cfg, tmp_path, attention):
    from torch.nn.modules.module import register_module_forward_pre_hook

    from hybridnorm.train.trainer import train

    seen: list[str] = []

    def record(module, args):
        if isinstance(module, SDPA):
            seen.append(module.backend)
    handle = register_module_forward_pre_hook(record)
    try:
        train(make_cfg(tmp_path / "run", "--max_steps=2", "--eval_interval=1", f"--attention={attention}"),
              quiet=True)
    finally:
        handle.remove()
    assert len(seen) > 4 and set(seen) == {attention}  # every call: training steps and validation


def test_an_unknown_backend_is_refused_by_name():
    with pytest.raises(ValueError, match="'fast' is not one of"):
        set_attention_backend(_tiny(), "fast")


@pytest.mark.cuda
def test_on_a_gpu_the_preferred_kernel_for_the_550m_attention_gives_the_math_output():
    """bf16, causal, 16 heads of 96 over 4 KV heads (GQA), as the 550M presets train: which kernel each
    preference makes torch call (printed: cuDNN where it serves these inputs, else the next in line; the MFU
    rows record it too), and that kernel's output and gradients under ``cudnn`` against the math kernel's in
    fp32 on the same bf16 inputs."""
    cfg = ModelConfig.from_preset("550m", placement="hybridnorm_star")
    g = torch.Generator(device="cuda").manual_seed(0)
    shape = (2, cfg.n_heads, 1024, cfg.head_dim)  # (B, H, T, D)
    q = torch.randn(shape, device="cuda", generator=g, dtype=torch.bfloat16, requires_grad=True)
    k, v = (torch.randn(2, cfg.kv_heads, 1024, cfg.head_dim, device="cuda", generator=g,
                        dtype=torch.bfloat16, requires_grad=True) for _ in range(2))
    chosen = {}
    for name in ("auto", "cudnn", "flash"):
        with attention_backend(name):
            chosen[name] = torch._fused_sdp_choice(q, k, v, None, 0.0, True, enable_gqa=True)
    names = {int(b): b.name for b in SDPBackend.__members__.values()}
    print("kernel chosen:", {n: names.get(c, c) for n, c in chosen.items()})  # the sitting's log keeps it
    assert chosen["flash"] == int(SDPBackend.FLASH_ATTENTION)  # FlashAttention-2 serves these shapes
    sdpa = SDPA(fast=False)
    sdpa.backend = "cudnn"
    out = sdpa(q, k, v, causal=True)
    out.float().square().sum().backward()
    grads = [t.grad.clone() for t in (q, k, v)]
    for t in (q, k, v):
        t.grad = None
    sdpa.backend = "math"
    ref = sdpa(*(t.float() for t in (q, k, v)), causal=True)  # fp32 math: the plain twin, on the same inputs
    ref.square().sum().backward()
    torch.testing.assert_close(out.float(), ref, rtol=2e-2, atol=2e-2)
    for got, t in zip(grads, (q, k, v), strict=True):
        torch.testing.assert_close(got.float(), t.grad.float(), rtol=5e-2, atol=5e-2)
