"""hybridnorm: where the normalization layers go, as data — HybridNorm and its rivals on one LM.

The names below are imported on first use (PEP 562), not with the package: every ``hybridnorm.*`` import
runs this file first, and the command line must be able to install its SIGINT/SIGTERM handling before
torch's second of importing (a signal in that second was a traceback or a death by signal, not exit 130).
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

from hybridnorm.errors import ConfigError

if TYPE_CHECKING:
    from hybridnorm import placements
    from hybridnorm.config import SIZES, ModelConfig, MoEConfig
    from hybridnorm.nn.model import TransformerLM, lm_loss

_WHERE = {"placements": "hybridnorm.placements", "SIZES": "hybridnorm.config", "ModelConfig": "hybridnorm.config",
          "MoEConfig": "hybridnorm.config", "TransformerLM": "hybridnorm.nn.model", "lm_loss": "hybridnorm.nn.model"}

__version__ = "0.1.0"
__all__ = ["SIZES", "ConfigError", "MoEConfig", "ModelConfig", "TransformerLM", "lm_loss", "placements"]


def __getattr__(name: str) -> Any:
    if name not in _WHERE:
        raise AttributeError(f"module 'hybridnorm' has no attribute {name!r}")
    module = importlib.import_module(_WHERE[name])
    value = module if name == "placements" else getattr(module, name)
    globals()[name] = value
    return value
