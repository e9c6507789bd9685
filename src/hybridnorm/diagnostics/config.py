"""What the training diagnostics collect and how the spike guard reacts (``TrainConfig.diagnostics``).

    --diagnostics.every=10            per-layer stats at step 1 and every 10th optimizer step
    --diagnostics.skip_spikes=true    drop the update of a step whose loss or grad norm spikes

Collection is off by default (``every=0``: no hooks, no copies). The spike detector is a guard,
not instrumentation: it only looks at the loss and grad norm the trainer already reads every step, so it
runs (and logs ``event`` records) unless ``spike_zscore=0``.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from hybridnorm.errors import ConfigError

# The detector needs this many finite values before it may fire: a z-score of a handful is noise.
MIN_SPIKE_HISTORY = 10


@dataclass
class DiagnosticsConfig:
    every: int = 0                 # collect at step 1 and every N optimizer steps; 0 = off
    activations: bool = True       # residual-stream RMS / max-abs / kurtosis / token cosine per block
    attention: bool = True         # max attention logit and entropy per layer (a hook on each SDPA module)
    spike_window: int = 50         # rolling window of finite loss / grad-norm values for the z-score
    spike_zscore: float = 6.0      # a value more than this many std above the window mean is a spike; 0 = off
    skip_spikes: bool = False      # skip the optimizer update of a spiking step (the step still counts)

    def validate(self, where: str = "diagnostics") -> DiagnosticsConfig:
        if self.every < 0:
            raise ConfigError(f"{where}.every={self.every} must be >= 0 (0 = off)")
        if self.spike_window < MIN_SPIKE_HISTORY:
            raise ConfigError(f"{where}.spike_window={self.spike_window} must be >= {MIN_SPIKE_HISTORY} "
                              f"(the detector needs {MIN_SPIKE_HISTORY} values before it can fire)")
        if not (math.isfinite(self.spike_zscore) and self.spike_zscore >= 0):
            raise ConfigError(f"{where}.spike_zscore={self.spike_zscore} must be a finite number >= 0 (0 = off)")
        if self.skip_spikes and self.spike_zscore == 0:
            raise ConfigError(f"{where}.skip_spikes=true needs {where}.spike_zscore > 0 (0 turns detection off)")
        return self

    @property
    def enabled(self) -> bool:
        return self.every > 0
