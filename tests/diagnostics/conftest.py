"""Reuse the training tests' tiny corpus, byte-level cache and config factory (tests/train/conftest.py)."""

import importlib.util
import sys
from pathlib import Path

_train = Path(__file__).resolve().parents[1] / "train"
sys.path.insert(0, str(_train))  # for `from train_helpers import ...` here and in the test modules
_spec = importlib.util.spec_from_file_location("train_conftest", _train / "conftest.py")
_mod = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(_mod)

corpus, cache_dir, make_cfg, no_peak_measure = _mod.corpus, _mod.cache_dir, _mod.make_cfg, _mod.no_peak_measure
