"""``pip install .`` (a built wheel, not the editable install ``make`` makes): the wheel ships every file of
the package (the lm-eval task YAML/JSONL and hooks included, which only ``package-data`` brings), and the
installed console script runs from another folder, reading its task data from the installed copy."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PACKAGE = ROOT / "src" / "hybridnorm"


def _package_files() -> set[str]:
    """The package's files as a wheel names them (tracked files where git is at hand, else the tree)."""
    git = shutil.which("git")
    listed = subprocess.run([git, "-C", str(ROOT), "ls-files", "src/hybridnorm"], capture_output=True, text=True,
                            check=False) if git else None
    if listed is not None and listed.returncode == 0 and listed.stdout.strip():
        return {line.removeprefix("src/") for line in listed.stdout.splitlines()}
    return {"hybridnorm/" + p.relative_to(PACKAGE).as_posix() for p in PACKAGE.rglob("*")
            if p.is_file() and "__pycache__" not in p.parts and ".egg-info" not in str(p)}


@pytest.fixture(scope="module")
def wheel(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A wheel built the way ``pip install .`` builds one, from a copy (the build writes build/ and egg-info)."""
    src = tmp_path_factory.mktemp("source")
    for name in ("pyproject.toml", "README.md"):
        shutil.copy(ROOT / name, src / name)
    shutil.copytree(PACKAGE, src / "src" / "hybridnorm", ignore=shutil.ignore_patterns("__pycache__"))
    out = tmp_path_factory.mktemp("wheel")
    built = subprocess.run([sys.executable, "-m", "pip", "wheel", "-q", "--no-deps", "-w", str(out), str(src)],
                           capture_output=True, text=True, timeout=600)
    assert built.returncode == 0, built.stderr[-3000:]
    (found,) = out.glob("hybridnorm-*.whl")
    return found


def test_the_wheel_ships_every_file_of_the_package(wheel: Path) -> None:
    shipped = {n for n in zipfile.ZipFile(wheel).namelist() if n.startswith("hybridnorm/")}
    expected = _package_files()
    assert expected - shipped == set()
    assert any(n.endswith(".jsonl") for n in shipped) and any(n.endswith(".yaml") for n in shipped)


def test_the_installed_command_runs_from_another_folder_on_its_own_copy(wheel: Path, tmp_path: Path) -> None:
    # installed into a folder of its own, put first on the path: the dependencies stay this interpreter's
    # (a venv made from inside a venv would not see them), hybridnorm is the wheel's and not the editable one
    target = tmp_path / "installed"
    installed = subprocess.run([sys.executable, "-m", "pip", "install", "-q", "--no-deps", "--no-index", "--target",
                                str(target), str(wheel)], capture_output=True, text=True, timeout=300)
    assert installed.returncode == 0, installed.stderr[-3000:]
    env = {**os.environ, "PYTHONPATH": str(target)}
    where = tmp_path / "elsewhere"
    where.mkdir()
    probe = ("import hybridnorm; from hybridnorm.eval.tasks.kjv_mc.kjv_mc_data import DATA; "
             "print(hybridnorm.__file__); print(DATA); print(DATA.is_file())")
    shown = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, cwd=where, env=env,
                           timeout=300)
    assert shown.returncode == 0, shown.stderr[-3000:]
    module, data, exists = shown.stdout.split("\n")[:3]
    assert module.startswith(str(target)) and data.startswith(str(target)) and exists == "True", shown.stdout
    listed = subprocess.run([str(target / "bin" / "hybridnorm"), "placements"], capture_output=True, text=True,
                            cwd=where, env=env, timeout=300)
    assert listed.returncode == 0, listed.stderr[-3000:]
    assert "hybridnorm_star" in listed.stdout and "deepnorm" in listed.stdout
