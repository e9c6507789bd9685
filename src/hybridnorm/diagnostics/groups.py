"""Parameter groups per layer and sublayer, and the gradient / weight / update norms of each group.

A parameter's groups follow from its name in :class:`~hybridnorm.nn.model.TransformerLM`:

    embed.weight                      -> embed
    embed_norm.*                      -> embed_norm
    blocks.3.attn.w_qkv.weight        -> blocks.3, blocks.3.attn     (also attn.{q,k,v,c}_norm)
    blocks.3.attn_norm.weight         -> blocks.3, blocks.3.attn     (attn_norm, attn_out_norm, attn_post_norm)
    blocks.3.ffn.w_in                 -> blocks.3, blocks.3.ffn      (ffn.*, ffn_norm, ffn_out_norm, ffn_post_norm)
    final_norm.*                      -> final_norm
    lm_head.weight                    -> lm_head

``blocks.i`` is the whole block (attn and ffn together, so ``‖blocks.i‖² = ‖attn‖² + ‖ffn‖²``). With tied
embeddings there is no ``lm_head`` group: ``embed`` carries the gradient of both uses of the matrix.
Wrapper prefixes (``module.`` of DDP, ``_orig_mod.`` of torch.compile) are ignored.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable

import torch
from torch import Tensor, nn

_WRAPPERS = ("module.", "_orig_mod.")


def strip_wrappers(name: str) -> str:
    """A parameter / module name without DDP's ``module.`` and torch.compile's ``_orig_mod.`` prefixes."""
    changed = True
    while changed:
        changed = False
        for prefix in _WRAPPERS:
            if name.startswith(prefix):
                name, changed = name[len(prefix):], True
    return name


def param_groups_of(name: str) -> tuple[str, ...]:
    """The groups one parameter belongs to (see the module docstring)."""
    parts = strip_wrappers(name).split(".")
    if parts[0] != "blocks" or len(parts) < 3:
        return (parts[0],)
    block = f"blocks.{parts[1]}"
    sub = parts[2]
    if sub == "attn" or sub.startswith("attn_"):
        return block, f"{block}.attn"
    if sub == "ffn" or sub.startswith("ffn_"):
        return block, f"{block}.ffn"
    return (block,)


def group_params(named: Iterable[tuple[str, nn.Parameter]]) -> dict[str, list[nn.Parameter]]:
    """Group name -> its parameters, in model order: embed, blocks.0, blocks.0.attn, blocks.0.ffn, ...,
    final_norm, lm_head (top-level names in first-seen order, each block as total, attn, ffn)."""
    groups: dict[str, list[nn.Parameter]] = {}
    for name, p in named:
        for g in param_groups_of(name):
            groups.setdefault(g, []).append(p)
    tops = list(dict.fromkeys(g.split(".")[0] for g in groups))

    def order(g: str) -> tuple[int, int, int]:
        parts = g.split(".")
        if parts[0] != "blocks":
            return tops.index(parts[0]), 0, 0
        return tops.index("blocks"), int(parts[1]), ("", "attn", "ffn").index(parts[2] if len(parts) > 2 else "")

    return {g: groups[g] for g in sorted(groups, key=order)}


def group_norms(groups: dict[str, list[nn.Parameter]],
                tensor_of: Callable[[nn.Parameter], Tensor | None]) -> dict[str, float]:
    """L2 norm per group of ``tensor_of(p)`` over the group's parameters taken together (``None``: zero).

    Each parameter's tensor is reduced once (in fp32, on its device) even when it is in two groups, and
    all the per-tensor norms come back to the host in ONE transfer; the group sums run in float64.
    """
    params = list({id(p): p for ps in groups.values() for p in ps}.values())
    keys, per_tensor = [], []
    with torch.no_grad():
        for p in params:  # one tensor at a time: a temporary (an update delta) is freed right away
            t = tensor_of(p)
            if t is not None:
                keys.append(id(p))
                per_tensor.append(torch.linalg.vector_norm(t, dtype=torch.float32))
        values = torch.stack([v.to(per_tensor[0].device) for v in per_tensor]).cpu().double().tolist() \
            if per_tensor else []
    norm = dict(zip(keys, values, strict=True))
    return {g: math.sqrt(sum(norm.get(id(p), 0.0) ** 2 for p in ps)) for g, ps in groups.items()}


def _named(model: nn.Module) -> dict[str, list[nn.Parameter]]:
    return group_params((n, p) for n, p in model.named_parameters() if p.requires_grad)


def grad_norm_by_layer(model: nn.Module) -> dict[str, float]:
    """‖grad‖ per group of ``model``'s parameters, from ``p.grad`` as it is now — call it BEFORE
    ``clip_grad_norm_`` to see the raw gradients. Parameters without a gradient count as zero."""
    return group_norms(_named(model), lambda p: p.grad)


def weight_norm_by_layer(model: nn.Module) -> dict[str, float]:
    """‖θ‖ per group of ``model``'s parameters."""
    return group_norms(_named(model), lambda p: p.detach())


class UpdateTracker:
    """‖θ_after − θ_before‖ per group: :meth:`snapshot` copies the parameters (call it right before
    ``optimizer.step()``), :meth:`norms` diffs against the copy and frees it. Memory: one copy of the
    parameters, held only between the two calls."""

    def __init__(self, model: nn.Module) -> None:
        self.groups = _named(model)
        self._before: dict[int, Tensor] | None = None

    def snapshot(self) -> None:
        with torch.no_grad():
            self._before = {id(p): p.detach().clone() for ps in self.groups.values() for p in ps}

    def discard(self) -> None:
        self._before = None

    def norms(self) -> dict[str, float]:
        if self._before is None:
            raise RuntimeError("UpdateTracker.norms() without a snapshot() before the update")
        before, self._before = self._before, None
        with torch.no_grad():
            return group_norms(self.groups, lambda p: p.detach() - before[id(p)])
