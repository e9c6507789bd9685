"""The LM loss kernels (see :mod:`hybridnorm.nn.kernels`): cross-entropy without an fp32 log-softmax of every
logit, and the LM head fused with it so that the (N, V) logits never exist at once."""

from __future__ import annotations

import torch
from torch import Tensor

from hybridnorm.nn.kernels.common import acc_dtype, needs_grad

# -- cross-entropy: the LM loss without an fp32 log-softmax of every logit -------------------------------

CE_CHUNK_ELEMENTS = 2**21  # rows per chunk x vocab: one fp32 chunk of 8 MiB stays in cache-friendly sizes
# On a GPU a chunk must be big instead: every chunk launches its own kernels, and the fused head re-reads the
# (V, d) weight and read-modify-writes its fp32 gradient once per chunk. 2^21 at a 100k vocabulary would be
# 20 rows a chunk, ~2,000 chunks per micro-batch and ~2 TB of weight-gradient traffic; 2^28 (1 GiB of fp32
# logits) is ~2,700 rows, 16 chunks for a 10 x 4096 micro-batch.
CE_CHUNK_ELEMENTS_GPU = 2**28


def _ce_rows(targets: Tensor, ignore_index: int, dtype: torch.dtype) -> tuple[Tensor, Tensor, Tensor]:
    """(valid (N,) 0/1 in ``dtype``, targets clamped into range (N, 1), count of valid rows, 0-d ``dtype``)."""
    valid = targets.ne(ignore_index)
    return valid.to(dtype), torch.where(valid, targets, 0)[:, None], valid.sum().to(dtype)


def _ce_chunks(n_rows: int, vocab: int, device: torch.device) -> range:
    """The first row of each chunk of ~CE_CHUNK_ELEMENTS elements of (N, V) logits (CE_CHUNK_ELEMENTS_GPU
    off the CPU); ``.step`` rows each."""
    elements = CE_CHUNK_ELEMENTS if device.type == "cpu" else CE_CHUNK_ELEMENTS_GPU
    return range(0, n_rows, max(1, elements // vocab))


class CrossEntropyFn(torch.autograd.Function):
    """Mean of −log softmax(logits)[target] over the rows whose target is not ``ignore_index``, in fp32 for
    fp32/bf16/fp16 logits (fp64 stays fp64). Plain twin: ``F.cross_entropy`` on the logits in that dtype
    (``hybridnorm.nn.model.lm_loss`` with ``fast=False``).

    Where the twin makes full-size fp32 copies and log-softmaxes, this saves the logits as they are and the
    row logsumexp, and goes through ~8 MiB fp32 chunks of rows: a logsumexp each forward, (softmax − onehot)·w
    each backward, written into the gradient. 1.3-3x faster on CPU (benchmarks/README.md); no host sync."""

    @staticmethod
    def forward(ctx, logits: Tensor, targets: Tensor, ignore_index: int) -> Tensor:  # type: ignore[override]
        loss, lse = cross_entropy_forward(logits, targets, ignore_index)
        ctx.save_for_backward(logits, targets, lse)
        ctx.ignore_index = ignore_index
        return loss

    @staticmethod
    def backward(ctx, grad: Tensor) -> tuple[Tensor, None, None]:  # type: ignore[override]
        logits, targets, lse = ctx.saved_tensors
        acc = lse.dtype
        valid, tgt, count = _ce_rows(targets, ctx.ignore_index, acc)
        weight = valid.mul_(grad.to(acc) / count)  # (N,) d loss / d row: g / count, 0 if ignored
        out = torch.empty_like(logits)
        chunks = _ce_chunks(*logits.shape, logits.device)
        for s in chunks:
            rows = slice(s, s + chunks.step)
            w = weight[rows, None]  # (n, 1)
            p = logits[rows].to(acc, copy=True).sub_(lse[rows, None]).exp_().mul_(w)  # softmax·w, (n, V)
            out[rows] = p.scatter_add_(1, tgt[rows], w.neg())  # − onehot·w
        return out, None, None


def cross_entropy_forward(logits: Tensor, targets: Tensor, ignore_index: int) -> tuple[Tensor, Tensor]:
    """(mean loss, per-row logsumexp (N,) in the compute dtype) of :class:`CrossEntropyFn`; logits (N, V)."""
    acc = acc_dtype(logits)
    valid, tgt, count = _ce_rows(targets, ignore_index, acc)
    lse = torch.empty(logits.shape[0], dtype=acc, device=logits.device)
    chunks = _ce_chunks(*logits.shape, logits.device)
    for s in chunks:
        rows = slice(s, s + chunks.step)
        torch.logsumexp(logits[rows].to(acc), -1, out=lse[rows])
    picked = logits.gather(1, tgt).squeeze(1).to(acc)  # (N,) the target's logit
    return ((lse - picked) * valid).sum() / count, lse


def cross_entropy(logits: Tensor, targets: Tensor, ignore_index: int = -100) -> Tensor:
    """Mean cross-entropy of logits (N, V) against targets (N,) (see :class:`CrossEntropyFn`)."""
    if needs_grad(logits):
        return CrossEntropyFn.apply(logits, targets, ignore_index)
    return cross_entropy_forward(logits, targets, ignore_index)[0]


# -- the LM head fused with the loss --------------------------------------------------------------------------

class LinearCrossEntropyFn(torch.autograd.Function):
    """Mean cross-entropy of the logits ``hidden @ weightᵀ`` (N, V) against targets (N,), rows with
    ``ignore_index`` left out, without ever holding all N × V logits.

    Plain twin: ``lm_loss(F.linear(hidden, weight), targets, fast=False)`` (``TransformerLM.forward`` with
    ``targets`` and ``fast_kernels=False``). Logits in the inputs' dtype (the matmul of the twin), the
    softmax in fp32 (fp64 stays fp64). The forward goes through chunks of rows: logits of the chunk, their
    logsumexp and target logit, and, when gradients are wanted, at once d loss/d logits = (softmax − onehot)
    / count, from which the chunk's rows of d hidden and its term of d weight (accumulated in fp32) follow;
    the backward only scales these by the incoming gradient. Peak memory is one chunk of logits instead of
    the logits, their fp32 copy and their gradient (Liger's and torchtune's fused linear cross-entropy do
    the same on GPUs).
    """

    @staticmethod
    def forward(ctx, hidden: Tensor, weight: Tensor, targets: Tensor,  # type: ignore[override]
                ignore_index: int) -> Tensor:
        need = ctx.needs_input_grad[:2]
        loss, d_hidden, d_weight = linear_cross_entropy_forward(hidden, weight, targets, ignore_index, *need)
        ctx.save_for_backward(d_hidden, d_weight)
        return loss

    @staticmethod
    def backward(ctx, grad: Tensor) -> tuple[Tensor | None, Tensor | None, None, None]:  # type: ignore[override]
        d_hidden, d_weight = ctx.saved_tensors
        return (None if d_hidden is None else d_hidden * grad.to(d_hidden.dtype),
                None if d_weight is None else d_weight * grad.to(d_weight.dtype), None, None)


def linear_cross_entropy_forward(hidden: Tensor, weight: Tensor, targets: Tensor, ignore_index: int,
                                 grad_hidden: bool = False, grad_weight: bool = False
                                 ) -> tuple[Tensor, Tensor | None, Tensor | None]:
    """(mean loss, d loss / d hidden (N, d) if ``grad_hidden``, d loss / d weight (V, d) if ``grad_weight``,
    in the inputs' dtype) of :class:`LinearCrossEntropyFn`; hidden (N, d) and weight (V, d) of one dtype."""
    acc = acc_dtype(hidden)
    valid, tgt, count = _ce_rows(targets, ignore_index, acc)
    row_weight = valid / count  # (N,) d loss / d row loss: 1/count, 0 if ignored
    total = torch.zeros((), dtype=acc, device=hidden.device)
    d_hidden = torch.empty_like(hidden) if grad_hidden else None
    d_weight = torch.zeros(weight.shape, dtype=acc, device=weight.device) if grad_weight else None
    chunks = _ce_chunks(hidden.shape[0], weight.shape[0], hidden.device)
    for s in chunks:
        rows = slice(s, s + chunks.step)
        h = hidden[rows]  # (n, d)
        z = (h @ weight.T).to(acc)  # (n, V) the chunk's logits, fp32 for fp32/bf16 inputs
        picked = z.gather(1, tgt[rows])  # (n, 1) the target's logit
        top = z.amax(-1, keepdim=True)  # (n, 1)
        e = z.sub_(top).exp_()  # (n, V) exp(z − max), in place: one exp per logit for loss and gradient
        sums = e.sum(-1, keepdim=True)  # (n, 1)
        lse = sums.log().add_(top)  # (n, 1) logsumexp, as torch.logsumexp computes it
        total += ((lse - picked).squeeze(1) * valid[rows]).sum()
        if grad_hidden or grad_weight:
            w = row_weight[rows, None]  # (n, 1)
            dz = e.mul_(w / sums).scatter_add_(1, tgt[rows], w.neg()).to(hidden.dtype)  # (softmax − onehot)·w
            if d_hidden is not None:
                torch.mm(dz, weight, out=d_hidden[rows])  # (n, d)
            if d_weight is not None and dz.dtype == acc:
                d_weight.addmm_(dz.T, h)  # (V, d), summed over the chunks in place
            elif d_weight is not None:  # a bf16 chunk: addmm_ cannot mix dtypes, its term is summed in fp32
                d_weight += dz.T @ h
    return total / count, d_hidden, None if d_weight is None else d_weight.to(weight.dtype)


def linear_cross_entropy(hidden: Tensor, weight: Tensor, targets: Tensor, ignore_index: int = -100) -> Tensor:
    """Mean cross-entropy of ``hidden @ weightᵀ`` against ``targets`` (see :class:`LinearCrossEntropyFn`):
    hidden (N, d), weight (V, d), targets (N,). Under autocast both go to the autocast dtype first, as
    ``F.linear`` would take them (autograd differentiates the casts); the Function then runs with autocast
    off, so that nothing inside it is cast again."""
    device = hidden.device.type
    if torch.is_autocast_enabled(device):
        low = torch.get_autocast_dtype(device)
        hidden, weight = hidden.to(low), weight.to(low)
    elif hidden.dtype != weight.dtype:
        raise TypeError(f"hidden is {hidden.dtype} but weight is {weight.dtype}: F.linear would refuse them too")
    with torch.autocast(device, enabled=False):
        if needs_grad(hidden, weight):
            return LinearCrossEntropyFn.apply(hidden, weight, targets, ignore_index)
        return linear_cross_entropy_forward(hidden, weight, targets, ignore_index)[0]
