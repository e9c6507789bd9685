"""lm-eval's ``batch_size="auto"``: the largest batch of scoring rows that fits the device's memory, found as
lm-eval's HF backend (``HFLM``) finds it: a forward of ``max_batch_size`` rows at the length to be scored,
halved on out-of-memory until one fits.

``auto`` detects once per kind of request: log-likelihoods at their longest window (they are scored longest
first), generation at the model's window (the most a generation batch's cache and prefill hold).
``auto:N`` re-detects N times through a log-likelihood call's sorted windows (HFLM's schedule), so the later,
shorter windows get bigger batches. A score does not depend on the batch it was computed in, so the sizes
change the speed only; ``HybridNormLM.batch_sizes`` records them, which ``simple_evaluate`` copies into
``results["config"]["batch_sizes"]``. Under torchrun each rank sizes its own batches (HFLM takes the
ranks' minimum; here no rank waits for another's probe, and the results do not depend on it).

On a GPU an out-of-memory error in the probe is caught and halves the batch. On the CPU a tensor too large
for the machine may be granted by the kernel and kill the process when touched, so the probe starts no
higher than what fits in half the memory the machine has available (``MemAvailable``), counting the logits
and a generous share of activations per row.
"""

from __future__ import annotations

import gc
from dataclasses import dataclass, field
from pathlib import Path

import torch

from hybridnorm.errors import ConfigError
from hybridnorm.eval.scoring import RowRule
from hybridnorm.nn.model import TransformerLM

MAX_BATCH = 64  # HFLM's max_batch_size default: where the probe starts


@dataclass(frozen=True)
class BatchSize:
    """A ``batch_size`` as lm-eval passes it: a positive integer, ``"auto"`` or ``"auto:N"``."""

    rows: int | None  # None: detected
    schedule: int = 1  # auto:N: detections per log-likelihood call

    @classmethod
    def parse(cls, value: object, name: str = "batch_size") -> BatchSize:
        text = str(value).strip()
        if text == "auto" or text.startswith("auto:"):
            _, colon, n = text.partition(":")
            n = n if colon else "1"
            if not n.isdigit() or int(n) < 1:
                raise ConfigError(f"{name}={value!r}: auto:N needs a positive integer N (detections per call)")
            return cls(None, int(n))
        number = value if isinstance(value, (int, float)) and not isinstance(value, bool) else \
            int(text) if text.isdigit() else 0  # model_args arrive as strings from lm-eval's command line
        if not number >= 1 or (isinstance(number, float) and not number.is_integer()):  # NaN, inf: not integers
            raise ConfigError(f"{name}={value!r} must be a positive integer, 'auto' or 'auto:N'")
        return cls(int(number))

    def __str__(self) -> str:
        return str(self.rows) if self.rows is not None else "auto" if self.schedule == 1 else f"auto:{self.schedule}"


@dataclass
class AutoBatch:
    """Batch sizes for ``model``: fixed, or detected (:func:`largest_batch`) and remembered in ``sizes``."""

    model: TransformerLM
    spec: BatchSize
    max_batch: int = MAX_BATCH
    sizes: list[int] = field(default_factory=list)  # every detection, in order
    _generation: int | None = None

    def scoring(self) -> int | RowRule:
        """The rule for one log-likelihood call (:func:`~hybridnorm.eval.scoring.score_windows`): a fixed size,
        or detections at the longest row of each of ``schedule`` equal shares of its sorted windows."""
        if self.spec.rows is not None:
            return self.spec.rows
        detected: dict[int, int] = {}

        def rows(longest: int, done: int, total: int) -> int:
            share = done * self.spec.schedule // max(total, 1)
            if share not in detected:
                detected[share] = self._detect(longest, with_cache=False)
            return detected[share]
        return rows

    def generation(self) -> int:
        """Rows of a generation batch: fixed, or one detection at the model's window with a KV cache."""
        if self.spec.rows is not None:
            return self.spec.rows
        if self._generation is None:
            self._generation = self._detect(self.model.config.max_seq_len, with_cache=True)
        return self._generation

    def _detect(self, length: int, with_cache: bool) -> int:
        rows = largest_batch(self.model, length, self.max_batch, with_cache)
        self.sizes.append(rows)
        return rows


def largest_batch(model: TransformerLM, length: int, max_batch: int = MAX_BATCH, with_cache: bool = False) -> int:
    """The largest of ``max_batch``, ``max_batch // 2``, ... down to 1 rows of ``length`` tokens whose forward
    (and the fp32 log-softmax of a row, as scoring takes it) fits the model's device; ``with_cache``: the
    forward of a generation batch instead (a KV cache of ``length`` positions, a padding mask). The probe
    starts no higher than :func:`memory_cap` on the CPU."""
    device = model.embed.weight.device
    rows = max_batch if device.type == "cuda" else min(max_batch, memory_cap(model, length, with_cache))
    while rows >= 1:
        try:
            _probe(model, rows, length, with_cache)
            return rows
        except (torch.OutOfMemoryError, RuntimeError) as e:
            if not _out_of_memory(e):
                raise
        finally:
            gc.collect()
            if device.type == "cuda":
                torch.cuda.empty_cache()
        rows //= 2
    raise ConfigError(f"batch_size=auto: not even one row of {length} tokens fits in the memory of {device}")


@torch.inference_mode()
def _probe(model: TransformerLM, rows: int, length: int, with_cache: bool) -> None:
    device = model.embed.weight.device
    ids = torch.ones(rows, length, dtype=torch.long, device=device)  # (B, T)
    if with_cache:  # as a left-padded generation batch: a mask, so the same attention kernel
        mask = torch.ones_like(ids)
        mask[:, 0] = 0
        logits = model(ids, cache=model.new_cache(rows, length), attention_mask=mask)  # (B, T, V_emb)
    else:
        logits = model(ids)  # (B, T, V_emb)
    logits[0].float().log_softmax(-1)  # (T, V_emb): a row's scored tokens at most
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _out_of_memory(e: BaseException) -> bool:
    return isinstance(e, torch.OutOfMemoryError) or "can't allocate memory" in str(e) \
        or "out of memory" in str(e).lower()


def memory_cap(model: TransformerLM, length: int, with_cache: bool = False) -> int:
    """Rows of ``length`` tokens whose estimated forward fits in half the machine's available memory (at least
    1): the logits in the model's dtype plus an fp32 row of them, 16·d values a token for the activations
    alive at once, and a generation batch's KV cache."""
    cfg = model.config
    item = model.embed.weight.element_size()
    vocab = model.embed.weight.shape[0]
    per_row = length * item * (vocab + 16 * cfg.d_model)
    if with_cache:
        per_row += 2 * cfg.n_layers * length * cfg.d_model * item  # keys and values (at most H_kv = H)
    fixed = length * vocab * 4  # the fp32 log-softmax of one row
    return max(1, (available_bytes() // 2 - fixed) // per_row)


def available_bytes(meminfo: Path = Path("/proc/meminfo")) -> int:
    """The memory the machine can still give (Linux ``MemAvailable``); elsewhere 8 GiB, a laptop's share."""
    try:
        for line in meminfo.read_text().splitlines():
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    return 8 << 30
