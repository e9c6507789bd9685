"""Normalization placements: the spec (data), the registry of named presets, and their equations.

>>> from hybridnorm import placements
>>> placements.get("hybridnorm_star").block_for(0, 12)   # the Pre-QKV-Pre first block
>>> placements.get("Pre-QK-Pre").block == placements.get("qk_norm").block   # grammar names parse
"""

from hybridnorm.placements.equations import block_equations, equations, one_line
from hybridnorm.placements.registry import GRAMMAR, PAPER_NAMES, aliases, get, names, parse, register
from hybridnorm.placements.spec import BlockSpec, Override, Placement, SublayerSpec

__all__ = [
    "GRAMMAR", "PAPER_NAMES", "BlockSpec", "Override", "Placement", "SublayerSpec", "aliases",
    "block_equations", "equations", "get", "names", "one_line", "parse", "register",
]


def _document() -> None:
    """Append every preset's equations to this module's docstring (``help(hybridnorm.placements)``)."""
    lines = ["", "Presets (generated from the registry):", ""]
    for key in names():
        lines.append(f"    {key}:")
        lines += [f"        {line}" for line in equations(get(key))]
    global __doc__
    __doc__ = (__doc__ or "") + "\n".join(lines) + "\n"


_document()
