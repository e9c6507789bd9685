"""Refuse, before ``make`` installs anything, a Python older than the one ``constraints.txt`` was pinned on.

``make train`` / ``make test`` install every package at the release the suite last passed with, and those
releases need that Python or newer (numpy 2.4, scipy 1.17 and pandas 3 need 3.11): on an older one pip fails
deep in its resolver with "ResolutionImpossible". This says so in one line instead, and what to do.

    python tools/check_python.py constraints.txt     # exit 0, or 2 with one error line
"""

from __future__ import annotations

import re
import sys
from pathlib import Path

HEADER = re.compile(r"pinned \S+ on Python (\d+)\.(\d+)")  # the first line tools/pin_constraints.py writes


def pinned_python(text: str) -> tuple[int, int] | None:
    """The Python version a constraints file says it was pinned on, or None if it does not say."""
    match = HEADER.search(text.split("\n", 1)[0])
    return (int(match.group(1)), int(match.group(2))) if match else None


def problem(version: tuple[int, ...], constraints: str, where: str) -> str | None:
    """The error for running ``make`` on Python ``version`` with these constraints, or None if it may run."""
    pinned = pinned_python(constraints)
    if pinned is None or tuple(version[:2]) >= pinned:
        return None
    have, need = ".".join(map(str, version[:3])), ".".join(map(str, pinned))
    return (f"this is Python {have}, but {where} pins the releases the suite passed with on Python {need}, "
            f"which need Python {need} or newer: run make with PY=python{need} (or a newer Python), "
            "or install without the pins: pip install -e .")


def main(argv: list[str]) -> int:
    path = Path(argv[0] if argv else "constraints.txt")
    try:
        text = path.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as e:
        print(f"error: cannot read {path}: {e}", file=sys.stderr)
        return 2
    message = problem(tuple(sys.version_info), text, str(path))
    if message:
        print(f"error: {message}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
