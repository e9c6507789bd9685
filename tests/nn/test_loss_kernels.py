"""The loss kernels against their plain twins: the chunked cross-entropy of given logits
(``kernels.CrossEntropyFn``, behind ``lm_loss``) against ``F.cross_entropy`` (``lm_loss(..., fast=False)``),
and the LM head fused with the loss (``kernels.linear_cross_entropy``) against its plain twin,
``lm_loss(F.linear(hidden, weight), targets, fast=False)``, and ``TransformerLM.forward(..., targets=...)``
against ``lm_loss`` of the same model's logits.

Tolerances: the fused kernel computes the same logits row by row (one matmul per chunk of rows instead of
one for all rows) and sums d weight over the chunks in fp32 instead of inside one matmul, so fp64 agrees to
~1e-15 and fp32 to a few ulps; in bf16 the logits and d logits are rounded to bf16 in both, and d weight is
summed once in bf16 (twin) or per chunk in fp32 (kernel): 1e-2 relative. A wrong sign, a missing 1/count
or an ignored row that is scored changes results by O(1e-1).
"""

from __future__ import annotations

import oracle  # tests/oracle.py: randomize_ (tests/ is on sys.path via its conftest)
import pytest
import torch
import torch.nn.functional as F
from torch.autograd import gradcheck

import hybridnorm as hn
from hybridnorm.nn import kernels
from hybridnorm.nn.model import lm_loss

F64 = torch.float64
TOL = {torch.float64: 1e-13, torch.float32: 2e-6, torch.bfloat16: 1e-2}


def _randn(*shape: int, seed: int = 0, scale: float = 1.0) -> torch.Tensor:
    return torch.randn(*shape, dtype=F64, generator=torch.Generator().manual_seed(seed)) * scale


def _targets(n: int, vocab: int, seed: int = 7) -> torch.Tensor:
    t = torch.randint(0, vocab, (n,), generator=torch.Generator().manual_seed(seed))
    t[1::4] = -100  # every fourth row is not scored
    return t


def _rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a.double() - b.double()).abs().max() / b.double().abs().max().clamp_min(1e-30)).item()


def _loss_and_grads(fn, hidden: torch.Tensor, weight: torch.Tensor, scale: float = 0.7):
    h, w = hidden.detach().clone().requires_grad_(True), weight.detach().clone().requires_grad_(True)
    loss = fn(h, w)
    (loss * scale).backward()  # an upstream gradient other than 1 (e.g. 1 / grad_accum)
    return loss.detach(), h.grad, w.grad


def _plain(targets: torch.Tensor):
    return lambda h, w: lm_loss(F.linear(h, w)[None], targets[None], fast=False)


# -- the cross-entropy of given logits (``kernels.CrossEntropyFn``, what ``lm_loss`` runs) -----------------

def test_gradcheck_cross_entropy(monkeypatch):
    t = _targets(10, 11)
    assert gradcheck(lambda x: kernels.CrossEntropyFn.apply(x, t, -100), (_randn(10, 11).requires_grad_(),))
    monkeypatch.setattr(kernels.loss, "CE_CHUNK_ELEMENTS", 33)  # rows spread over several chunks (3 rows each)
    assert gradcheck(lambda x: kernels.CrossEntropyFn.apply(x, t, -100), (_randn(10, 11, seed=1).requires_grad_(),))


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32, torch.bfloat16])
def test_lm_loss_fast_matches_plain_and_leaves_logits_alone(dtype, monkeypatch):
    monkeypatch.setattr(kernels.loss, "CE_CHUNK_ELEMENTS", 5 * 40)  # 5 rows per chunk: the chunk loop runs
    logits = _randn(3, 8, 40, scale=3.0).to(dtype)
    targets = _targets(24, 40).view(3, 8)
    before = logits.detach().clone()

    def loss_and_grad(fast: bool) -> tuple[torch.Tensor, torch.Tensor]:
        x = logits.detach().clone().requires_grad_(True)
        loss = lm_loss(x, targets, fast=fast)
        (loss * 0.7).backward()  # an upstream gradient other than 1
        return loss.detach(), x.grad

    (out_f, g_f), (out_p, g_p) = loss_and_grad(True), loss_and_grad(False)
    wide = torch.promote_types(dtype, torch.float32)
    assert out_f.dtype == out_p.dtype == wide and g_f.dtype == g_p.dtype == dtype
    tol = {torch.float64: 1e-14, torch.float32: 1e-6, torch.bfloat16: 1e-2}[dtype]
    assert _rel_err(out_f, out_p) <= tol and _rel_err(g_f, g_p) <= tol, (_rel_err(out_f, out_p), _rel_err(g_f, g_p))
    assert torch.equal(logits, before)
    assert g_f.view(24, 40)[1::4].abs().max() == 0  # ignored rows get no gradient
    with torch.no_grad():
        assert _rel_err(lm_loss(logits, targets), out_p) <= tol
    none = torch.full_like(targets, -100)  # nothing to score: NaN, as the plain twin gives
    assert lm_loss(logits, none).isnan() and lm_loss(logits, none, fast=False).isnan()


# -- the LM head fused with the loss ----------------------------------------------------------------------

def test_gradcheck_linear_cross_entropy(monkeypatch):
    t = _targets(10, 11)
    h, w = _randn(10, 5).requires_grad_(), _randn(11, 5, seed=1).requires_grad_()
    assert gradcheck(lambda h, w: kernels.LinearCrossEntropyFn.apply(h, w, t, -100), (h, w))
    monkeypatch.setattr(kernels.loss, "CE_CHUNK_ELEMENTS", 33)  # 3 rows per chunk: the loop runs 4 times
    assert gradcheck(lambda h, w: kernels.LinearCrossEntropyFn.apply(h, w, t, -100), (h, w))
    # one input frozen: only the other's gradient is computed, and it is still right
    assert gradcheck(lambda h: kernels.LinearCrossEntropyFn.apply(h, w.detach(), t, -100), (h,))
    assert gradcheck(lambda w: kernels.LinearCrossEntropyFn.apply(h.detach(), w, t, -100), (w,))


def test_chunks_are_cache_sized_on_the_cpu_and_large_on_a_gpu():
    """A 10 x 4096 micro-batch at the 550M presets' 100k vocabulary: ~20-row chunks suit a CPU's caches; on a
    GPU each chunk costs kernel launches and a pass over the (V, d) head weight and its fp32 gradient, so
    it takes thousands of rows per chunk (nn/kernels/loss.py)."""
    rows, vocab = 10 * 4096, 100_352
    cpu = kernels.loss._ce_chunks(rows, vocab, torch.device("cpu"))
    gpu = kernels.loss._ce_chunks(rows, vocab, torch.device("cuda"))
    assert cpu.step == 20 and len(gpu) <= 16 and gpu.step >= 2048
    assert list(gpu)[-1] + gpu.step >= rows  # every row is in a chunk


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32, torch.bfloat16])
def test_linear_cross_entropy_matches_plain_twin(dtype, monkeypatch):
    monkeypatch.setattr(kernels.loss, "CE_CHUNK_ELEMENTS", 7 * 40)  # 7 rows per chunk, the last one short
    hidden, weight, targets = _randn(45, 16).to(dtype), _randn(40, 16, seed=1, scale=0.5).to(dtype), _targets(45, 40)
    fast = _loss_and_grads(lambda h, w: kernels.linear_cross_entropy(h, w, targets), hidden, weight)
    plain = _loss_and_grads(_plain(targets), hidden, weight)
    wide = torch.promote_types(dtype, torch.float32)
    assert fast[0].dtype == plain[0].dtype == wide
    assert fast[1].dtype == fast[2].dtype == dtype
    for what, a, b in zip(("loss", "d hidden", "d weight"), fast, plain, strict=True):
        assert _rel_err(a, b) <= TOL[dtype], (what, _rel_err(a, b))
    assert fast[1][1::4].abs().max() == 0  # rows not scored get no gradient
    with torch.no_grad():
        assert _rel_err(kernels.linear_cross_entropy(hidden, weight, targets), plain[0]) <= TOL[dtype]


def test_linear_cross_entropy_under_autocast_matches_plain_twin():
    """fp32 master weights under bf16 autocast: both cast to bf16 as F.linear's autocast would, the
    gradients come back in fp32 through the casts."""
    hidden, weight, targets = _randn(64, 32).float(), _randn(50, 32, seed=1, scale=0.3).float(), _targets(64, 50)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        fast = _loss_and_grads(lambda h, w: kernels.linear_cross_entropy(h, w, targets), hidden, weight)
        plain = _loss_and_grads(_plain(targets), hidden, weight)
    assert fast[1].dtype == fast[2].dtype == torch.float32
    for what, a, b in zip(("loss", "d hidden", "d weight"), fast, plain, strict=True):
        assert _rel_err(a, b) <= TOL[torch.bfloat16], (what, _rel_err(a, b))
    fp32 = kernels.linear_cross_entropy(hidden, weight, targets)  # and autocast really changed the numbers
    assert 0 < abs(fp32 - fast[0]).item() < 1e-2


def test_linear_cross_entropy_edge_cases():
    hidden, weight = _randn(6, 4), _randn(9, 4, seed=1)
    none = torch.full((6,), -100)
    assert kernels.linear_cross_entropy(hidden, weight, none).isnan()  # nothing scored: NaN like the twin
    assert _plain(none)(hidden, weight).isnan()
    with pytest.raises(TypeError, match="float32"):
        kernels.linear_cross_entropy(hidden, weight.float(), _targets(6, 9))


# -- TransformerLM.forward(..., targets=...) ----------------------------------------------------------------

def _model(tie: bool, fast: bool = True) -> hn.TransformerLM:
    cfg = hn.ModelConfig.from_preset("tiny", placement="hybridnorm_star", n_layers=2, tie_embeddings=tie,
                                     fast_kernels=fast)
    return oracle.randomize_(hn.TransformerLM(cfg))


def _grads(model: hn.TransformerLM, loss: torch.Tensor) -> dict[str, torch.Tensor]:
    model.zero_grad()
    loss.backward()
    return {n: p.grad.clone() for n, p in model.named_parameters()}


@pytest.mark.parametrize("tie", [True, False], ids=["tied", "untied"])
@pytest.mark.parametrize("bf16", [False, True], ids=["fp32", "bf16"])
def test_model_loss_with_targets_matches_lm_loss_of_logits(tie, bf16, monkeypatch):
    monkeypatch.setattr(kernels.loss, "CE_CHUNK_ELEMENTS", 5 * 256)  # several chunks at the tiny vocab
    model = _model(tie)
    ids = torch.randint(0, model.config.vocab_size, (3, 17), generator=torch.Generator().manual_seed(0))
    x, y = ids[:, :-1], ids[:, 1:].clone()
    y[0, :4] = -100
    calls = []
    real = kernels.linear_cross_entropy
    monkeypatch.setattr(kernels, "linear_cross_entropy", lambda *a: calls.append(1) or real(*a))
    with torch.autocast("cpu", dtype=torch.bfloat16, enabled=bf16):
        fused = model(x, targets=y)
        g_fused = _grads(model, fused)
        plain = lm_loss(model(x), y, fast=False)
        g_plain = _grads(model, plain)
    assert calls, "the fused head + loss was not used"
    tol = TOL[torch.bfloat16] if bf16 else 1e-5
    assert fused.dtype == torch.float32 and _rel_err(fused, plain) <= tol
    assert g_fused.keys() == g_plain.keys()
    for name in g_plain:
        assert _rel_err(g_fused[name], g_plain[name]) <= (3e-2 if bf16 else 1e-4), name


def test_model_loss_takes_the_plain_line_without_fast_kernels_or_with_head_hooks(monkeypatch):
    def refuse(*a):
        raise AssertionError("fused kernel used")

    monkeypatch.setattr(kernels, "linear_cross_entropy", refuse)
    ids = torch.randint(0, 256, (2, 9), generator=torch.Generator().manual_seed(1))
    plain_model = _model(tie=False, fast=False)
    expected = lm_loss(plain_model(ids[:, :-1]), ids[:, 1:], fast=False)
    assert torch.equal(plain_model(ids[:, :-1], targets=ids[:, 1:]), expected)

    model = _model(tie=False)
    seen = []
    model.lm_head.register_forward_hook(lambda m, args, out: seen.append(out.shape))
    loss, aux = model(ids[:, :-1], targets=ids[:, 1:], return_aux=True)
    assert seen == [(2, 8, model.config.embedding_size)] and aux == {}  # the hook saw the logits
    assert _rel_err(loss, lm_loss(model(ids[:, :-1]), ids[:, 1:], fast=False)) <= 1e-6


class _Adapted(torch.nn.Module):
    """What PEFT's LoRA or a quantized layer makes of a linear: ``.weight`` still names the frozen base
    weight, while the forward adds what that weight alone does not hold."""

    def __init__(self, base: torch.nn.Linear) -> None:
        super().__init__()
        self.base_layer = base
        self.delta = torch.nn.Linear(base.in_features, base.out_features, bias=False)

    @property
    def weight(self) -> torch.Tensor:
        return self.base_layer.weight

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.base_layer(x) + self.delta(x)


def test_a_wrapped_untied_head_is_called_as_a_module_by_the_loss(monkeypatch):
    """The fused head + loss reads ``lm_head.weight``: for a head that is no plain ``nn.Linear`` that would
    score the base weight alone and silently drop the wrapper's part, so the loss goes through the module."""
    def refuse(*a):
        raise AssertionError("fused kernel used")

    ids = torch.randint(0, 256, (2, 9), generator=torch.Generator().manual_seed(2))
    model = _model(tie=False)
    with torch.no_grad():
        base_only = model(ids[:, :-1], targets=ids[:, 1:])
    model.lm_head = _Adapted(model.lm_head)
    monkeypatch.setattr(kernels, "linear_cross_entropy", refuse)
    loss = model(ids[:, :-1], targets=ids[:, 1:])
    assert _rel_err(loss, lm_loss(model(ids[:, :-1]), ids[:, 1:], fast=False)) <= 1e-6
    assert (loss - base_only).abs() > 1e-3  # the wrapper's part is in the loss
