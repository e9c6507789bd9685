"""Where the package's own lm-eval tasks live (a module of its own, so the adapter and the package
``__init__`` that lazily imports the adapter both read it without an import cycle)."""

from pathlib import Path

TASKS_DIR = Path(__file__).resolve().parent / "tasks"  # lm-eval tasks shipped with the package (kjv_mc)
