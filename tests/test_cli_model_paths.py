"""What the commands that read a model say when the path given is not one: a path that does not exist is said
to be so, naming it and what it should be (``import`` said 'no config.json', the others 'no run folder or
checkpoint at', as if the path were there, holding the wrong thing)."""

from __future__ import annotations

from pathlib import Path

import pytest
from bad_input_helpers import assert_refused

RUN_PATHS = "(expected a run folder, a checkpoints/step_* folder or a local Hugging Face model folder)"


@pytest.mark.parametrize(("argv", "expected"), [
    (["import", "{missing}", "--out", "{tmp}/run"], "(expected a local Hugging Face model folder, one with a "
                                                    "config.json)"),
    (["export", "{missing}", "--to", "hf", "{tmp}/hf"], RUN_PATHS),
    (["generate", "{missing}", "--max-new-tokens", "1"], RUN_PATHS),
    (["eval", "{missing}"], RUN_PATHS),
    (["eval", "{missing}", "--text", "kjv"], RUN_PATHS),
    (["generate", "{missing}/checkpoints/step_5"], RUN_PATHS),
], ids=["import", "export", "generate", "eval", "eval-text", "generate-step"])
def test_a_path_that_does_not_exist_is_said_not_to(tmp_path: Path, capsys, argv: list[str], expected: str) -> None:
    if argv[0] in ("import", "export"):
        pytest.importorskip("transformers", reason="the hf extra (transformers) is not installed")
    missing = tmp_path / "nothere"
    argv = [a.format(missing=missing, tmp=tmp_path) for a in argv]
    line = assert_refused(argv, capsys, [], tmp_path)
    assert line == f"error: {argv[1]} does not exist {expected}"
    assert not any(tmp_path.iterdir())
