"""The tied LM head as a module, for tools that look for one (``HybridNormForCausalLM.get_output_embeddings()``
of a tied model). TransformerLM ties by reading the embedding's weight itself and holds no head module."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

import torch
from torch import Tensor


class TiedHead(torch.nn.Linear):
    """``get_output_embeddings()`` of a tied model (TransformerLM then holds no head module): the child
    ``tied_head``, an ``nn.Linear`` as transformers' model tests ask, with no parameter of its own (the state
    dict is unchanged). ``weight`` is the embedding's, read live, and ``bias`` None, as a stock tied head's,
    for tools that apply the head themselves (TRL's fused LM head). The LM's logits come from calling it, so
    an adapter or hook on it takes effect; a child, because tools look it up among the modules (PEFT's
    ``"all-linear"`` does, to leave the head out)."""

    bias = None

    def __init__(self, lm: torch.nn.Module) -> None:  # the HybridNormForCausalLM
        torch.nn.Module.__init__(self)  # not Linear's: it would make a weight of its own
        object.__setattr__(self, "owner", lm)  # a reference, not a child module; read live, never stale

    @property
    def weight(self) -> torch.nn.Parameter:
        return self.owner.model.embed.weight

    def __setattr__(self, name: str, value: Any) -> None:
        if name == "weight":  # a Parameter would otherwise meet Module.__setattr__'s KeyError
            raise AttributeError("the tied head's weight is the embedding's (model.embed.weight): change that, or "
                                 "untie the head (tie_word_embeddings=False, or set_output_embeddings(a head))")
        super().__setattr__(name, value)

    @property
    def in_features(self) -> int:
        return self.weight.shape[1]

    @property
    def out_features(self) -> int:
        return self.weight.shape[0]

    @out_features.setter
    def out_features(self, value: int) -> None:  # resize_token_embeddings writes it after resizing the embedding
        if value != self.out_features:
            raise AttributeError(f"the tied head has the embedding's {self.out_features} rows, not {value}")

    def forward(self, x: Tensor) -> Tensor:
        with _offloaded_weights_loaded(self.owner.model.embed):
            return self.owner.model.head(x)  # (B, T, V)


@contextlib.contextmanager
def _offloaded_weights_loaded(module: torch.nn.Module) -> Iterator[None]:
    """The tied head reads the embedding's weight outside the embedding's forward. Where accelerate offloaded
    the embedding (a ``device_map`` with "cpu" or "disk"), its hook loads that weight only around the module's
    own forward: run the hook's two halves around the read, as its forward wrapper does. No hook: nothing."""
    hook = getattr(module, "_hf_hook", None)
    if hook is None:
        yield
        return
    hook.pre_forward(module)
    try:
        yield
    finally:
        hook.post_forward(module, None)
