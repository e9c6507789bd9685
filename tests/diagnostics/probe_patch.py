"""A stand-in for the ``Attention.probe`` contract while ``hybridnorm.nn.attention`` lacks it.

The contract (see :class:`hybridnorm.diagnostics.Diagnostics`): a class attribute ``probe: bool = False``;
when an instance's ``probe`` is true its forward stores ``self.probed = (q, k)``, the detached q (1, H, T, D)
and k (1, Hkv, T, D) of the first sequence exactly as they enter SDPA. The stand-in wraps ``forward`` and
the module's SDPA call to capture them; with the real implementation present it does nothing.
"""

from __future__ import annotations

import functools
import types

import torch.nn.functional as F

import hybridnorm.nn.attention as attention_mod
from hybridnorm.nn.attention import Attention


def ensure_attention_probe(monkeypatch=None) -> bool:
    """Install the stand-in if ``Attention`` has no ``probe``; returns whether it was installed. With a
    pytest ``monkeypatch`` the patch is undone after the test, else it lasts for the process."""
    if hasattr(Attention, "probe"):
        return False
    current: list[Attention] = []  # the Attention whose forward is running

    def sdpa(q, k, v, *args, **kwargs):
        if current and getattr(current[-1], "probe", False):
            mod = current[-1]
            kp = k if k.shape[1] == mod.n_kv_heads else k[:, :: mod.n_heads // mod.n_kv_heads]  # undo a repeat
            mod.probed = (q[:1].detach(), kp[:1].detach())
        return F.scaled_dot_product_attention(q, k, v, *args, **kwargs)

    original = Attention.forward

    @functools.wraps(original)
    def forward(self, *args, **kwargs):
        current.append(self)
        try:
            return original(self, *args, **kwargs)
        finally:
            current.pop()

    fake_f = types.SimpleNamespace(**{n: getattr(F, n) for n in dir(F) if not n.startswith("__")})
    fake_f.scaled_dot_product_attention = sdpa
    setters = [(Attention, "probe", False), (Attention, "forward", forward), (attention_mod, "F", fake_f)]
    for obj, name, value in setters:
        if monkeypatch is not None:
            monkeypatch.setattr(obj, name, value, raising=False)
        else:
            setattr(obj, name, value)
    return True
