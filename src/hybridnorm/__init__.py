"""hybridnorm: where the normalization layers go, as data — HybridNorm and its rivals on one LM."""

from hybridnorm import placements
from hybridnorm.config import SIZES, ModelConfig, MoEConfig
from hybridnorm.errors import ConfigError
from hybridnorm.nn.model import TransformerLM, lm_loss

__version__ = "0.1.0"
__all__ = ["SIZES", "ConfigError", "MoEConfig", "ModelConfig", "TransformerLM", "lm_loss", "placements"]
