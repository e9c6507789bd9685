"""Facts the documents state that the code owns and that move with it. docs/architecture.md: the import layers,
lowest first (the order tests/test_import_graph.py enforces, ``LAYERS``), and the config sections (every class
deriving from ``config_base.Config``); by 2026-12-02 the chain lacked ``leftovers``, ``cli_parser`` and
``generate_command``, the sections ``RopeScaling`` and ``PlanOptions``. README.md and docs/huggingface.md: the
transformers range of pyproject.toml's ``hf`` extra; docs/huggingface.md still said >= 5.5 after the floor
became 5.5.4."""

from __future__ import annotations

import ast
import re
from pathlib import Path

from test_import_graph import LAYERS, SRC

ROOT = Path(__file__).resolve().parents[1]
DOC = ROOT / "docs" / "architecture.md"


def _section(title: str) -> str:
    text = DOC.read_text(encoding="utf-8")
    start = text.index(f"## {title}\n")
    end = text.find("\n## ", start + 1)
    return text[start:end if end >= 0 else None]


def test_the_documented_layer_order_is_the_enforced_one() -> None:
    chain = _section("Import layers").split("lowest first, with nothing importing upward:\n\n", 1)[1].split("\n\n")[0]
    documented = [re.sub(r"`|\(facade\)", "", name).strip() for name in chain.replace("\n", " ").split("→")]
    enforced = [prefix.removeprefix("hybridnorm.") for prefix, _ in LAYERS]
    assert documented == enforced


def test_every_config_section_is_named() -> None:
    sections = {node.name for path in SRC.rglob("*.py")
                for node in ast.walk(ast.parse(path.read_text(encoding="utf-8")))
                if isinstance(node, ast.ClassDef) and any(getattr(b, "id", None) == "Config" for b in node.bases)}
    assert {"ModelConfig", "TrainConfig", "EvalRequest"} <= sections  # the scan finds them at all
    text = _section("One config mechanism")
    assert not [name for name in sorted(sections) if f"`{name}`" not in text and f".{name}`" not in text]


def test_the_transformers_range_is_the_hf_extras() -> None:
    pyproject = (ROOT / "pyproject.toml").read_text(encoding="utf-8")
    extra = re.search(r'^hf = \["transformers>=([\d.]+),<([\d.]+)"\]', pyproject, flags=re.M)
    assert extra, "pyproject.toml's hf extra is not one transformers range"
    for doc in ("README.md", "docs/huggingface.md"):
        stated = re.findall(r"transformers ≥ ([\d.]+), < ([\d.]+)", (ROOT / doc).read_text(encoding="utf-8"))
        assert stated and set(stated) == {extra.groups()}, (doc, stated, extra.groups())
