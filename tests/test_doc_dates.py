"""The dates the README and docs give ("before 2026-11-26 ...") are of changes already made: none is later
than the newest commit. Two notes of 2026-12-02 said 'before 2026-12-03', a day that had not come."""

from __future__ import annotations

import datetime
import re
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
DATE = re.compile(r"\b(20\d\d)-(\d\d)-(\d\d)\b")


def _documents() -> list[Path]:
    return [ROOT / "README.md", *sorted((ROOT / "docs").rglob("*.md")), *sorted((ROOT / "benchmarks").rglob("*.md"))]


def _newest_commit_date() -> datetime.date | None:
    """The committer date of HEAD: a date every note was written by. Not the clock: a machine whose clock is
    behind (a CI runner, a container) would find every note 'in the future'."""
    try:
        out = subprocess.run(["git", "-C", str(ROOT), "log", "-1", "--format=%cs"], capture_output=True, text=True,
                             timeout=30, check=True).stdout.strip()
        return datetime.date.fromisoformat(out)
    except (OSError, subprocess.SubprocessError, ValueError):
        return None


def test_no_document_gives_a_date_after_its_newest_commit() -> None:
    newest = _newest_commit_date()
    if newest is None:
        pytest.skip("not a git checkout (or no git): no commit date to hold the notes' dates against")
    later = [f"{path.relative_to(ROOT)}:{n}: {m.group(0)}"
             for path in _documents() if path.is_file()
             for n, line in enumerate(path.read_text(encoding="utf-8").splitlines(), 1)
             for m in DATE.finditer(line)
             if datetime.date(*map(int, m.groups())) > newest]
    assert not later, later
