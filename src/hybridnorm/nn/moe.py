"""Dropless Mixture-of-Experts SwiGLU FFN (OLMoE-style).

For N tokens x (N, d), E experts, top-k routing and per-expert hidden size h:

    router:   z = x W_r^T                        (N, E), computed in fp32
              p = softmax(z)                     (N, E)
    top-k:    (g, e) = topk(p, k)                (N, k) gate weights and expert ids
              g <- g / sum_j g_j                 only if cfg.normalize_topk (OLMoE does not)
    expert:   FFN_e(x) = (silu(x W_in[e][:, :h]) * (x W_in[e][:, h:])) W_out[e]
    output:   y_n = sum_j g_nj * FFN_{e_nj}(x_n)

Dispatch is dropless: every one of the N*k (token, expert) assignments is computed, there is no capacity
factor and no token is dropped or padded. The assignments are sorted by expert id so each expert's tokens
form one contiguous slice of a (N*k, d) buffer; the experts then run as one grouped GEMM
(``F.grouped_mm`` with per-expert offsets) or, where that kernel is unavailable, a loop over the E experts
(never over tokens) on those slices. The results are scattered back to (token, slot) order and summed with
the gate weights.

Auxiliary losses (unweighted; the model multiplies by cfg.lb_loss_weight / cfg.z_loss_weight):

    lb_loss = E * sum_i f_i * P_i     f_i = (#top-k assignments to expert i) / (N k)   (no gradient)
                                      P_i = mean_n p_ni                                (differentiable)
    z_loss  = mean_n logsumexp(z_n)^2

lb_loss is 1 under perfectly balanced routing and grows up to E when one expert takes everything (Switch /
OLMoE). z_loss keeps router logits small so the fp32 softmax stays well conditioned (ST-MoE). Both are
:func:`router_losses`; with a padding mask (the HF wrapper's batches) the means run over real tokens only.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor, nn

_HAS_GROUPED_MM = hasattr(F, "grouped_mm")


def _grouped_mm_ok(a: Tensor, w: Tensor) -> bool:
    """Whether F.grouped_mm can run (N, K) x (E, K, M) here, forward and backward."""
    if not _HAS_GROUPED_MM or a.dtype != w.dtype:
        return False
    # The kernel requires every row stride to be a multiple of 16 bytes (also on CPU).
    if any((s * a.element_size()) % 16 for s in (a.shape[-1], w.shape[-1])):
        return False
    if torch.compiler.is_compiling() and a.dtype != torch.bfloat16:  # the compiler's shape rule takes bf16 only
        return False
    if a.device.type == "cpu":
        return a.dtype in (torch.float32, torch.bfloat16, torch.float16)
    if a.device.type == "cuda":  # documented for bf16 on SM >= 80
        return a.dtype == torch.bfloat16 and torch.cuda.get_device_capability(a.device) >= (8, 0)
    return False


def router_losses(logits: Tensor, probs: Tensor, top_e: Tensor, weight: Tensor | None = None) -> dict[str, Tensor]:
    """One layer's unweighted aux losses (module docstring) from its router logits (N, E) fp32, their softmax
    ``probs`` (N, E) and the experts each token chose, ``top_e`` (N, k). ``weight`` (N,) counts token n
    weight[n] times in every mean (a padding mask: 1 for a real token, 0 for padding); None counts each
    token once (training, where every token is real), with the same numbers as a mask of ones up to rounding."""
    n_tok, n_exp = probs.shape
    k = top_e.shape[-1]
    flat_e = top_e.reshape(-1)  # (N*k,)
    z_sq = torch.logsumexp(logits, dim=-1).square()  # (N,)
    if weight is None:
        counts = probs.new_zeros(n_exp).index_add_(0, flat_e, probs.new_ones(flat_e.shape))  # (E,)
        frac, mean_p, z = counts / (n_tok * k), probs.mean(dim=0), z_sq.mean()  # f_i, P_i
    else:  # the same sums, each token weighted (no boolean indexing: no host sync, no graph break)
        w = weight.reshape(-1).to(probs.dtype)  # (N,)
        total = w.sum().clamp(min=1.0)  # a batch of padding alone adds nothing, not 0/0
        counts = probs.new_zeros(n_exp).index_add_(0, flat_e, w.repeat_interleave(k))  # (E,) weighted
        frac, mean_p, z = counts / (total * k), (probs * w[:, None]).sum(dim=0) / total, (z_sq * w).sum() / total
    return {"lb_loss": n_exp * (frac * mean_p).sum(), "z_loss": z}


def mean_router_losses(per_layer: list[dict[str, Tensor]], cfg) -> dict[str, Tensor]:  # cfg: a MoEConfig
    """The layers' :func:`router_losses` averaged, and ``aux_loss``, their sum weighted by
    ``cfg.lb_loss_weight`` / ``cfg.z_loss_weight``: what the LM loss adds."""
    lb = torch.stack([a["lb_loss"] for a in per_layer]).mean()
    z = torch.stack([a["z_loss"] for a in per_layer]).mean()
    return {"lb_loss": lb, "z_loss": z, "aux_loss": cfg.lb_loss_weight * lb + cfg.z_loss_weight * z}


def recorded_router_losses(router_logits: list[Tensor], cfg, weight: Tensor | None = None) -> dict[str, Tensor]:
    """:func:`mean_router_losses` from each layer's recorded router logits (N, E) fp32 (``MoEFFN.record``), with
    the softmax and top-k that routed the tokens taken again, each token counted ``weight[n]`` times (a padding
    mask (N,); None: every token once). Recomputed from the logits rather than handing the mask to the layers:
    under activation checkpointing a layer reruns in backward, after the mask is gone, and must save what its
    first run saved. The softmax and top-k again are (N, E): small beside the experts."""
    per_layer = []
    for logits in router_logits:
        probs = logits.softmax(dim=-1)
        per_layer.append(router_losses(logits, probs, probs.topk(cfg.top_k, dim=-1).indices, weight))
    return mean_router_losses(per_layer, cfg)


class Router(nn.Linear):
    """The router's linear layer z = x W_rᵀ, computed in fp32 whatever the weight's dtype (a model loaded in
    bf16): bf16 logits would flip near-tied top-k choices and blur the softmax that both the gate weights and
    the aux losses depend on. The same parameter and state-dict name as the ``nn.Linear`` it refines."""

    def forward(self, x: Tensor) -> Tensor:
        return F.linear(x.float(), self.weight.float())  # (N, E) fp32


class MoEFFN(nn.Module):
    """Top-k routed SwiGLU experts; forward takes (B, T, d) or (N, d) and returns the same shape.

    After each forward: ``aux_losses`` = {"lb_loss", "z_loss"} (scalars with graph, unweighted) and
    ``expert_counts`` (E,) int64 = assignments per expert (detached, for diagnostics).
    """

    # "auto": grouped_mm where it works, else the per-expert loop; "grouped_mm" / "loop" force a path.
    dispatch: str = "auto"

    def __init__(self, d_model: int, hidden: int, cfg) -> None:  # cfg: a hybridnorm.config.MoEConfig
        super().__init__()
        cfg.validate()
        self.cfg = cfg
        self.d_model, self.hidden = d_model, hidden
        n_exp = cfg.num_experts
        self.router = Router(d_model, n_exp, bias=False)  # weight (E, d)
        self.w_in = nn.Parameter(torch.empty(n_exp, d_model, 2 * hidden))  # fused [gate | up] per expert
        self.w_out = nn.Parameter(torch.empty(n_exp, hidden, d_model))
        # Placeholder init; the model's init scheme overwrites all three.
        for w in (self.router.weight, self.w_in, self.w_out):
            nn.init.normal_(w, std=0.02)
        self.aux_losses: dict[str, Tensor] = {}
        self.record: list[Tensor] | None = None  # a list: each forward appends its router logits (N, E) fp32
        self.expert_counts: Tensor = torch.zeros(n_exp, dtype=torch.long)

    def _expert_mm(self, a: Tensor, w: Tensor, counts: Tensor, offs: Tensor) -> Tensor:
        """(M, K) rows grouped by expert (contiguous, sizes ``counts``) times w (E, K, O) -> (M, O)."""
        use_grouped = self.dispatch == "grouped_mm" or (self.dispatch == "auto" and _grouped_mm_ok(a, w))
        if use_grouped:
            return F.grouped_mm(a, w, offs=offs)
        # Loop over experts, not tokens: E matmuls on contiguous slices (empty slices are fine). unbind, not
        # w[e]: its backward stacks the E grads once instead of materializing E full-size zero tensors.
        chunks = a.split(counts.tolist())
        return torch.cat([chunk @ w_e for chunk, w_e in zip(chunks, w.unbind(0), strict=True)])

    def forward(self, x: Tensor) -> Tensor:
        shape = x.shape
        x = x.reshape(-1, self.d_model)  # (N, d)
        n_tok, n_exp, k = x.shape[0], self.cfg.num_experts, self.cfg.top_k
        dev = x.device.type

        # Called as a module, not F.linear on its weight, so that what wraps it (hooks, PEFT's LoRA) takes
        # part; with autocast off, so that a wrapper's own linears are not cast to bf16 either.
        with torch.autocast(device_type=dev, enabled=False):
            logits = self.router(x.float()).float()  # (N, E)
        probs = logits.softmax(dim=-1)  # (N, E)
        top_w, top_e = probs.topk(k, dim=-1)  # (N, k), (N, k)
        if self.cfg.normalize_topk:
            top_w = top_w / top_w.sum(dim=-1, keepdim=True)

        # Sort the N*k assignments by expert so each expert's tokens are one contiguous slice.
        flat_e = top_e.reshape(-1)  # (N*k,)
        order = flat_e.argsort(stable=True)  # (N*k,) sorted position -> flat assignment
        # counted into a fixed (E,) buffer, not bincount: its data-dependent output size reads a max back to the
        # host (a sync per layer on CUDA, a graph break under torch.compile)
        counts = flat_e.new_zeros(n_exp).index_add_(0, flat_e, torch.ones_like(flat_e))  # (E,)
        offs = counts.cumsum(0).to(torch.int32)  # (E,) end of each expert's slice

        # Expert matmuls in the autocast dtype; grouped_mm is not on autocast's op lists, so cast by hand.
        cdt = torch.get_autocast_dtype(dev) if torch.is_autocast_enabled(dev) else x.dtype
        x_sorted = x[order // k].to(cdt)  # (N*k, d) token of each sorted assignment
        gate_up = self._expert_mm(x_sorted, self.w_in.to(cdt), counts, offs)  # (N*k, 2h)
        gate, up = gate_up.chunk(2, dim=-1)  # (N*k, h) each
        y_sorted = self._expert_mm(F.silu(gate) * up, self.w_out.to(cdt), counts, offs)  # (N*k, d)

        # Scatter back to (token, slot) order; index_copy_ is deterministic (no atomic adds), then the
        # k expert outputs of each token are summed with their gate weights in fp32.
        y = torch.empty_like(y_sorted).index_copy_(0, order, y_sorted).view(n_tok, k, self.d_model)
        out = (y * top_w.unsqueeze(-1)).sum(dim=1).to(cdt)  # (N, d)

        if self.record is not None:  # the HF wrapper's output_router_logits (and its padding-aware losses)
            self.record.append(logits)
        self.aux_losses = router_losses(logits, probs, top_e)
        self.expert_counts = counts.detach()
        return out.view(shape)
