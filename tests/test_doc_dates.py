"""The dates the README and docs give ("before 2026-11-26 ...") are of changes already made: none is later
than today. Two notes of 2026-12-02 said 'before 2026-12-03', a day that had not come."""

from __future__ import annotations

import datetime
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
DATE = re.compile(r"\b(20\d\d)-(\d\d)-(\d\d)\b")


def _documents() -> list[Path]:
    return [ROOT / "README.md", *sorted((ROOT / "docs").rglob("*.md")), *sorted((ROOT / "benchmarks").rglob("*.md"))]


def test_no_document_gives_a_date_after_today() -> None:
    today = datetime.date.today()
    later = [f"{path.relative_to(ROOT)}:{n}: {m.group(0)}"
             for path in _documents() if path.is_file()
             for n, line in enumerate(path.read_text(encoding="utf-8").splitlines(), 1)
             for m in DATE.finditer(line)
             if datetime.date(*map(int, m.groups())) > today]
    assert not later, later
