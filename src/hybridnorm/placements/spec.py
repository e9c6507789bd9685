"""A normalization placement as data.

One Transformer block has two sublayers, attention ``A`` and feed-forward ``F``. Every placement this
project knows is a choice of which norm slots around them are switched on:

    u      = N_in(s)            if in_norm   else s          # s: the sublayer's input stream
    branch = N_out(G(u))        if out_norm  else G(u)       # G = MHA_# or FFN
    skip   = s | N_in(s) | x | x + s                         # `skip`: input | normed | block | block+input
    s'     = N_post(α·skip + β·branch) if post_norm else α·skip + β·branch

plus, inside attention, per-head (or full-width) norms on any subset of Q, K, V and the per-head
context C. ``x`` is the block input, so a block is ``Y = sublayer(attn, X)``, ``X' = sublayer(ffn, Y)``.

A :class:`Placement` is a :class:`BlockSpec` for every layer, per-layer :class:`Override` s (the first
block of HybridNorm*, the first ⌊αL⌋ blocks of Mix-LN), and model-level embedding / final norms.
Everything is frozen and hashable, so two placements diff by eye and compare with ``==``. Each spec is
canonical from construction (``__post_init__``: the lossless forms of its fields, 2 -> 2.0, a list of
overrides -> a tuple, and the attention letters in QKVC order), so its equality and hash never change over
its life; ``validate()`` only checks, naming the field where it sits.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass, field
from typing import Any, Literal

from hybridnorm.config_base import from_mapping, typed_fields
from hybridnorm.errors import ConfigError

Skip = Literal["input", "normed", "block", "block+input"]
SKIPS: tuple[str, ...] = ("input", "normed", "block", "block+input")
SCOPES: tuple[str, ...] = ("head", "full")
ORDERS: tuple[str, ...] = ("before_rope", "after_rope")
INITS: tuple[str, ...] = ("normal", "megatron", "depth_scaled", "deepnorm")
QKVC = "QKVC"


def _choice(where: str, value: Any, choices: tuple[str, ...]) -> None:
    if value not in choices:
        raise ConfigError(f"{where}={value!r} is not one of {', '.join(map(repr, choices))}")


@dataclass(frozen=True)
class SublayerSpec:
    """The norm slots around one sublayer (attention or FFN); see the module docstring."""

    in_norm: bool = False
    skip: Skip = "input"
    out_norm: bool = False
    post_norm: bool = False

    def __post_init__(self) -> None:
        typed_fields(self, "", canonical=True)

    def validate(self, where: str) -> None:
        typed_fields(self, where)
        _choice(f"{where}.skip", self.skip, SKIPS)
        if self.skip == "normed" and not self.in_norm:
            raise ConfigError(f"{where}.skip='normed' needs {where}.in_norm=True (there is no normed input)")


@dataclass(frozen=True)
class BlockSpec:
    """Both sublayers of one block, the attention-internal norms and the residual scales.

    ``qkv_norm`` is a string of letters from ``QKVC`` (``""``: none). ``residual_scale`` is α on the
    skip (a number, or ``"deepnorm"`` for α = (2L)^¼); ``branch_scale`` is β on the branch output.
    ``depth_scaled_norms`` multiplies every norm output in block ``l`` by 1/√l (LayerNorm Scaling).
    """

    attn: SublayerSpec = SublayerSpec(in_norm=True)
    ffn: SublayerSpec = SublayerSpec(in_norm=True)
    qkv_norm: str = ""
    qkv_norm_scope: Literal["head", "full"] = "head"
    qkv_norm_order: Literal["before_rope", "after_rope"] = "before_rope"
    residual_scale: float | str = 1.0
    branch_scale: float = 1.0
    depth_scaled_norms: bool = False

    def __post_init__(self) -> None:
        typed_fields(self, "", canonical=True)
        # one spelling per set of letters, as the grammar writes it ('kq' -> 'QK'): the letters are a set (the
        # model asks `norms(letter)`), so a spec built or written with them in another order or case is the same
        # spec, equal, hashed, rendered and recorded alike, not another placement. Letters that are no such set
        # stay as given, for validate() to refuse by the field's name
        letters = self.qkv_norm.upper() if isinstance(self.qkv_norm, str) else "?"
        if set(letters) <= set(QKVC) and len(set(letters)) == len(letters):
            object.__setattr__(self, "qkv_norm", "".join(c for c in QKVC if c in letters))

    def validate(self, where: str = "block") -> None:
        typed_fields(self, where)
        self.attn.validate(f"{where}.attn")
        self.ffn.validate(f"{where}.ffn")
        if self.attn.skip in ("block", "block+input"):
            raise ConfigError(f"{where}.attn.skip={self.attn.skip!r}: the attention input IS the block input")
        letters = self.qkv_norm.upper()
        if any(c not in QKVC for c in letters) or len(set(letters)) != len(letters):
            raise ConfigError(f"{where}.qkv_norm={self.qkv_norm!r} must be distinct letters from 'QKVC'")
        _choice(f"{where}.qkv_norm_scope", self.qkv_norm_scope, SCOPES)
        _choice(f"{where}.qkv_norm_order", self.qkv_norm_order, ORDERS)
        if isinstance(self.residual_scale, str):
            _choice(f"{where}.residual_scale", self.residual_scale, ("deepnorm",))
        elif not self.residual_scale > 0:
            raise ConfigError(f"{where}.residual_scale={self.residual_scale} must be > 0")
        if not self.branch_scale > 0:
            raise ConfigError(f"{where}.branch_scale={self.branch_scale} must be > 0")

    def norms(self, letter: str) -> bool:
        """Whether the attention-internal norm on ``letter`` (one of Q, K, V, C) is on."""
        return letter in self.qkv_norm.upper()

    def alpha(self, n_layers: int) -> float:
        if self.residual_scale == "deepnorm":
            return (2 * n_layers) ** 0.25
        return float(self.residual_scale)

    def as_built(self, layer: int, n_layers: int) -> BlockSpec:
        """This spec as block ``layer`` (0-based) of ``n_layers`` builds it (hybridnorm.nn.block): each field that
        block ignores at its default, the residual scale as the α it multiplies by. Ignored are the scope of the
        attention norms with no such norm, their order around RoPE with no Q or K norm (V and C are not rotated),
        and ``depth_scaled_norms`` in block 1 (its 1/√l is 1) or in a block with no norm. Two blocks equal as built
        have the same parameters and compute the same function."""
        letters = self.qkv_norm
        normed = bool(letters) or any(s.in_norm or s.out_norm or s.post_norm for s in (self.attn, self.ffn))
        return dataclasses.replace(
            self, qkv_norm_scope=self.qkv_norm_scope if letters else "head",
            qkv_norm_order=self.qkv_norm_order if set(letters) & set("QK") else "before_rope",
            residual_scale=self.alpha(n_layers), depth_scaled_norms=self.depth_scaled_norms and layer > 0 and normed)


@dataclass(frozen=True)
class Override:
    """Use ``block`` instead of the placement's block for the first ``first_n`` blocks, or for the
    first ⌊``first_fraction``·L⌋ blocks. Exactly one of the two is set."""

    block: BlockSpec
    first_n: int | None = None
    first_fraction: float | None = None

    def __post_init__(self) -> None:
        typed_fields(self, "", canonical=True)

    def validate(self, where: str) -> None:
        typed_fields(self, where)
        if (self.first_n is None) == (self.first_fraction is None):
            raise ConfigError(f"{where}: set exactly one of first_n, first_fraction")
        if self.first_n is not None and self.first_n < 0:
            raise ConfigError(f"{where}.first_n={self.first_n} must be >= 0")
        if self.first_fraction is not None and not 0.0 <= self.first_fraction <= 1.0:
            raise ConfigError(f"{where}.first_fraction={self.first_fraction} must be in [0, 1]")
        self.block.validate(f"{where}.block")

    def count(self, n_layers: int) -> int:
        if self.first_n is not None:
            return min(self.first_n, n_layers)
        return math.floor(self.first_fraction * n_layers)  # type: ignore[operator]


@dataclass(frozen=True)
class Placement:
    """Where the norms go, for a whole model. ``init`` is the paper's default init for it.

    ``dual_stream`` (ResiDual): a second stream D beside the blocks' own, D₁ = X₁ (what block 1 receives),
    to which every sublayer adds its branch output (D' = D + MHA(X) + FFN(Y)); the trunk's output is
    X'_L + N(D_L), the norm being the model's ``dual_norm``, then the final norm if ``final_norm``."""

    name: str
    block: BlockSpec
    overrides: tuple[Override, ...] = ()
    embed_norm: bool = False
    final_norm: bool = True
    dual_stream: bool = False
    init: str = "normal"
    summary: str = ""
    source: str = ""
    aliases: tuple[str, ...] = field(default=(), compare=False)

    def __post_init__(self) -> None:
        typed_fields(self, "", canonical=True)

    def validate(self) -> Placement:
        """``self``, checked (a ConfigError naming the first bad field); it changes nothing."""
        where = f"placement[{self.name}]"
        typed_fields(self, where)
        self.block.validate(f"{where}.block")
        for i, o in enumerate(self.overrides):
            o.validate(f"{where}.overrides[{i}]")
        _choice(f"{where}.init", self.init, INITS)
        return self

    def block_for(self, layer: int, n_layers: int) -> BlockSpec:
        """The spec of block ``layer`` (0-based); the first override that covers it wins."""
        for o in self.overrides:
            if layer < o.count(n_layers):
                return o.block
        return self.block

    def blocks(self, n_layers: int) -> list[BlockSpec]:
        return [self.block_for(i, n_layers) for i in range(n_layers)]

    def replace_blocks(self, **changes: Any) -> Placement:
        """The same placement with ``changes`` applied to every BlockSpec (main and overrides),
        e.g. ``get("hybridnorm").replace_blocks(qkv_norm_scope="full")``."""
        return dataclasses.replace(
            self,
            block=dataclasses.replace(self.block, **changes),
            overrides=tuple(dataclasses.replace(o, block=dataclasses.replace(o.block, **changes))
                            for o in self.overrides),
        ).validate()

    # -- serialization: plain dicts of builtins, so YAML/JSON round-trip without any code execution --

    def to_dict(self) -> dict[str, Any]:
        d = dataclasses.asdict(self)
        d.pop("aliases")
        return d

    def built(self, n_layers: int) -> dict[str, Any]:
        """What a model of ``n_layers`` blocks builds from this placement: each block as built
        (:meth:`BlockSpec.as_built`) and the model-level norms and stream. Two placements with equal ``built`` make
        models of the same parameters computing the same function, however they are written or named (an override
        equal to the block it replaces, ``first_fraction`` and ``first_n`` covering the same blocks, another name,
        summary or default init): what a resume and a ``from_pretrained(placement=...)`` compare."""
        return {"blocks": [b.as_built(i, n_layers) for i, b in enumerate(self.blocks(n_layers))],
                "embed_norm": self.embed_norm, "final_norm": self.final_norm, "dual_stream": self.dual_stream}

    @staticmethod
    def from_dict(d: dict[str, Any]) -> Placement:
        """A placement from plain data: unknown keys refused and every field type-checked (config_base)."""
        where = f"placement[{d.get('name', '?')}]" if isinstance(d, dict) else "placement"
        if isinstance(d, dict):
            d = {k: v for k, v in d.items() if k != "aliases"}  # names, not part of the spec
        return from_mapping(Placement, d, where).validate()
