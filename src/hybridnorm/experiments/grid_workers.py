"""Training the prepared points of a grid: one in this process (:func:`train_point`), or several side by side
in worker processes (:func:`run_parallel`, each ``python -m hybridnorm.experiments.grid RUN_DIR`` with its
share of the cores). A point whose worker fails gets ``failed.json`` in its folder (the worker's exit code
and its ``error:`` line), which the report shows as *failed*; trying the point again removes it.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path

from hybridnorm.errors import ConfigError, one_line
from hybridnorm.experiments.runs import read_point
from hybridnorm.train.config import TrainConfig
from hybridnorm.train.distributed import current_dist

EXIT_INTERRUPTED, EXIT_PAUSED = 130, 75  # a worker's exit codes besides 0 (done) and 2 (bad input)
FAILED = "failed.json"


def train_point(run_dir: Path) -> str:
    """Train one prepared point in this process: ``"done"`` (finished, or stopped by the non-finite guard),
    ``"interrupted"`` (a signal) or ``"paused"`` (the config's own stop_after_steps / max_minutes); a run
    that is not done has its checkpoint saved and the next call continues it."""
    from hybridnorm.train.trainer import train

    path = run_dir / "point.json"
    cfg = dataclasses.replace(TrainConfig.from_dict(read_point(path)["config"]), out_dir=str(run_dir))  # wherever it is
    # an unfinished run whose checkpoints are gone (e.g. a grid folder committed without them) restarts from
    # step 0, and the trainer sets its old log aside as metrics.stale.jsonl
    result = train(cfg, resume=True, quiet=True)
    if result.interrupted:
        return "interrupted"
    if not (result.diverged or result.step >= cfg.max_steps):
        return "paused"
    if not current_dist().is_main:  # under torchrun the run trained on every rank; rank 0 marks it done
        return "done"
    (run_dir / "done.json").write_text(json.dumps({"step": result.step, "diverged": result.diverged}) + "\n",
                                       encoding="utf-8")
    return "done"


def clear_failure(run_dir: Path) -> None:
    """The point is tried again: its earlier failure no longer describes it."""
    (run_dir / FAILED).unlink(missing_ok=True)


def record_failure(run_dir: Path, exit_code: int, error: str) -> None:
    """``failed.json``: the exit code and the error, for the report (rank 0 / the grid process only)."""
    tmp = run_dir / f"{FAILED}.tmp"
    tmp.write_text(json.dumps({"exit": exit_code, "error": error}) + "\n", encoding="utf-8")
    tmp.replace(run_dir / FAILED)


def _worker_error(log: Path, exit_code: int) -> str:
    """The worker's last ``error:`` line (its one-line reason), else where to look."""
    try:
        lines = log.read_text(encoding="utf-8", errors="replace").splitlines()
    except OSError:
        lines = []
    last = next((x for x in reversed(lines) if x.startswith("error: ")), None)
    return last[len("error: "):] if last else f"the worker exited {exit_code}; see {log}"


@contextlib.contextmanager
def sigterm_as_interrupt() -> Iterator[None]:
    """SIGTERM to the grid process becomes KeyboardInterrupt, so its workers are stopped cleanly too."""
    def raise_interrupt(signum: int, frame: object) -> None:
        raise KeyboardInterrupt
    try:
        old = signal.signal(signal.SIGTERM, raise_interrupt)
    except ValueError:  # not the main thread
        yield
        return
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, old)


def run_parallel(todo: list[Path], jobs: int, on_done: Callable[[Path], None]) -> list[tuple[Path, int]]:
    """Train ``todo`` in ``jobs`` worker processes; returns (run folder, exit code) of failed workers, each
    also recorded in its folder (:func:`record_failure`)."""
    threads = max(1, (os.cpu_count() or 1) // jobs)
    env = {**os.environ, "OMP_NUM_THREADS": str(threads)}
    pending, running, failed = list(todo), [], []
    try:
        while pending or running:
            while pending and len(running) < jobs:
                run_dir = pending.pop(0)
                clear_failure(run_dir)
                log = open(run_dir / "worker.log", "ab")  # closed when the worker ends
                proc = subprocess.Popen([sys.executable, "-m", "hybridnorm.experiments.grid", str(run_dir),
                                         "--threads", str(threads)], stdout=log, stderr=subprocess.STDOUT, env=env)
                running.append((proc, run_dir, log))
            time.sleep(0.2)
            for item in list(running):
                proc, run_dir, log = item
                if (rc := proc.poll()) is None:
                    continue
                running.remove(item)
                log.close()
                if rc == EXIT_INTERRUPTED:
                    raise KeyboardInterrupt
                if rc == EXIT_PAUSED:
                    continue
                if rc != 0:
                    failed.append((run_dir, rc))
                    record_failure(run_dir, rc, _worker_error(run_dir / "worker.log", rc))
                    print(f"[grid] worker for {run_dir} failed (exit {rc}); see {run_dir / 'worker.log'}",
                          file=sys.stderr, flush=True)
                on_done(run_dir)  # a failed run is reported too: as failed
    except KeyboardInterrupt:
        for proc, _, _log in running:  # each saves a checkpoint after its current step, then exits 130
            with contextlib.suppress(ProcessLookupError):
                proc.send_signal(signal.SIGTERM)
        for proc, _, log in running:
            proc.wait()
            log.close()
        raise
    return failed


def worker_main(argv: list[str]) -> int:
    """``python -m hybridnorm.experiments.grid RUN_DIR [--threads N]``: train one prepared point."""
    import argparse

    import torch

    ap = argparse.ArgumentParser(prog="python -m hybridnorm.experiments.grid", description="train one grid point")
    ap.add_argument("run_dir")
    ap.add_argument("--threads", type=int, default=0)
    args = ap.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    try:
        return {"done": 0, "interrupted": EXIT_INTERRUPTED, "paused": EXIT_PAUSED}[train_point(Path(args.run_dir))]
    except (ConfigError, OSError, ValueError) as e:
        print(f"error: {one_line(e)}", file=sys.stderr)  # one line: the report quotes it
        return 2
    except Exception as e:  # the log is for the person debugging the grid: the traceback, then one line
        import traceback

        traceback.print_exc()
        print(f"error: {type(e).__name__}: {one_line(e)}", file=sys.stderr)
        return 1
