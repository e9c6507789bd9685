"""Reading config text: a YAML or JSON document as plain data, or one error line saying what is wrong.

YAML is read with a subclass of its *safe* loader (no tags that build objects, nothing evaluated) that also
refuses a key given twice; JSON through :func:`hybridnorm.plain_data.loads`. Both keep to the limits of
:mod:`hybridnorm.plain_data`: nesting at most ``MAX_DEPTH`` deep (an alias cycle too) and, for YAML, at most
``MAX_VALUES`` values once its aliases are expanded (an alias bomb).
"""

from __future__ import annotations

import typing
from pathlib import Path
from typing import Any

import yaml

from hybridnorm import plain_data
from hybridnorm.errors import ConfigError

__all__ = ["parse_text", "read_file"]


class _StrictYamlLoader(yaml.SafeLoader):
    """YAML's safe loader (no object-building tags) that refuses a key given twice in one mapping: the safe
    loader would keep the last value silently, so a config with two ``lr:`` lines trains with one of them and
    says nothing. Keys brought in by a merge (``<<: *defaults``) may still be overridden."""

    def construct_mapping(self, node: yaml.Node, deep: bool = False) -> dict[Any, Any]:
        if isinstance(node, yaml.MappingNode):
            seen: set[Any] = set()
            for key_node, _ in node.value:
                if key_node.tag == "tag:yaml.org,2002:merge":
                    continue
                key = self.construct_object(key_node, deep=True)
                if not isinstance(key, typing.Hashable):  # `? [a]`: a list or mapping as a key names no field
                    raise yaml.constructor.ConstructorError(None, None, f"a key must be a name, not {key!r}",
                                                            key_node.start_mark)
                if key in seen:
                    raise yaml.constructor.ConstructorError(None, None, f"duplicate key {key!r}", key_node.start_mark)
                seen.add(key)
        return super().construct_mapping(node, deep)


def _unique_keys(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    keys = [k for k, _ in pairs]
    dup = next((k for i, k in enumerate(keys) if k in keys[:i]), None)
    if dup is not None:
        raise ValueError(f"duplicate key {dup!r}")
    return dict(pairs)


def parse_text(text: str, kind: str) -> Any:
    """A config text (``kind`` "json" or "yaml") as Python data; ConfigError for anything that is not plain
    data: a syntax error, a key given twice, an object-building YAML tag, nesting too deep to read."""
    try:
        if kind == "json":
            return plain_data.loads(text, object_pairs_hook=_unique_keys)  # the depth limit included
        data = yaml.load(text, Loader=_StrictYamlLoader)  # a SafeLoader subclass: no object-building tags
        plain_data.check_depth(data)  # the same limit as JSON; also stops an alias cycle (&a [*a])
        plain_data.check_size(data)  # an alias bomb: a few lines that expand to 10^9 values
        return data
    except plain_data.NestingError as e:
        raise ConfigError(f"config is not valid {kind}: {e}") from None
    except (ValueError, yaml.YAMLError) as e:  # json.JSONDecodeError is a ValueError
        raise ConfigError(f"config is not valid {kind}: {' '.join(str(e).split())}") from None  # one line
    except RecursionError:  # YAML's composer recursing past the stack
        raise ConfigError(f"config is not valid {kind}: nested deeper than {plain_data.MAX_DEPTH} levels") from None


def read_file(path: str | Path, what: str = "config file") -> dict[str, Any]:
    """A config file's contents as a dict (an empty file is ``{}``); ConfigError naming the file otherwise
    (``what`` says what kind of file it is: a config file, a grid point file, ...). JSON for a ``.json``
    file, YAML (safe: no object-building tags) for anything else."""
    path = Path(path)
    try:
        text = path.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as e:
        raise ConfigError(f"cannot read {what} {path}: {e}") from None
    try:
        data = parse_text(text, "json" if path.suffix == ".json" else "yaml")
    except ConfigError as e:
        raise ConfigError(f"{what} {path}: {e}") from None
    if data is None:
        return {}
    if not isinstance(data, dict):
        raise ConfigError(f"{what} {path}: expected a mapping of fields at the top, got {type(data).__name__}")
    return data
