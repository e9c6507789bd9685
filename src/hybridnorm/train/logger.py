"""Where metrics go: ``metrics.jsonl`` and TensorBoard events in the run folder, and a `rich` display.

Only rank 0 logs. On a terminal (not TERM=dumb) the display is a live progress bar with the latest step, loss, grad
norm, LR, tokens/s, MFU and ETA; elsewhere (CI, a log file, a dumb terminal) it prints one line per log interval.
"""

from __future__ import annotations

import json
import math
import os
import time
from pathlib import Path
from typing import Any

from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeRemainingColumn

from hybridnorm import plain_data

# Record kinds written to metrics.jsonl and TensorBoard but not echoed: a per-layer ``diag`` record holds
# ~100 numbers, which would bury the progress line.
SILENT_KINDS = ("diag", "meta")


class MetricsLogger:
    def __init__(self, run_dir: Path, total_steps: int, start_step: int = 0, enabled: bool = True,
                 tensorboard: bool = True, echo: bool = True) -> None:
        self.enabled = enabled
        # echo=False (e.g. one run of `hybridnorm compare`): files only, nothing on the console
        self.console = Console(stderr=True, soft_wrap=True, quiet=not echo)
        self.total, self.start_time = total_steps, time.perf_counter()
        if not enabled:
            return
        run_dir.mkdir(parents=True, exist_ok=True)
        if start_step:  # a resumed run re-logs the steps after its checkpoint (as purge_step does for TB)
            _purge_after(run_dir / "metrics.jsonl", start_step)
        else:  # a run starting over (killed before its first checkpoint): its old history is kept apart
            _set_aside(run_dir / "metrics.jsonl")
        self.jsonl = open(run_dir / "metrics.jsonl", "a", encoding="utf-8")
        self.tb = None
        if tensorboard:
            try:
                from torch.utils.tensorboard import SummaryWriter

                # purge what a killed run logged PAST its checkpoint (step start_step + 1 on), as _purge_after
                # does for metrics.jsonl; purge_step=start_step also dropped the checkpoint step's own points.
                # A run starting over purges from step 0: its metrics.jsonl was set aside, and the old run's
                # step-0 points (its meta record) stayed beside the new ones in TensorBoard
                self.tb = SummaryWriter(str(run_dir / "tb"), purge_step=start_step + 1 if start_step else 0)
            except ImportError:
                self.console.print("tensorboard is not installed: metrics go to metrics.jsonl only", style="yellow")
        # a dumb terminal (TERM=dumb: Emacs' shell, some CI) cannot redraw a bar: rich would show it only once,
        # at the end, so such a terminal gets the line per log interval that a file gets
        self.live = self.console.is_terminal and not self.console.is_dumb_terminal
        self.progress = Progress(
            TextColumn("[bold]train"), BarColumn(), MofNCompleteColumn(), TextColumn("{task.fields[stats]}"),
            TimeRemainingColumn(), console=self.console, disable=not self.live)
        self.task = self.progress.add_task("train", total=total_steps, completed=start_step, stats="")
        self.progress.start()

    def log(self, step: int, metrics: dict[str, Any], kind: str = "train") -> None:
        if not self.enabled:
            return
        record = {"kind": kind, "step": step, "time": round(time.perf_counter() - self.start_time, 3), **metrics}
        self.jsonl.write(json.dumps(record) + "\n")
        self.jsonl.flush()
        if self.tb is not None:
            for key, value in metrics.items():
                if isinstance(value, (int, float)) and math.isfinite(value):
                    self.tb.add_scalar(f"{kind}/{key}", value, step)
        if kind in SILENT_KINDS:
            return
        line = self._line(step, kind, metrics)
        if kind == "train" and self.live:
            self.progress.update(self.task, completed=step, stats=line)
        else:
            self.console.print(line, highlight=False, markup=False)

    @staticmethod
    def _line(step: int, kind: str, m: dict[str, Any]) -> str:
        if kind == "eval":
            return f"[eval] step {step}: val_loss {m['val_loss']:.4f}  val_ppl {m['val_ppl']:.2f}"
        if kind != "train":
            return f"[{kind}] step {step}: " + "  ".join(f"{k} {v}" for k, v in m.items())
        return (f"step {step}  loss {m['loss']:.4f}  gnorm {m['grad_norm']:.3f}  lr {m['lr']:.2e}  "
                f"tok/s {m['tokens_per_s']:,.0f}  MFU {100 * m['mfu']:.1f}%")

    def message(self, text: str, style: str | None = None) -> None:
        """Print ``text`` as it is: paths and values may hold brackets (``runs/[ablation]``, a ``[/x]`` folder),
        which rich markup would eat or refuse with a MarkupError; ``style`` colours the whole line."""
        if self.enabled:
            self.console.print(text, style=style, highlight=False, markup=False)

    def close(self) -> None:
        if not self.enabled:
            return
        self.progress.stop()
        self.jsonl.close()
        if self.tb is not None:
            self.tb.close()


def _set_aside(path: Path) -> None:
    """Rename a non-empty ``metrics.jsonl`` to ``metrics.stale.jsonl`` (``metrics.stale.2.jsonl``, ... when
    that is taken), so that a run starting over from step 0 never appends a second history to the first."""
    if not path.is_file() or path.stat().st_size == 0:
        return
    n = 1
    while (stale := path.with_name(f"metrics.stale{'' if n == 1 else f'.{n}'}.jsonl")).exists():
        n += 1
    path.replace(stale)


def _purge_after(path: Path, step: int) -> None:
    """Drop the records past ``step`` (and a torn line) that a run killed after its last checkpoint left.
    A line that is JSON but not a record with an integer step is not the trainer's to judge: it stays, and
    the readers of the log name it."""
    if not path.is_file():
        return
    lines = path.read_text(encoding="utf-8", errors="replace").splitlines()
    keep = []
    for line in lines:
        try:
            rec = plain_data.loads(line)
        except ValueError:
            continue  # torn by a kill
        rec_step = rec.get("step", 0) if isinstance(rec, dict) else None
        if not isinstance(rec_step, int) or isinstance(rec_step, bool) or rec_step <= step:
            keep.append(line)
    if len(keep) < len(lines) or not path.read_bytes().endswith(b"\n"):
        tmp = path.with_name(path.name + ".tmp")
        tmp.write_text("".join(line + "\n" for line in keep), encoding="utf-8")
        os.replace(tmp, path)
