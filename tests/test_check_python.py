"""``make train`` / ``make test`` first run ``tools/check_python.py``: on a Python older than the one
``constraints.txt`` was pinned on (whose releases need it), one error line and exit 2 before pip runs,
instead of pip's "ResolutionImpossible"."""

from __future__ import annotations

import importlib.util
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "tools" / "check_python.py"
spec = importlib.util.spec_from_file_location("check_python", SCRIPT)
check_python = importlib.util.module_from_spec(spec)
spec.loader.exec_module(check_python)

HEADER = "# hybridnorm's test environment, pinned 2026-11-26 on Python 3.11 by\nnumpy==2.4.6\n"


def test_the_real_constraints_file_names_the_python_it_was_pinned_on() -> None:
    """The guard is alive: the header tools/pin_constraints.py writes is the one it reads, and this suite's
    own Python passes it when it is the pinned one or newer (`make test`), and is refused when older (the
    suite also runs unpinned on an older Python: README, "The two commands")."""
    text = (ROOT / "constraints.txt").read_text(encoding="utf-8")
    pinned = check_python.pinned_python(text)
    assert pinned is not None and pinned >= (3, 10)
    here_ok = tuple(sys.version_info[:2]) >= pinned[:2]
    assert (check_python.problem(tuple(sys.version_info), text, "constraints.txt") is None) == here_ok
    writer = (ROOT / "tools" / "pin_constraints.py").read_text(encoding="utf-8")
    assert 'pinned {datetime.date.today()} on Python {py} by' in writer


@pytest.mark.parametrize(("version", "refused"), [((3, 10, 13), True), ((3, 9, 0), True), ((3, 11, 0), False),
                                                  ((3, 12, 1), False), ((4, 0, 0), False)])
def test_an_older_python_is_refused_naming_both_versions_and_the_way_out(version: tuple, refused: bool) -> None:
    message = check_python.problem(version, HEADER, "constraints.txt")
    assert (message is not None) == refused
    if refused:
        have = ".".join(map(str, version))
        assert f"Python {have}" in message and "Python 3.11 or newer" in message
        assert "PY=python3.11" in message and "constraints.txt" in message


def test_a_constraints_file_that_names_no_python_is_not_guessed_at() -> None:
    assert check_python.problem((3, 8, 0), "numpy==2.4.6\n", "mine.txt") is None
    assert check_python.problem((3, 8, 0), "numpy==2.4.6\n# pinned x on Python 3.11\n", "mine.txt") is None


def test_the_script_exits_0_here_and_2_with_one_error_line_for_an_unreadable_file(tmp_path: Path) -> None:
    """Exit 0 and silence on the pinned Python or a newer one; on an older one, one error line and 2."""
    pinned = check_python.pinned_python((ROOT / "constraints.txt").read_text(encoding="utf-8"))
    ok = subprocess.run([sys.executable, str(SCRIPT), str(ROOT / "constraints.txt")], capture_output=True, text=True)
    if tuple(sys.version_info[:2]) >= pinned[:2]:
        assert ok.returncode == 0 and ok.stderr == "" and ok.stdout == ""
    else:
        assert ok.returncode == 2 and ok.stderr.count("\n") == 1 and ok.stderr.startswith("error: this is Python")
    bad = subprocess.run([sys.executable, str(SCRIPT), str(tmp_path / "missing.txt")], capture_output=True, text=True)
    assert bad.returncode == 2 and bad.stderr.count("\n") == 1 and bad.stderr.startswith("error: cannot read")


@pytest.mark.skipif(shutil.which("make") is None, reason="make not on PATH")
def test_make_stops_before_pip_on_an_older_python(tmp_path: Path) -> None:
    """Through the Makefile as users run it: with constraints pinned on a Python newer than this one, the
    install target stops at the check, and make never echoes (so never runs) its pip line."""
    newer = f"{sys.version_info[0]}.{sys.version_info[1] + 1}"
    constraints = tmp_path / "constraints.txt"
    constraints.write_text(f"# hybridnorm's test environment, pinned 2099-01-01 on Python {newer} by\n",
                           encoding="utf-8")
    run = subprocess.run(["make", "-C", str(ROOT), "install", f"PY={sys.executable}", f"CONSTRAINTS={constraints}"],
                         capture_output=True, text=True)
    assert run.returncode != 0
    errors = [line for line in run.stderr.splitlines() if line.startswith("error:")]
    assert len(errors) == 1 and f"Python {newer} or newer" in errors[0]
    assert "check_python.py" in run.stdout and "-m pip install" not in run.stdout
