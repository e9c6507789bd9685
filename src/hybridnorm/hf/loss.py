"""The causal-LM loss with transformers' conventions, kept in the logits' precision (fp64 stays fp64).

transformers' ``ForCausalLMLoss`` always computes in fp32; ours follows the same rules (the test suite holds
the two equal in fp32) without casting fp64 logits down, so the float64 parity of the HF class with
:class:`hybridnorm.TransformerLM` covers the loss too.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor


def causal_lm_loss(logits: Tensor, labels: Tensor | None, num_items_in_batch: Tensor | int | None = None,
                   shift_labels: Tensor | None = None, ignore_index: int = -100) -> tuple[Tensor, Tensor]:
    """(loss, number of scored tokens) for logits (B, T, V).

    Targets are ``labels`` shifted left by one (position t predicts token t + 1; the last position scores
    nothing) or, if given, ``shift_labels`` as they are (already aligned with the logits). Tokens equal to
    ``ignore_index`` are not scored. The loss is the mean over scored tokens, or with ``num_items_in_batch``
    their sum divided by it: what ``Trainer`` passes so that micro-batches of a gradient-accumulation step
    add up to the mean over the whole step."""
    if shift_labels is None:
        shift_labels = F.pad(labels, (0, 1), value=ignore_index)[:, 1:]  # (B, T)
    wide = logits.to(torch.promote_types(logits.dtype, torch.float32))
    targets = shift_labels.reshape(-1).to(logits.device)
    scored = (targets != ignore_index).sum()
    if num_items_in_batch is None:
        return F.cross_entropy(wide.flatten(0, -2), targets, ignore_index=ignore_index), scored
    total = F.cross_entropy(wide.flatten(0, -2), targets, ignore_index=ignore_index, reduction="sum")
    if isinstance(num_items_in_batch, Tensor):
        num_items_in_batch = num_items_in_batch.to(total.device)
    return total / num_items_in_batch, scored
