"""The import structure of src/hybridnorm, read statically with ``ast``: no cycles, a layering in which nothing
imports anything above it, no private name imported across packages, and no source file over 400 lines.

Edges are the imports written in the code, wherever they stand: module level, inside a function (lazy
imports that keep ``hybridnorm --help`` fast or an optional dependency optional are still dependencies)
and under ``if TYPE_CHECKING:``. ``from a.b import c`` is an edge to ``a.b.c`` when that is a module,
else to ``a.b``. Only hybridnorm's own modules are nodes.
"""

from __future__ import annotations

import ast
from pathlib import Path

import hybridnorm

SRC = Path(hybridnorm.__file__).parent
MAX_LINES = 400

# Lowest first; a module may import its own layer and the layers below, never one above. Each entry is a
# module or package prefix; a module belongs to its longest matching prefix ("hybridnorm" alone: the
# package's __init__ only). Why this order:
LAYERS: list[tuple[str, str]] = [
    ("hybridnorm.errors", "the exception every layer raises"),
    ("hybridnorm.leftovers", "the temporaries a killed writer leaves, named by host and pid (stdlib only)"),
    ("hybridnorm.plain_data", "the one JSON reader and the nesting limit of every JSON/YAML document"),
    ("hybridnorm.config_text", "reading config text: safe YAML with unique keys, JSON, the depth/size limits"),
    ("hybridnorm.config_base", "the one config mechanism: typed dataclass fields checked from their hints"),
    ("hybridnorm.placements", "placements as data: block specs, the name registry/grammar, equations"),
    ("hybridnorm.nn", "the model; it reads a ModelConfig object but never imports hybridnorm.config"),
    ("hybridnorm.config", "ModelConfig validates placements and builds (imports) the TransformerLM"),
    ("hybridnorm", "the package facade re-exports config, nn and placements"),
    ("hybridnorm.data", "corpus, tokenizer and token files (errors only)"),
    ("hybridnorm.diagnostics", "forward hooks on nn modules, parameter-group norms; no training loop"),
    ("hybridnorm.train", "trainer, checkpoints, optimizer, and train.run: opening a run folder"),
    ("hybridnorm.hf", "HF classes, stock weight maps, export/import of runs (opens runs via train.run)"),
    ("hybridnorm.loading", "load_run opens a run OR an HF folder, so it sits above both"),
    ("hybridnorm.eval", "scoring, perplexity and lm-eval on a loaded run"),
    ("hybridnorm.experiments", "grids of training runs, verdicts and reports"),
    ("hybridnorm.cli_parser", "the command line's options and help; the commands are passed in"),
    ("hybridnorm.generate_command", "the generate command: prompts in, texts or records out"),
    ("hybridnorm.cli", "the command line: may import everything"),
]

# Cycles in files this change could not touch (owned elsewhere), each to be fixed and then deleted here:
# the test fails if one disappears, so this list never goes stale.
KNOWN_CYCLES: set[frozenset[str]] = set()

# Private names imported across packages in files this change could not touch; same rule as above.
KNOWN_PRIVATE_IMPORTS: set[tuple[str, str]] = set()


def _modules() -> dict[str, Path]:
    mods = {}
    for path in SRC.rglob("*.py"):
        parts = list(path.relative_to(SRC.parent).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts.pop()
        mods[".".join(parts)] = path
    return mods


MODULES = _modules()


def _is_package(module: str) -> bool:
    return MODULES[module].name == "__init__.py"


def _imports(module: str) -> list[tuple[str, str | None]]:
    """(imported module path, name imported from it or None) for every import statement of ``module``."""
    tree = ast.parse(MODULES[module].read_text(encoding="utf-8"))
    package = module if _is_package(module) else module.rpartition(".")[0]
    out: list[tuple[str, str | None]] = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            out += [(alias.name, None) for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:  # relative: from .x import y
                anchor = package.split(".")[: len(package.split(".")) - node.level + 1]
                base = ".".join(anchor + ([base] if base else []))
            out += [(base, alias.name) for alias in node.names]
    return out


def _resolve(name: str) -> str | None:
    """The hybridnorm module ``name`` refers to (itself or its longest existing prefix), or None."""
    while name and name not in MODULES:
        name = name.rpartition(".")[0]
    return name or None


def _graph() -> dict[str, set[str]]:
    edges: dict[str, set[str]] = {m: set() for m in MODULES}
    for m in MODULES:
        for base, name in _imports(m):
            if not (base == "hybridnorm" or base.startswith("hybridnorm.")):
                continue
            target = f"{base}.{name}" if name and f"{base}.{name}" in MODULES else base
            resolved = _resolve(target)
            if resolved is not None and resolved != m:
                edges[m].add(resolved)
    return edges


def _cycles(edges: dict[str, set[str]]) -> list[frozenset[str]]:
    """Strongly connected components of more than one module (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[frozenset[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in sorted(edges[v]):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = set()
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.add(w)
                if w == v:
                    break
            if len(component) > 1:
                found.append(frozenset(component))

    for v in sorted(edges):
        if v not in index:
            visit(v)
    return found


def layer_of(module: str) -> int:
    best, best_len = -1, -1
    for i, (prefix, _) in enumerate(LAYERS):
        matches = module == prefix or (prefix != "hybridnorm" and module.startswith(prefix + "."))
        if matches and len(prefix) > best_len:
            best, best_len = i, len(prefix)
    return best


def test_graph_is_read():
    edges = _graph()
    assert len(MODULES) > 40
    assert "hybridnorm.nn.model" in edges["hybridnorm.config"]  # ModelConfig.build's function-level import
    assert "hybridnorm.hf.export" in edges["hybridnorm.loading"]  # a lazy import for an optional extra


def test_no_import_cycles():
    cycles = set(_cycles(_graph()))
    new = cycles - KNOWN_CYCLES
    assert not new, "import cycles: " + "; ".join(" <-> ".join(sorted(c)) for c in new)
    fixed = KNOWN_CYCLES - cycles
    assert not fixed, f"these cycles are gone, delete them from KNOWN_CYCLES: {fixed}"


def test_every_module_has_a_layer():
    unplaced = [m for m in MODULES if layer_of(m) < 0]
    assert not unplaced, f"modules in no layer (add them to LAYERS): {unplaced}"
    assert len({p for p, _ in LAYERS}) == len(LAYERS)


def test_nothing_imports_a_higher_layer():
    bad = [f"{m} ({LAYERS[layer_of(m)][0]}) imports {t} ({LAYERS[layer_of(t)][0]})"
           for m, targets in _graph().items() for t in sorted(targets) if layer_of(t) > layer_of(m)]
    assert not bad, "imports of a higher layer:\n" + "\n".join(bad)


def _top_package(module: str) -> str:
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else ""


def test_no_private_names_imported_across_packages():
    found = set()
    for m in MODULES:
        for base, name in _imports(m):
            if not (base == "hybridnorm" or base.startswith("hybridnorm.")):
                continue
            target = f"{base}.{name}" if name and name != "*" else base
            private = any(part.startswith("_") and not part.startswith("__") for part in target.split(".")[1:])
            if private and _top_package(_resolve(base) or base) != _top_package(m):
                found.add((m, target))
    new = found - KNOWN_PRIVATE_IMPORTS
    assert not new, f"private names imported across packages: {sorted(new)}"
    fixed = KNOWN_PRIVATE_IMPORTS - found
    assert not fixed, f"these private imports are gone, delete them from KNOWN_PRIVATE_IMPORTS: {fixed}"


def test_no_source_file_over_400_lines():
    long = {str(p.relative_to(SRC.parent)): n for p in MODULES.values()
            if (n := len(p.read_text(encoding="utf-8").splitlines())) > MAX_LINES}
    assert not long, f"source files over {MAX_LINES} lines: {long}"
