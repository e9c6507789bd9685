"""docs/architecture.md states two lists that grow with the code: the import layers, lowest first (the order
tests/test_import_graph.py enforces, ``LAYERS``), and the config sections (every class deriving from
``config_base.Config``). Both had fallen behind by 2026-12-02: the chain lacked ``leftovers``, ``cli_parser`` and
``generate_command``, the sections ``RopeScaling`` and ``PlanOptions``."""

from __future__ import annotations

import ast
import re
from pathlib import Path

from test_import_graph import LAYERS, SRC

DOC = Path(__file__).resolve().parents[1] / "docs" / "architecture.md"


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
