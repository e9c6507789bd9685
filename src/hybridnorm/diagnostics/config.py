"""What the training diagnostics collect and how the spike guard reacts (``TrainConfig.diagnostics``).

    --diagnostics.every=10            per-layer stats at step 1 and every 10th optimizer step
    --diagnostics.skip_spikes=true    drop the update of a step whose loss or grad norm spikes

Collection is off by default (``every=0``: no hooks, no copies). The spike detector is a guard,
not instrumentation: it only looks at the loss and grad norm the trainer already reads every step, so it
runs (and logs ``event`` records) unless ``spike_zscore=0``.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

from hybridnorm.config_base import Config, bounded
from hybridnorm.errors import ConfigError

# The detector needs this many finite values before it may fire: a z-score of a handful is noise.
MIN_SPIKE_HISTORY = 10


@dataclass
class DiagnosticsConfig(Config):
    SECTION: ClassVar[str] = "diagnostics"
    every: int = bounded(0, ge=0)  # collect at step 1 and every N optimizer steps; 0 = off
    activations: bool = True       # residual-stream RMS / max-abs / kurtosis / token cosine per block
    attention: bool = True         # max attention logit and entropy per layer (a hook on each SDPA module)
    spike_window: int = bounded(50, ge=MIN_SPIKE_HISTORY)  # rolling window of finite loss / grad-norm values
    spike_zscore: float = bounded(6.0, ge=0)  # more than this many std above the window mean is a spike; 0 = off
    skip_spikes: bool = False      # skip the optimizer update of a spiking step (the step still counts)

    def check(self) -> None:
        if self.skip_spikes and self.spike_zscore == 0:
            raise ConfigError("diagnostics.skip_spikes=true needs diagnostics.spike_zscore > 0 (0 turns detection "
                              "off)")

    @property
    def enabled(self) -> bool:
        return self.every > 0
