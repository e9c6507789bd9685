"""The one reader of JSON (and the depth and size rules of YAML): plain data, nested at most :data:`MAX_DEPTH`
deep; a YAML document also expands to at most :data:`MAX_VALUES` values (its aliases counted as copies).

Every JSON text hybridnorm reads from disk goes through :func:`loads` — config files, a Hugging Face
folder's ``config.json`` and shard index, ``tokenizer.json``, JSONL corpora and multiple-choice files,
``metrics.jsonl``, cache sidecars, lock files — and every YAML document through :func:`check_depth`
(``config_base.parse_text``). Why one limit instead of catching ``RecursionError`` where each file is read:
a document just under the interpreter's limit parses, then overflows the first recursive consumer (a deep
copy, a YAML dump, the type checker), far from the file; and the reader's own overflow depends on how
deep the stack already is. A fixed limit makes the answer the same everywhere: one ``ValueError`` whose
message says what is wrong, which each caller turns into its one ``error:`` line naming the file.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from typing import Any

# Far above anything hybridnorm reads or writes (configs, tokenizers and records nest < 10 deep), below
# serde_json's 128 (so the tokenizers library never meets a deeper file), and far below Python's recursion
# limit (so what passes can be deep-copied, dumped and type-checked recursively).
MAX_DEPTH = 100
# Values a YAML document may expand to, counting every use of an alias (&a / *a) as a copy: a config holds
# hundreds; an alias bomb (nine levels of ten aliases each: 40 lines, 10^9 values) would hang and exhaust
# memory in the first consumer that walks or prints it (a copy, a merge, an error message's repr).
MAX_VALUES = 100_000


class NestingError(ValueError):
    """A document nested deeper than :data:`MAX_DEPTH` (or with a reference cycle, which YAML can make), or
    one whose YAML aliases expand it past :data:`MAX_VALUES` values."""


def check_depth(value: Any, limit: int = MAX_DEPTH) -> None:
    """Raise :class:`NestingError` if containers in ``value`` nest deeper than ``limit``. Iterative, one
    level at a time over distinct containers, so a YAML alias bomb (a DAG) costs its distinct nodes, not
    its expansion, and a cycle stops at the limit."""
    level = [value] if isinstance(value, (dict, list, tuple)) else []
    depth = 0
    while level:
        depth += 1
        if depth > limit:
            raise NestingError(f"nested deeper than {limit} levels")
        seen: dict[int, Any] = {}
        for node in level:
            children = node.values() if isinstance(node, dict) else node
            for child in children:
                if isinstance(child, (dict, list, tuple)):
                    seen[id(child)] = child
        level = list(seen.values())


def check_size(value: Any, limit: int = MAX_VALUES) -> None:
    """Raise :class:`NestingError` if ``value`` expands to more than ``limit`` values (containers and
    scalars, each alias use counted as a copy). Counts each distinct container once, so the check itself
    costs the document's nodes, not its expansion. Call it after :func:`check_depth` (no cycles left)."""
    sizes: dict[int, int] = {}

    def size(node: Any) -> int:  # recursion bounded by check_depth's limit
        if not isinstance(node, (dict, list, tuple)):
            return 1
        if id(node) not in sizes:
            children = node.values() if isinstance(node, dict) else node
            sizes[id(node)] = min(1 + sum(size(c) for c in children), limit + 1)
        return sizes[id(node)]

    if size(value) > limit:
        raise NestingError(f"it expands to more than {limit:,} values (YAML aliases reused that often)")


def loads(text: str | bytes, *, object_pairs_hook: Callable[[list[tuple[str, Any]]], Any] | None = None) -> Any:
    """``json.loads`` with the depth limit. Raises ``ValueError`` (a ``json.JSONDecodeError`` for bad
    syntax, a :class:`NestingError` for nesting) with a one-line message; nothing else."""
    if isinstance(text, bytes):
        text = text.decode("utf-8")  # UnicodeDecodeError is a ValueError too
    try:
        value = json.loads(text, object_pairs_hook=object_pairs_hook)
    except RecursionError:  # deeper than the stack allows: the same answer as the limit below
        raise NestingError(f"nested deeper than {MAX_DEPTH} levels") from None
    # fewer brackets than the limit cannot nest past it: skips the walk for almost every line
    if text.count("[") + text.count("{") > MAX_DEPTH:
        check_depth(value)
    return value


def describe_error(e: Exception) -> str:
    """A :func:`loads` failure in one line, without the document itself."""
    if isinstance(e, json.JSONDecodeError):
        return f"not valid JSON ({e.msg} at line {e.lineno} column {e.colno})"
    if isinstance(e, UnicodeDecodeError):
        return f"not UTF-8 text (byte {e.start})"
    return " ".join(str(e).split())
