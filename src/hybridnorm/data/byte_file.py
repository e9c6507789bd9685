"""The byte tokenizer's ``tokenizer.json``: the one form it writes, and the check of a file that claims it.

The byte tokenizer (:class:`hybridnorm.data.tokenizer.ByteTokenizer`) has nothing learned or chosen: bytes
are ids 0..255 and ``<|endoftext|>`` is 256. Its file only says what it is, in the one form every release has
written: :data:`FIELDS`. A file marked ``"type": "hybridnorm-bytes"`` is read as that tokenizer whatever else
it says, so anything else it says must be what the byte tokenizer writes: another ``vocab_size`` or
``eot_id`` (a file edited by hand, another tokenizer's fields under our marker) would otherwise load as the
257-token tokenizer without a word, and data or a model made for the other numbers would go on with it.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from hybridnorm.errors import ConfigError

__all__ = ["FIELDS", "MARKER", "check", "is_byte_file"]

# in the order ByteTokenizer writes them (json.dumps keeps it): its fingerprint hashes that text
FIELDS: dict[str, Any] = {"type": "hybridnorm-bytes", "version": 1, "vocab_size": 257, "eot_id": 256}
MARKER: str = FIELDS["type"]
_SHOWN_KEYS = 5  # unknown keys named in the error at most (a file of thousands is named by its first few)
_SHOWN_CHARS = 80  # of one value or key: an error line must not carry a long string whole


def is_byte_file(head: Any) -> bool:
    """Whether a parsed ``tokenizer.json`` says it is the byte tokenizer's."""
    return isinstance(head, dict) and head.get("type") == MARKER


def check(head: dict[str, Any], file: str | Path) -> None:
    """Every field of a file marked as the byte tokenizer's is one it writes, with the value it writes (a
    number in a lossless form, 257.0 for 257, is that number); one ConfigError naming ``file`` and the first
    field that is not: an unknown key, a missing one, or another value."""
    what = f"tokenizer file {file}, marked as the byte tokenizer's (\"type\": \"{MARKER}\")"
    unknown = [key for key in head if key not in FIELDS]
    if unknown:
        named = ", ".join(_show(key) for key in unknown[:_SHOWN_KEYS])
        more = f" (and {len(unknown) - _SHOWN_KEYS} more)" if len(unknown) > _SHOWN_KEYS else ""
        raise ConfigError(f"{what}: unknown field{'s' if len(unknown) > 1 else ''} {named}{more}; the byte "
                          f"tokenizer writes only {', '.join(FIELDS)}")
    for name, value in FIELDS.items():
        if name not in head:
            raise ConfigError(f"{what}: field {name} is missing (the byte tokenizer writes {name}={value!r})")
        given = head[name] if name == "type" else _integer(head[name])
        if given is None:  # a string "257", true, a list: no vocabulary size or token id
            raise ConfigError(f"{what}: {name}={_show(head[name])} must be an integer (the byte tokenizer writes "
                              f"{name}={value!r})")
        if given != value:
            why = (f"this release reads version {value} only" if name == "version"
                   else f"the byte tokenizer's {name} is {value!r}, and no other can be")
            raise ConfigError(f"{what}: {name}={_show(head[name])}: {why}")


def _integer(value: Any) -> int | None:
    """``value`` as an integer where it is one (257, or 257.0 as JSON may spell it), else None (true is none:
    JSON's booleans are no numbers). The data layer keeps to the errors module: no config_base here."""
    if isinstance(value, bool):
        return None
    if isinstance(value, int):
        return value
    if isinstance(value, float) and value.is_integer():
        return int(value)
    return None


def _show(value: Any) -> str:
    text = repr(value)
    return text if len(text) <= _SHOWN_CHARS else text[:_SHOWN_CHARS - 4] + " ..."
