"""Training diagnostics: why a normalization placement trains or diverges.

Per-layer and per-sublayer gradient / update / weight norms, residual-stream statistics, attention logit
and entropy, MoE expert load (:class:`Diagnostics`, every ``DiagnosticsConfig.every`` steps), a loss /
grad-norm spike guard (:class:`SpikeDetector`) and the post-mortem of a non-finite step
(:func:`divergence_report`). See ``TrainConfig.diagnostics`` for the switches.
"""

from hybridnorm.diagnostics.collector import Diagnostics, attention_kernel
from hybridnorm.diagnostics.config import DiagnosticsConfig
from hybridnorm.diagnostics.groups import (
    UpdateTracker,
    grad_norm_by_layer,
    group_params,
    param_groups_of,
    weight_norm_by_layer,
)
from hybridnorm.diagnostics.guards import (
    SpikeDetector,
    SpikeEvent,
    divergence_report,
    first_nonfinite_module,
    first_nonfinite_param,
)
from hybridnorm.diagnostics.stats import activation_stats, attention_stats, expert_load_stats, token_cosine

__all__ = ["Diagnostics", "DiagnosticsConfig", "SpikeDetector", "SpikeEvent", "UpdateTracker",
           "activation_stats", "attention_kernel", "attention_stats", "divergence_report", "expert_load_stats",
           "first_nonfinite_module", "first_nonfinite_param", "grad_norm_by_layer", "group_params",
           "param_groups_of", "token_cosine", "weight_norm_by_layer"]
