"""The one config mechanism: typed dataclass fields, checked in one place.

Every config section (``ModelConfig``, ``OptimConfig``, ``TrainConfig`` …) is a dataclass deriving from
:class:`Config`. Its type hints ARE the schema: on construction each field is checked against its hint
(``int``, ``float``, ``bool``, ``str``, ``Literal[...]`` choices, ``X | None``, ``tuple[...]``, a nested
section), then against the bounds declared with :func:`bounded`, then the section's own cross-field
``check()``. So a wrong value anywhere — a YAML file, a ``--key=value`` override, a Python call — fails
the same way: one :class:`~hybridnorm.errors.ConfigError` naming the dotted field and what it accepts.

Config text is read by :mod:`hybridnorm.config_text` (YAML's *safe* loader: no tags that build objects, no
``eval``).
"""

from __future__ import annotations

import contextlib
import copy
import dataclasses
import functools
import json
import math
import operator
import reprlib
import types
import typing
from pathlib import Path
from typing import Any, Literal, TypeVar

import yaml

from hybridnorm.config_text import parse_text, read_file
from hybridnorm.errors import ConfigError

C = TypeVar("C", bound="Config")
_BOUNDS = {"ge": (operator.ge, ">="), "gt": (operator.gt, ">"), "le": (operator.le, "<="), "lt": (operator.lt, "<")}


_SHOW = reprlib.Repr()  # keyword arguments only from Python 3.12
_SHOW.maxlevel, _SHOW.maxdict, _SHOW.maxlist, _SHOW.maxtuple, _SHOW.maxset = 3, 6, 6, 6, 6
_SHOW.maxstring, _SHOW.maxlong, _SHOW.maxother = 120, 60, 120
SHOW_CHARS = 400


def show(value: Any) -> str:
    """``repr(value)`` for an error message, cut short for a long string or a big container: an error must
    not print a large value whole, nor walk all of it (reprlib stops at a few items per level)."""
    text = _SHOW.repr(value)
    return text if len(text) <= SHOW_CHARS else text[:SHOW_CHARS - 4] + " ..."


def bounded(default: Any, *, ge: float | None = None, gt: float | None = None, le: float | None = None,
            lt: float | None = None) -> Any:
    """A numeric field with its valid range, e.g. ``batch_size: int = bounded(16, ge=1)``."""
    bounds = {k: v for k, v in (("ge", ge), ("gt", gt), ("le", le), ("lt", lt)) if v is not None}
    return dataclasses.field(default=default, metadata={"bounds": bounds})


@functools.cache
def _hints(cls: type) -> dict[str, Any]:
    return typing.get_type_hints(cls)


def field_names(cls: type) -> list[str]:
    return [f.name for f in dataclasses.fields(cls)]


def check_fields(where: str, d: dict[str, Any], cls: type) -> None:
    """Refuse keys that are not fields of the dataclass ``cls``, naming the valid ones."""
    names = field_names(cls)
    for key in d:
        if key not in names:
            raise ConfigError(f"{where}: unknown field {key!r}; valid fields: {', '.join(sorted(names))}")


def describe(tp: Any) -> str:
    """What a type hint accepts, in words, for error messages."""
    origin, args = typing.get_origin(tp), typing.get_args(tp)
    if origin is Literal:
        return "one of " + ", ".join(map(repr, args))
    if origin in (typing.Union, types.UnionType):
        return " or ".join(describe(a) for a in args)
    if origin is tuple:
        return f"a list of {len(args)}" if args[-1] is not Ellipsis else "a list"
    if origin is list:
        return f"a list of ({describe(args[0])})" if args else "a list"
    if tp is type(None):
        return "null"
    if dataclasses.is_dataclass(tp):
        return f"a section with fields {', '.join(field_names(tp))}"
    return {int: "an integer", float: "a finite number", bool: "true or false", str: "a string"}.get(
        tp, getattr(tp, "__name__", str(tp)))


def coerce(where: str, value: Any, tp: Any) -> Any:
    """``value`` checked against the type hint ``tp`` (and converted where lossless: an int or a numeric
    string to float, a list to tuple, a mapping to a dataclass); ConfigError naming ``where`` otherwise."""
    origin, args = typing.get_origin(tp), typing.get_args(tp)
    if origin in (typing.Union, types.UnionType):
        if value is None and type(None) in args:
            return None
        for option in args:  # in declaration order: `float | str` tries the number first
            if option is type(None):
                continue
            if isinstance(value, dict) and dataclasses.is_dataclass(option):
                return coerce(where, value, option)  # a mapping is meant as this section: its own error
            try:
                return coerce(where, value, option)
            except ConfigError:
                continue
        raise ConfigError(f"{where}={show(value)} must be {describe(tp)}")
    if origin is Literal:
        if value in args and type(value) in {type(a) for a in args}:  # True is not 1
            return value
        raise ConfigError(f"{where}={show(value)} is not {describe(tp)}")
    if origin is list:  # a list of one kind (transformers' config fields: eos_token_id, architectures)
        if not isinstance(value, (list, tuple)):
            raise ConfigError(f"{where}={show(value)} must be {describe(tp)}")
        return [coerce(f"{where}[{i}]", v, args[0]) for i, v in enumerate(value)] if args else list(value)
    if origin is tuple:
        if not isinstance(value, (list, tuple)):
            raise ConfigError(f"{where}={show(value)} must be {describe(tp)}")
        if args and args[-1] is Ellipsis:
            return tuple(coerce(f"{where}[{i}]", v, args[0]) for i, v in enumerate(value))
        if len(value) != len(args):
            raise ConfigError(f"{where}={show(value)} must be {describe(tp)}")
        return tuple(coerce(f"{where}[{i}]", v, a) for i, (v, a) in enumerate(zip(value, args, strict=True)))
    if dataclasses.is_dataclass(tp):
        if isinstance(value, tp):
            return value
        if isinstance(value, dict):
            return from_mapping(tp, value, where)
        raise ConfigError(f"{where}={show(value)} must be {describe(tp)}")
    if tp is float:
        if isinstance(value, str):  # YAML 1.1 reads "1e-3" as a string
            try:
                value = float(value)
            except ValueError:
                raise ConfigError(f"{where}={show(value)} must be a finite number") from None
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            if not math.isfinite(value):
                raise ConfigError(f"{where}={show(value)} must be a finite number")
            return float(value)
        raise ConfigError(f"{where}={show(value)} must be a finite number")
    if tp is int:
        if isinstance(value, int) and not isinstance(value, bool):
            return value
        if isinstance(value, float) and value.is_integer():  # 1e3 in YAML is a float
            return int(value)
        raise ConfigError(f"{where}={show(value)} must be an integer")
    if tp in (bool, str):
        if isinstance(value, str) and not is_utf8(value):  # bytes that are not UTF-8, from argv or a path
            raise ConfigError(f"{where}={show(value)} is not valid UTF-8 text")
        if isinstance(value, tp):
            return value
        raise ConfigError(f"{where}={show(value)} must be {describe(tp)}")
    if tp is Any or tp is dict or typing.get_origin(tp) is dict:
        return value
    raise TypeError(f"config field {where}: unsupported type hint {tp!r}")  # a bug in a config class


def is_utf8(text: str) -> bool:
    """Whether ``text`` encodes as UTF-8: Python decodes command-line bytes that are not UTF-8 into lone
    surrogates, which no file (config.yaml) or tokenizer can take."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        return False
    return True


def check_bounds(where: str, value: Any, bounds: dict[str, float]) -> None:
    if value is None:  # an optional field left unset
        return
    if not all(_BOUNDS[k][0](value, bound) for k, bound in bounds.items()):
        # an integer bound in full (2**32 - 1 is 4294967295, not 4.29497e+09); a float one short
        rule = " and ".join(f"{_BOUNDS[k][1]} {bound if isinstance(bound, int) else format(bound, 'g')}"
                            for k, bound in bounds.items())
        raise ConfigError(f"{where}={show(value)} must be {rule}")


def from_mapping(cls: type, d: Any, where: str) -> Any:
    """Build the dataclass ``cls`` from a mapping: unknown keys refused, every field type-checked."""
    if not isinstance(d, dict):
        raise ConfigError(f"{where or 'config'}: expected a section (mapping of fields), got "
                          f"{type(d).__name__} {show(d)}")
    check_fields(where or "config", d, cls)
    missing = [f.name for f in dataclasses.fields(cls) if f.name not in d and f.default is dataclasses.MISSING
               and f.default_factory is dataclasses.MISSING]
    if missing:
        raise ConfigError(f"{where or 'config'}: missing required field(s) {', '.join(missing)}")
    if issubclass(cls, Config):
        return cls(**d)  # its validate() checks every field, naming it by the section's own labels
    hints = _hints(cls)
    return cls(**{k: coerce(_join(where, k), v, hints[k]) for k, v in d.items()})


def typed_fields(obj: Any, where: str, *, canonical: bool = False) -> None:
    """Check each field of the dataclass ``obj`` against its type hint as ``from_mapping`` does (a dataclass does
    not check its annotations: ``in_norm="no"`` acts as true), writing nothing; ``canonical``: write back the lossless
    conversions instead (2 -> 2.0, list -> tuple), for a frozen spec's ``__post_init__``: canonical from the start."""
    hints = _hints(type(obj))
    for f in dataclasses.fields(obj):
        if not canonical:
            coerce(_join(where, f.name), getattr(obj, f.name), hints[f.name])
        else:  # a field with no lossless form stays as given: its validate(where) refuses it by its name
            with contextlib.suppress(ConfigError):
                object.__setattr__(obj, f.name, coerce(f.name, getattr(obj, f.name), hints[f.name]))


def _join(where: str, name: str) -> str:
    return f"{where}.{name}" if where else name


def _plain(value: Any) -> Any:
    """Builtins only (dicts, lists, numbers, strings): what YAML/JSON round-trip."""
    if isinstance(value, Config):
        return value.to_dict()
    if dataclasses.is_dataclass(value) and hasattr(value, "to_dict"):
        return value.to_dict()
    if isinstance(value, (list, tuple)):
        return [_plain(v) for v in value]
    if isinstance(value, dict):
        return {k: _plain(v) for k, v in value.items()}
    return value


def _section_of(tp: Any) -> Any:
    """The config dataclass a field's type hint holds (``X``, ``X | None``), or None for a plain value."""
    return next((a for a in (tp, *typing.get_args(tp)) if dataclasses.is_dataclass(a)), None)


class Config:
    """Base of every config section. Subclasses are ``@dataclass`` es; ``SECTION`` is their dotted name
    in the train config ("" at the top), so messages read like the overrides a user types."""

    SECTION: typing.ClassVar[str] = ""

    def __post_init__(self) -> None:
        self.validate()

    def check(self) -> None:
        """Cross-field rules of this section (override; raise ConfigError)."""

    @classmethod
    def label(cls, name: str) -> str:
        """How messages name the field ``name``: its dotted override path."""
        return _join(cls.SECTION, name)

    def validate(self: C) -> C:
        """Type-check and range-check every field, then the section's ``check()``."""
        hints = _hints(type(self))
        for f in dataclasses.fields(self):  # type: ignore[arg-type]
            where = self.label(f.name)
            value = coerce(where, getattr(self, f.name), hints[f.name])  # a mapping becomes its section
            object.__setattr__(self, f.name, value)
            check_bounds(where, value, f.metadata.get("bounds", {}))
        self.check()
        return self

    # -- dicts, YAML, JSON, files ----------------------------------------------------------------

    @classmethod
    def from_dict(cls: type[C], d: Any) -> C:
        return from_mapping(cls, d, cls.SECTION)

    def to_dict(self) -> dict[str, Any]:
        return {f.name: _plain(getattr(self, f.name)) for f in dataclasses.fields(self)}  # type: ignore[arg-type]

    def to_yaml(self) -> str:
        return yaml.safe_dump(self.to_dict(), sort_keys=False, allow_unicode=True)

    def to_json(self) -> str:
        return json.dumps(self.to_dict(), indent=2, ensure_ascii=False)

    @classmethod
    def from_yaml(cls: type[C], text: str) -> C:
        return cls.from_dict(parse_text(text, "yaml"))

    @classmethod
    def from_json(cls: type[C], text: str) -> C:
        return cls.from_dict(parse_text(text, "json"))

    @classmethod
    def load(cls: type[C], path: str | Path, overrides: list[str] | None = None) -> C:
        """Read a ``.yaml``/``.yml``/``.json`` file, then apply ``--key=value`` overrides."""
        return cls.from_data(read_file(path), overrides, source=path)

    @classmethod
    def from_data(cls: type[C], data: dict[str, Any], overrides: list[str] | None = None,
                  source: str | Path | None = None) -> C:
        """``data`` (read from the file ``source``) with the overrides applied. An error names the file
        when the fault lies in it, i.e. when the file's own data is invalid too; an option naming no field is
        the option's fault whatever the file holds (a typo used to be reported as the file's own error)."""
        for item in overrides or []:
            key, sep, _ = item.lstrip("-").partition("=")
            if sep:
                cls.check_key(key, f"option --{key}")
        try:
            return cls.from_dict(cls.apply_overrides(data, overrides or []))
        except ConfigError:
            if source is None:
                raise
            try:
                cls.from_dict(data)
            except ConfigError as in_file:
                raise ConfigError(f"config file {source}: {in_file}") from None
            raise

    def save(self, path: str | Path) -> None:
        path = Path(path)
        path.write_text(self.to_json() if path.suffix == ".json" else self.to_yaml(), encoding="utf-8")

    # -- dotted overrides ------------------------------------------------------------------------

    @classmethod
    def check_key(cls, key: str, where: str) -> Any:
        """Refuse a dotted key (``optim.lr``) that is no field of this config, naming the valid fields of the
        section it goes wrong in; ``where`` names what the user typed (``option --optim.lrr``, ``--knob lrr``).
        Returns the config section the key names (``model``; ``model.moe``, a section or null), None for a
        field that takes a plain value (``optim.lr``; ``model.placement``, a name or a spec)."""
        parts = key.replace("-", "_").split(".")
        section: Any = cls
        tp: Any = None
        for i, part in enumerate(parts):
            here = ".".join(parts[:i]) or "train config"
            if section is None:
                raise ConfigError(f"{where}: {here} has no sub-fields")
            check_fields(f"{where}: {here}", {part: None}, section)
            tp = _hints(section)[part]
            section = _section_of(tp)
        plain = [a for a in typing.get_args(tp) if a is not type(None) and not dataclasses.is_dataclass(a)
                 and a is not dict and typing.get_origin(a) is not dict]
        return None if typing.get_origin(tp) in (typing.Union, types.UnionType) and plain else section

    @classmethod
    def apply_overrides(cls, data: dict[str, Any], overrides: list[str]) -> dict[str, Any]:
        """``data`` with ``key.sub=value`` strings applied. Each key is checked against the fields (a typo
        names the valid ones); a value is read with YAML's safe loader, except for string fields, which
        take the text as typed (``--out_dir=123`` is a folder named 123)."""
        data = copy.deepcopy(data)
        for item in overrides:
            key, sep, raw = item.lstrip("-").partition("=")
            if not sep:
                raise ConfigError(f"option {item!r} needs a value: write --{key}=VALUE")
            cls.check_key(key, f"option --{key}")
            parts = key.replace("-", "_").split(".")
            section: Any = cls
            node = data
            for i, part in enumerate(parts):
                tp = _hints(section)[part]
                if i == len(parts) - 1:
                    node[part] = _parse_value(raw, tp)
                    break
                if node.get(part) is None:  # a missing (or null) section: its defaults + this field
                    node[part] = _default_of(section, part)
                elif not isinstance(node[part], dict):  # a value given where the section goes (model: 5 in a
                    # file, --model=1 or a grid's --axis model=1,2 before it) was once replaced by the section's
                    # defaults here without a word: a default-sized model trained in place of the one asked for
                    label = ".".join(parts[:i + 1])
                    raise ConfigError(f"option --{key}: {label}={show(node[part])} is a value, not a section of "
                                      f"fields, so {label}.{parts[i + 1]} cannot be set in it")
                node = node[part]
                section = _section_of(tp)
        return data


def _default_of(section: type, name: str) -> dict[str, Any]:
    f = next(f for f in dataclasses.fields(section) if f.name == name)
    value = f.default_factory() if f.default_factory is not dataclasses.MISSING else f.default
    return value.to_dict() if isinstance(value, Config) else {}


def _parse_value(raw: str, tp: Any) -> Any:
    if tp is str or (typing.get_origin(tp) is Literal and all(isinstance(a, str) for a in typing.get_args(tp))):
        return raw
    if raw == "":
        return ""
    try:
        return parse_text(raw, "yaml")
    except ConfigError:  # not YAML: the plain string (the field's type check says if that is wrong)
        return raw


def flatten_config(d: dict[str, Any], prefix: str = "") -> dict[str, Any]:
    """A nested config dict as {dotted field: value} (the placement, a dict itself, stays one value)."""
    out: dict[str, Any] = {}
    for k, v in d.items():
        if isinstance(v, dict) and k != "placement":
            out.update(flatten_config(v, f"{prefix}{k}."))
        else:
            out[f"{prefix}{k}"] = v
    return out


def config_differences(a: dict[str, Any], b: dict[str, Any], common_only: bool = False) -> list[str]:
    """Dotted config fields whose values differ between two config dicts (the names only). ``common_only``
    ignores fields only one of them has (a field added to the config since the run was made)."""
    fa, fb = flatten_config(a), flatten_config(b)
    keys = fa.keys() & fb.keys() if common_only else fa.keys() | fb.keys()
    return sorted(k for k in keys if fa.get(k) != fb.get(k))
