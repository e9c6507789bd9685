"""A folder of hybridnorm's own HF class that also loads with ``from_pretrained(..., trust_remote_code=True)``
(how lm-eval's ``--model hf``, ``pipeline`` and other tools load a model without ``import hybridnorm.hf``).

``config.json``'s ``auto_map`` names a shim module in the folder, three lines that import the *installed*
classes. ``hybridnorm export`` writes both, and so does every ``save_pretrained`` of a model whose config
carries that map, so a model loaded through it, fine-tuned (Trainer, TRL) and saved, loads the same way
again. transformers' own way, copying the file that defines a class into the folder, is switched off for
our classes (``register_for_auto_class``): those files import the rest of hybridnorm, so a copy would be
a half of the package that shadows the installed one.
"""

from __future__ import annotations

from pathlib import Path

SHIM = "modeling_hybridnorm.py"
AUTO_MAP = {"AutoConfig": f"{SHIM.removesuffix('.py')}.HybridNormConfig",
            "AutoModelForCausalLM": f"{SHIM.removesuffix('.py')}.HybridNormForCausalLM"}
SHIM_SOURCE = ("# hybridnorm's own HF class, for from_pretrained(..., trust_remote_code=True).\n"
               "# Needs `pip install 'hybridnorm[hf]'`; `import hybridnorm.hf` registers it without this file.\n"
               "from hybridnorm.hf.modeling import HybridNormConfig, HybridNormForCausalLM  # noqa: F401\n")


def write_shim(folder: str | Path) -> None:
    (Path(folder) / SHIM).write_text(SHIM_SOURCE, encoding="utf-8")
