"""The code versions a run records (``hybridnorm.train.provenance``): the git commit of the source folder
and whether its tracked files were modified, checked against a throwaway git repository; None for both
outside a checkout or without git; and the trainer's meta record carries them."""

from __future__ import annotations

import shutil
import subprocess

import pytest
import torch
from train_helpers import read_metrics

import hybridnorm
from hybridnorm.train.provenance import code_versions, describe
from hybridnorm.train.trainer import train

needs_git = pytest.mark.skipif(shutil.which("git") is None, reason="no git program")


def _git(repo, *args: str) -> str:
    env = {"GIT_AUTHOR_NAME": "t", "GIT_AUTHOR_EMAIL": "t@t", "GIT_COMMITTER_NAME": "t",
           "GIT_COMMITTER_EMAIL": "t@t", "PATH": "/usr/bin:/bin:/usr/local/bin", "HOME": str(repo)}
    return subprocess.run(["git", *args], cwd=repo, env=env, check=True, capture_output=True, text=True).stdout


@needs_git
def test_commit_and_dirty_flag_of_a_checkout(tmp_path):
    repo, pkg = tmp_path / "repo", tmp_path / "repo" / "pkg"
    pkg.mkdir(parents=True)
    (pkg / "a.py").write_text("x = 1\n")
    _git(repo, "init", "-q")
    _git(repo, "add", "pkg/a.py")
    _git(repo, "commit", "-q", "-m", "one")
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
