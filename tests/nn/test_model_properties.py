"""Structural properties every placement must have: every norm is on the forward path, every parameter
learns, attention is causal, and the KV cache reproduces the full forward (dense and MoE)."""

from __future__ import annotations

import oracle  # tests/oracle.py: the float64 reference (tests/ is on sys.path via its conftest)
import pytest
import torch
import torch.nn.functional as F

import hybridnorm as hn
from hybridnorm.nn.norms import DyT, LayerNorm, RMSNorm

PRESETS = hn.placements.names()
NORM_TYPES = (RMSNorm, LayerNorm, DyT)
MOE_PLACEMENTS = ["pre", "hybridnorm", "hybridnorm_star"]


def _model(placement: str, size: str = "tiny", randomize: bool = False, **overrides) -> hn.TransformerLM:
    torch.manual_seed(0)
    cfg = hn.ModelConfig.from_preset(size, placement=placement, **overrides)
    model = hn.TransformerLM(cfg)
    if randomize:
        oracle.randomize_(model, seed=1)
    return model.eval()


def _ids(B: int, T: int, seed: int = 0, vocab: int = 256) -> torch.Tensor:
    return torch.randint(0, vocab, (B, T), generator=torch.Generator().manual_seed(seed))


def _norm_params(model: torch.nn.Module) -> list[tuple[str, torch.nn.Parameter]]:
    out = []
    for mname, m in model.named_modules():
        if isinstance(m, NORM_TYPES):
            for pname, p in m.named_parameters(recurse=False):
                out.append((f"{mname}.{pname}", p))
    return out


# -- every norm parameter is on the forward path -----------------------------------------------------------

@pytest.mark.parametrize("norm", ["rms", "dyt"])
@pytest.mark.parametrize("name", PRESETS)
def test_every_norm_param_changes_logits(name, norm):
    # Randomized weights: at the default init (small weights) attention is nearly uniform and a Q/K gain
    # barely matters. Even so, DyT bounds q and k, so a Q-gain perturbation moves the logits by only
    # ~1e-5; an unused parameter would leave them bitwise unchanged, hence the low threshold.
    model = _model(name, n_layers=3, norm=norm, randomize=True)
    ids = _ids(2, 10)
    params = _norm_params(model)
    n_norm_modules = sum(isinstance(m, NORM_TYPES) for m in model.modules())
    assert n_norm_modules > 0
    assert len(params) == n_norm_modules * (3 if norm == "dyt" else 1)
    g = torch.Generator().manual_seed(5)
    with torch.no_grad():
        base = model(ids)
        for pname, p in params:
            saved = p.detach().clone()
            p.add_(0.5 * torch.randn(p.shape, generator=g) + 0.3)
            changed = (model(ids) - base).abs().max().item()
            p.copy_(saved)
            assert changed > 1e-6, f"{name}/{norm}: perturbing {pname} leaves the logits unchanged"
        assert torch.equal(model(ids), base)


# -- every parameter receives a gradient -------------------------------------------------------------------

def _assert_all_grads(model: hn.TransformerLM, ids: torch.Tensor, extra_loss: bool = False) -> None:
    out = model(ids, return_aux=extra_loss)
    logits, aux = out if extra_loss else (out, None)
    targets = torch.randint(0, model.config.vocab_size, ids.shape, generator=torch.Generator().manual_seed(9))
    loss = F.cross_entropy(logits.flatten(0, 1), targets.flatten())
    if aux is not None:
        loss = loss + aux["aux_loss"]
    loss.backward()
    for pname, p in model.named_parameters():
        assert p.grad is not None, f"{pname} got no gradient"
        assert torch.isfinite(p.grad).all(), f"{pname} has a non-finite gradient"
        assert p.grad.abs().max() > 0, f"{pname} got an all-zero gradient"


@pytest.mark.parametrize("name", PRESETS)
def test_every_param_gets_gradient(name):
    model = _model(name, n_layers=3, tie_embeddings=name in ("pre", "hybridnorm"))
    _assert_all_grads(model.train(), _ids(2, 12))


@pytest.mark.parametrize("name", ["pre", "hybridnorm_star", "span", "QKVC-Post"])
def test_every_param_gets_gradient_untied_layernorm(name):
    model = _model(name, n_layers=3, tie_embeddings=False, norm="layer")
    _assert_all_grads(model.train(), _ids(2, 12))


# -- causality -----------------------------------------------------------------------------------------

def _assert_causal(model: hn.TransformerLM, T: int = 14, tol: float = 0.0) -> None:
    """Changing token t never changes the logits before t (exactly, for tol=0)."""
    ids = _ids(2, T)
    with torch.no_grad():
        base = model(ids)
        for t in (0, 5, T - 1):
            alt = ids.clone()
            alt[:, t] = (alt[:, t] + 17) % model.config.vocab_size
            out = model(alt)
            if tol == 0.0:
                assert torch.equal(out[:, :t], base[:, :t]), f"changing token {t} changed logits before it"
            elif t > 0:
                diff = (out[:, :t] - base[:, :t]).abs().max().item()
                assert diff <= tol, f"changing token {t} changed logits before it by {diff:.3g}"
            moved = (out[:, t] - base[:, t]).abs().max().item()
            assert moved > 1e-3, f"changing token {t} did not change its logits"


@pytest.mark.parametrize("name", PRESETS)
def test_causal(name):
    _assert_causal(_model(name, n_layers=3, randomize=True))


# -- KV cache: generation and incremental logits ------------------------------------------------------------

def _greedy_full(model: hn.TransformerLM, ids: torch.Tensor, n: int) -> torch.Tensor:
    seq = ids
    with torch.no_grad():
        for _ in range(n):
            nxt = model(seq)[:, -1, : model.config.vocab_size].argmax(-1, keepdim=True)
            seq = torch.cat([seq, nxt], dim=1)
    return seq


def _assert_incremental(model: hn.TransformerLM, chunks=(5, 1, 1, 1, 4)) -> None:
    B, T = 2, sum(chunks)
    ids = _ids(B, T, seed=3)
    with torch.no_grad():
        full = model(ids)
        cache = model.new_cache(B)
        parts, pos = [], 0
        for n in chunks:
            parts.append(model(ids[:, pos:pos + n], cache=cache))
            pos += n
        assert cache.pos == T
        inc = torch.cat(parts, dim=1)
    diff = (inc - full).abs().max().item()
    assert diff <= 1e-5, f"incremental logits differ from the full forward by {diff:.3g}"


@pytest.mark.parametrize("name", PRESETS)
def test_generate_matches_greedy_full_forward(name):
    model = _model(name, n_layers=3, randomize=True)
    prompt = _ids(2, 5, seed=4)
    got = model.generate(prompt, 7, temperature=0)
    assert got.shape == (2, 12)
    assert torch.equal(got, _greedy_full(model, prompt, 7))


@pytest.mark.parametrize("name", PRESETS)
def test_incremental_cache_matches_full_forward(name):
    _assert_incremental(_model(name, n_layers=3, randomize=True))


@pytest.mark.parametrize("name", ["hybridnorm", "olmo2"])
@pytest.mark.parametrize("order", ["before_rope", "after_rope"])
def test_incremental_cache_qkv_norm_variants(name, order):
    placement = hn.placements.get(name).replace_blocks(qkv_norm_order=order)
    _assert_incremental(_model(placement, n_layers=2, randomize=True, n_kv_heads=1))


# -- MoE ---------------------------------------------------------------------------------------------------

@pytest.fixture
def moe():
    return pytest.importorskip("hybridnorm.nn.moe")


@pytest.mark.parametrize("name", MOE_PLACEMENTS)
def test_moe_forward_and_aux(moe, name):
    model = _model(name, size="tiny-moe")
    assert model.is_moe
    assert all(isinstance(b.ffn, moe.MoEFFN) for b in model.blocks)
    ids = _ids(2, 12)
    logits, aux = model(ids, return_aux=True)
    assert logits.shape == (2, 12, model.config.embedding_size)
    assert torch.isfinite(logits).all()
    assert {"lb_loss", "z_loss", "aux_loss"} <= set(aux)
    for k in ("lb_loss", "z_loss", "aux_loss"):
        assert aux[k].ndim == 0 and torch.isfinite(aux[k]), k
    c = model.config.moe
    weighted = c.lb_loss_weight * aux["lb_loss"] + c.z_loss_weight * aux["z_loss"]
    assert torch.allclose(aux["aux_loss"], weighted)
    assert 0.0 < aux["lb_loss"].item() <= c.num_experts  # E * sum_i f_i P_i, sum f = sum P = 1
    assert torch.equal(model(ids), logits)


@pytest.mark.parametrize("name", MOE_PLACEMENTS)
def test_moe_every_param_gets_gradient(moe, name):
    model = _model(name, size="tiny-moe").train()
    ids = _ids(4, 16)
    _assert_all_grads(model, ids, extra_loss=True)
    for i, block in enumerate(model.blocks):
        used = block.ffn.expert_counts > 0
        for pname in ("w_in", "w_out"):
            g = getattr(block.ffn, pname).grad
            per_expert = g.flatten(1).abs().amax(1) > 0
            assert torch.equal(per_expert, used), f"block {i} {pname}: grads {per_expert} vs routed {used}"


@pytest.mark.parametrize("name", MOE_PLACEMENTS)
def test_moe_causal(moe, name):
    # Not bitwise: changing a token changes how many rows each expert's matmul gets, and BLAS results
    # for a row depend on the number of rows at round-off level (~1e-6). A real leak would be O(1).
    _assert_causal(_model(name, size="tiny-moe", randomize=True), tol=1e-5)


@pytest.mark.parametrize("name", MOE_PLACEMENTS)
def test_moe_cache(moe, name):
    model = _model(name, size="tiny-moe", randomize=True)
    _assert_incremental(model)
    prompt = _ids(2, 4, seed=6)
    assert torch.equal(model.generate(prompt, 5, temperature=0), _greedy_full(model, prompt, 5))


@torch.no_grad()
def _loop_router_losses(ffn_inputs: list[torch.Tensor], model: hn.TransformerLM, real: list[bool]) -> tuple:
    """Layer means of E·Σ f_i P_i and of logsumexp², by a loop over the real tokens, from each layer's router
    applied by hand to what its FFN received."""
    E, k = model.config.moe.num_experts, model.config.moe.top_k
    lbs, zs = [], []
    for x, block in zip(ffn_inputs, model.blocks, strict=True):
        logits = [x.reshape(-1, x.shape[-1])[n] @ block.ffn.router.weight.T for n in range(len(real)) if real[n]]
        probs = [z.softmax(-1) for z in logits]
        counts = [sum(int(e in p.topk(k).indices.tolist()) for p in probs) for e in range(E)]
        lbs.append(E * sum(counts[e] / (len(probs) * k) * sum(p[e] for p in probs) / len(probs) for e in range(E)))
        zs.append(sum(torch.logsumexp(z, -1) ** 2 for z in logits) / len(logits))
    return sum(lbs) / len(lbs), sum(zs) / len(zs)


@pytest.mark.parametrize("checkpointing", [False, True])
def test_moe_aux_of_a_padded_batch_counts_its_real_tokens(moe, checkpointing):
    """model(ids, attention_mask=..., return_aux=True): the router losses of the real tokens, as the HF class
    computes them. Before, padded positions were routed and counted, so what padding held moved the losses
    the Python API returned (the HF class's differed for the same batch). Gradients still reach the router,
    also through checkpointed blocks."""
    model = _model("hybridnorm_star", size="tiny-moe", randomize=True).train()
    model.activation_checkpointing = checkpointing
    ids, mask = _ids(3, 10, seed=4), torch.ones(3, 10, dtype=torch.long)
    for row, pad in enumerate((4, 0, 7)):
        mask[row, :pad] = 0  # left padding
    inputs: list[torch.Tensor] = []
    hooks = [b.ffn.register_forward_pre_hook(lambda m, a: inputs.append(a[0].detach())) for b in model.blocks]
    _, aux = model(ids, attention_mask=mask, return_aux=True)
    for h in hooks:
        h.remove()
    lb, z = _loop_router_losses(inputs[:len(model.blocks)], model, (mask.reshape(-1) == 1).tolist())
    assert aux["lb_loss"].item() == pytest.approx(float(lb), rel=1e-5)
    assert aux["z_loss"].item() == pytest.approx(float(z), rel=1e-5)
    other = torch.where(mask == 0, (ids + 11) % 256, ids)
    _, aux_other = model(other, attention_mask=mask, return_aux=True)
    assert aux_other["aux_loss"].item() == pytest.approx(aux["aux_loss"].item(), abs=1e-6)
    aux["aux_loss"].backward()
    assert all(b.ffn.router.weight.grad.abs().max() > 0 for b in model.blocks)
    assert all(b.ffn.record is None for b in model.blocks)  # nothing left recording
    _, unpadded = model(ids, return_aux=True)  # without a mask, every token, as the training loop
    assert torch.equal(unpadded["lb_loss"], model.aux_losses()["lb_loss"])
