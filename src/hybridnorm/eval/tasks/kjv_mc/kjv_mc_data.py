"""The ``custom_dataset`` hook of the lm-eval task ``kjv_mc`` (``kjv_mc.yaml``, next to this file).

lm-eval imports this file by its path, relative to the YAML's folder, so reading ``kjv_mc.jsonl`` relative
to ``__file__`` makes the task independent of the current directory (a relative ``data_files`` in the YAML
would go to ``datasets.load_dataset`` unchanged and be resolved against the CWD). The records are checked
by the built-in evaluator's reader, so both paths accept exactly the same file.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

DATA = Path(__file__).resolve().with_name("kjv_mc.jsonl")


def load(**_task_metadata: Any) -> Any:
    """``DatasetDict({"test": ...})`` of every item; lm-eval passes the task's metadata, unused here."""
    import datasets

    from hybridnorm.eval.multiple_choice import read_mc_jsonl

    read_mc_jsonl(DATA)  # raises ConfigError naming file:line for a bad record
    records = [json.loads(line) for line in DATA.read_text(encoding="utf-8").splitlines() if line.strip()]
    return datasets.DatasetDict({"test": datasets.Dataset.from_list(records)})
