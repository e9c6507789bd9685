"""The exception types user-facing code raises for bad input and for a lost peer; the CLI prints each as
one line. Also the argument parser of every command, whose usage errors are such an exception."""

import argparse
import codecs
import re
import sys
import typing

ERROR_CHARS = 1000  # an error line's length at most: a path of 100k characters is not printed whole


def one_line(e: BaseException | str) -> str:
    """An error's text as the one line the commands print: whitespace joined, and a text longer than
    :data:`ERROR_CHARS` cut in its middle (its start says what failed, its end often the name that matters)."""
    text = " ".join(str(e).split())
    if len(text) <= ERROR_CHARS:
        return text
    cut = len(text) - ERROR_CHARS
    return f"{text[:ERROR_CHARS * 2 // 3]} ...({cut:,} characters left out)... {text[-(ERROR_CHARS // 3 - 40):]}"


class ConfigError(ValueError):
    """A configuration value is invalid. The message names the field and the valid choices."""


class CollectiveError(RuntimeError):
    """A collective of the process group failed on this rank: it waited past ``dist_timeout`` for another
    rank (stuck, or busy elsewhere), or another rank's process went away. Every waiting rank raises it within
    the timeout instead of hanging; the message names the rank and the cause."""


def write_failure(e: BaseException) -> str | None:
    """Why a write failed, in the OS's words ("No space left on device"), or None when ``e`` is not a failed
    write. safetensors reports I/O errors as its own ``SafetensorError``, whose text wraps the OS error; an
    error that wraps a failed write of ours (a checkpoint's) carries its reason as ``write_reason``."""
    if isinstance(e, OSError):
        return e.strerror or str(e)
    if isinstance(reason := getattr(e, "write_reason", None), str):
        return reason
    if type(e).__name__ == "SafetensorError":
        m = re.search(r"I/O error: (.+?) \(os error \d+\)", str(e))
        return m.group(1) if m else str(e)
    return None


class OneLineArgumentParser(argparse.ArgumentParser):
    """argparse whose usage errors are a ConfigError: one ``error:`` line and exit 2 like all bad input
    (argparse's own error() prints the usage block too, and exits from inside the parse)."""

    may_be_empty: typing.ClassVar[frozenset[str]] = frozenset({"prompt"})  # generate from no prompt at all

    def error(self, message: str) -> typing.NoReturn:
        raise ConfigError(f"{self.prog}: {message} (see {self.prog} --help)")

    def parse_known_args(self, args: typing.Any = None, namespace: typing.Any = None) -> typing.Any:
        """argparse's, then an empty value is refused (``--placement "$P"`` with P unset, a path ``""``):
        the commands used to read it as "not given" and go on with the default, or take ``""`` for the
        current folder."""
        parsed, extra = super().parse_known_args(args, namespace)
        for action in self._actions:
            value = getattr(parsed, action.dest, None)
            if action.dest not in self.may_be_empty and "" in (value if isinstance(value, (list, tuple)) else [value]):
                optional = action.option_strings and not action.required
                self.error(f"{'/'.join(action.option_strings) or action.dest} is empty (an unset shell variable?); "
                           f"give it a value{' or leave it out' if optional else ''}")
        return parsed, extra


_ESCAPE = "hybridnorm.escape"  # the error handler's name (codecs' registry is by name)


def _escape_unencodable(err: UnicodeError) -> tuple[str | bytes, int]:
    """Python's ``surrogateescape`` for the bytes of an undecodable file name (printed back as they were), its
    ``backslashreplace`` for any other character the output's encoding lacks (``‖∇‖`` to an ASCII terminal)."""
    if not isinstance(err, UnicodeEncodeError):
        raise err
    bad = err.object[err.start:err.end]
    if all(0xDC80 <= ord(c) <= 0xDCFF for c in bad):
        return codecs.lookup_error("surrogateescape")(err)
    return codecs.lookup_error("backslashreplace")(err)


def escape_unencodable_output() -> None:
    """Make stdout write what its encoding cannot hold as ``\\u2016``-style escapes, as stderr always does,
    instead of failing: under a non-UTF-8 locale (``LC_ALL=C`` with ``PYTHONUTF8=0``, a Latin-1 one) a print
    of an equation or ``‖∇‖`` raised UnicodeEncodeError, which ended ``hybridnorm placements`` with an
    ``error:`` line and ``gradprofile`` with a traceback. A UTF-8 stdout, or one replaced by a caller, is
    left alone."""
    stream = sys.stdout
    encoding = getattr(stream, "encoding", None) or "utf-8"
    try:
        utf = codecs.lookup(encoding).name.startswith("utf")
    except LookupError:
        return
    if utf or getattr(stream, "errors", None) not in ("strict", "surrogateescape") \
            or not hasattr(stream, "reconfigure"):
        return
    codecs.register_error(_ESCAPE, _escape_unencodable)  # idempotent: the same handler under one name
    stream.reconfigure(errors=_ESCAPE)
