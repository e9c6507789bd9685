"""The code versions a run records (``hybridnorm.train.provenance``): the git commit of the source folder
and whether its tracked files were modified, checked against a throwaway git repository; None for both
outside a checkout or without git; and the trainer's meta record carries them."""

from __future__ import annotations

import os
import shutil
import subprocess

import pytest
import torch
from train_helpers import read_metrics

import hybridnorm
from hybridnorm.train import provenance
from hybridnorm.train.provenance import code_versions, describe, describe_hardware, hardware
from hybridnorm.train.trainer import train

needs_git = pytest.mark.skipif(shutil.which("git") is None, reason="no git program")


def _git(repo, *args: str) -> str:
    env = {"GIT_AUTHOR_NAME": "t", "GIT_AUTHOR_EMAIL": "t@t", "GIT_COMMITTER_NAME": "t",
           "GIT_COMMITTER_EMAIL": "t@t", "PATH": "/usr/bin:/bin:/usr/local/bin", "HOME": str(repo)}
    return subprocess.run(["git", *args], cwd=repo, env=env, check=True, capture_output=True, text=True).stdout


def _one_commit_checkout(tmp_path):
    """A throwaway repository with one commit of pkg/a.py; returns (repo, pkg)."""
    repo, pkg = tmp_path / "repo", tmp_path / "repo" / "pkg"
    pkg.mkdir(parents=True)
    (pkg / "a.py").write_text("x = 1\n")
    _git(repo, "init", "-q")
    _git(repo, "add", "pkg/a.py")
    _git(repo, "commit", "-q", "-m", "one")
    return repo, pkg


@needs_git
def test_commit_and_dirty_flag_of_a_checkout(tmp_path):
    repo, pkg = _one_commit_checkout(tmp_path)
    first = _git(repo, "log", "-1", "--format=%H").strip()
    clean = code_versions(pkg)
    assert clean["git_commit"] == first and clean["git_dirty"] is False
    assert clean["hybridnorm"] == hybridnorm.__version__ and clean["torch"] == torch.__version__

    (pkg / "a.py").write_text("x = 2\n")  # a tracked file changed: dirty
    (repo / "untracked.txt").write_text("")  # untracked files do not count
    code_versions.cache_clear()
    assert code_versions(pkg) == {**clean, "git_dirty": True}
    assert describe(code_versions(pkg)).startswith(f"hybridnorm {hybridnorm.__version__} @ {first[:8]} (modified)")
    code_versions.cache_clear()


@needs_git
def test_reading_the_commit_never_writes_in_the_checkout(tmp_path):
    """A run starting reads its checkout's state; it must not take .git/index.lock there (the user may be
    committing at that moment) nor rewrite the index, even when the index's stat data is stale, which
    makes a plain `git status` refresh and rewrite it. A lock held by someone else changes nothing either."""
    repo, pkg = _one_commit_checkout(tmp_path)
    index = repo / ".git" / "index"
    os.utime(pkg / "a.py", (1, 1))  # same content, new stat data: the index is stale
    before = (index.read_bytes(), index.stat().st_mtime_ns)
    code_versions.cache_clear()
    assert code_versions(pkg)["git_dirty"] is False
    assert (index.read_bytes(), index.stat().st_mtime_ns) == before
    (repo / ".git" / "index.lock").write_bytes(b"")  # a user's `git commit` in progress
    code_versions.cache_clear()
    assert code_versions(pkg)["git_dirty"] is False and (repo / ".git" / "index.lock").read_bytes() == b""
    code_versions.cache_clear()


def test_no_checkout_or_no_git_gives_none(tmp_path, monkeypatch):
    monkeypatch.setenv("GIT_CEILING_DIRECTORIES", str(tmp_path.parent))  # whatever holds tmp_path is no checkout
    code_versions.cache_clear()
    assert code_versions(tmp_path)["git_commit"] is None and code_versions(tmp_path)["git_dirty"] is None
    code_versions.cache_clear()
    monkeypatch.setenv("PATH", str(tmp_path))  # no git program at all
    assert code_versions(tmp_path / "x")["git_commit"] is None
    code_versions.cache_clear()
    assert describe(None) == "not recorded"


def test_the_run_records_its_code_versions(make_cfg, tmp_path):
    train(make_cfg(tmp_path / "run", "--max_steps=1"), quiet=True)
    (meta,) = read_metrics(tmp_path / "run", "meta")
    assert meta["code"] == code_versions()
    assert meta["code"]["hybridnorm"] == hybridnorm.__version__



def test_the_run_records_the_hardware_that_ran_it(make_cfg, tmp_path):
    """The meta record names the device kind, the CPU's model name (read here from /proc/cpuinfo by a
    regular expression, apart from the code's line parser), one process, and this process's threads."""
    import re
    from pathlib import Path

    train(make_cfg(tmp_path / "run", "--max_steps=1", "--device=cpu"), quiet=True)
    (meta,) = read_metrics(tmp_path / "run", "meta")
    cpuinfo = Path("/proc/cpuinfo")
    found = re.search(r"^model name\s*:\s*(.+)$", cpuinfo.read_text(), re.M) if cpuinfo.is_file() else None
    name = found.group(1).strip() if found else meta["hardware"]["name"]
    assert meta["hardware"] == {"device": "cpu", "name": name, "processes": 1, "threads": torch.get_num_threads()}


def test_hardware_without_cpuinfo_and_its_report_line(tmp_path, monkeypatch):
    monkeypatch.setattr(provenance, "_CPUINFO", tmp_path / "absent")
    monkeypatch.setattr(provenance.platform, "processor", lambda: "")
    assert hardware(torch.device("cpu"), 4)["name"] is None  # nothing known: None, never a guess
    threads = torch.get_num_threads()
    assert describe_hardware(hardware(torch.device("cpu"), 4)) == f"4 × cpu unknown model ({threads} threads)"
    (tmp_path / "cpuinfo").write_text("processor\t: 0\nmodel name\t: Some CPU @ 2.0GHz\nflags\t: sse\n")
    monkeypatch.setattr(provenance, "_CPUINFO", tmp_path / "cpuinfo")
    assert hardware(torch.device("cpu"))["name"] == "Some CPU @ 2.0GHz"
    gpu = {"device": "cuda", "name": "NVIDIA H100 80GB HBM3", "processes": 8, "threads": 4}
    assert describe_hardware(gpu) == "8 × cuda NVIDIA H100 80GB HBM3" and describe_hardware(None) == "not recorded"


def test_outside_a_checkout_git_says_nothing_on_the_terminal(tmp_path, capfd):
    """`hybridnorm eval RUN` from an installed package must not print git's `fatal: not a git repository`."""
    code_versions.cache_clear()
    try:
        versions = code_versions(tmp_path)
    finally:
        code_versions.cache_clear()
    assert versions["git_commit"] is None and versions["git_dirty"] is None
    out, err = capfd.readouterr()
    assert "fatal" not in out + err and err == ""
