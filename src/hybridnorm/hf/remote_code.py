"""A folder of hybridnorm's own HF class that also loads with ``from_pretrained(..., trust_remote_code=True)``
(how lm-eval's ``--model hf``, ``pipeline``, TRL's trainers and other tools load a model without
``import hybridnorm.hf``).

``config.json``'s ``auto_map`` names a shim module in the folder, a few lines that import the *installed*
classes: the config, the backbone, the LM and the task heads, so an exported LM also loads as, say,
``AutoModelForSequenceClassification`` (a reward model to train). ``hybridnorm export`` writes both, and so
does every ``save_pretrained`` of a model whose config carries our map, so a model loaded through it,
fine-tuned (Trainer, TRL) and saved, loads the same way again. transformers' own way, copying the file that
defines a class into the folder, is switched off for our classes (``register_for_auto_class``): those files
import the rest of hybridnorm, so a copy would be a half of the package that shadows the installed one.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

SHIM = "modeling_hybridnorm.py"
# each Auto class and the class of ours it gives (the names hybridnorm.hf exports)
CLASSES = {"AutoConfig": "HybridNormConfig", "AutoModel": "HybridNormModel",
           "AutoModelForCausalLM": "HybridNormForCausalLM",
           "AutoModelForSequenceClassification": "HybridNormForSequenceClassification",
           "AutoModelForTokenClassification": "HybridNormForTokenClassification",
           "AutoModelForQuestionAnswering": "HybridNormForQuestionAnswering"}
AUTO_MAP = {auto: f"{SHIM.removesuffix('.py')}.{name}" for auto, name in CLASSES.items()}
SHIM_SOURCE = ("# hybridnorm's own HF classes, for from_pretrained(..., trust_remote_code=True).\n"
               "# Needs `pip install 'hybridnorm[hf]'`; `import hybridnorm.hf` registers them without this file.\n"
               f"from hybridnorm.hf import {', '.join(CLASSES.values())}  # noqa: F401\n")


def is_ours(auto_map: Any) -> bool:
    """Whether ``auto_map`` is one ``hybridnorm export`` wrote: today's map, or an older export's part of it
    (before 2026-11-28 it named the config and the LM only)."""
    return isinstance(auto_map, dict) and "AutoConfig" in auto_map \
        and all(AUTO_MAP.get(k) == v for k, v in auto_map.items())


def write_shim(folder: str | Path) -> None:
    (Path(folder) / SHIM).write_text(SHIM_SOURCE, encoding="utf-8")
