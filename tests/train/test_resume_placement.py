"""``train --resume`` compares the placement it is given with the run's as the spec it builds, not as text.

The names are case-insensitive, have aliases and grammar spellings (docs/placements.md), and a spec of one's own
may be written with its defaults spelt out or its Q/K/V/C letters in any order: each of those is the run's own
model, and resuming with it used to be refused as "a different model" (``'hybridnorm_star' -> 'HybridNorm*'``).
A new name for one's own spec is allowed and logged, and so is a spec written otherwise that builds the same blocks
(compared as built: ``Placement.built``); one that builds anything else is refused, naming the blocks and the fields
that differ in them, before the run folder is touched."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
from train_helpers import read_metrics

from hybridnorm import placements
from hybridnorm.errors import ConfigError
from hybridnorm.train.trainer import train

PRE = {"in_norm": True}
MINE = {"name": "mine",
        "block": {"attn": {**PRE, "out_norm": True}, "ffn": {**PRE, "skip": "normed"}, "qkv_norm": "QK"},
        "overrides": [{"block": {"attn": PRE, "ffn": PRE, "qkv_norm": "QKV"}, "first_n": 1}], "init": "deepnorm"}


def _placement(spec: dict) -> str:
    return f"--model.placement={json.dumps(spec)}"  # a YAML flow mapping, as a user types it on the command line


def _changes(run: Path) -> list[str]:
    return [f for e in read_metrics(run, "event") if e["event"] == "config_changed_on_resume" for f in e["fields"]]


def _files(run: Path) -> dict[str, bytes]:
    return {p.relative_to(run).as_posix(): p.read_bytes() for p in sorted(run.rglob("*")) if p.is_file()}


@pytest.fixture
def star_run(make_cfg, tmp_path) -> Path:
    out = tmp_path / "star"
    train(make_cfg(out, "--max_steps=2", "--ckpt_interval=2", "--model.placement=hybridnorm_star"), quiet=True)
    return out


@pytest.fixture
def mine_run(make_cfg, tmp_path) -> Path:
    out = tmp_path / "mine"
    train(make_cfg(out, "--max_steps=2", "--ckpt_interval=2", _placement(MINE)), quiet=True)
    return out


@pytest.mark.parametrize("spelling", ["HybridNorm*", "hybrid_star", "HYBRIDNORM-STAR",
                                      pytest.param(json.dumps(placements.get("hybridnorm_star").to_dict()),
                                                   id="the-preset-written-out")])
def test_another_spelling_of_a_presets_name_resumes_the_run(make_cfg, star_run, spelling):
    result = train(make_cfg(star_run, "--max_steps=3", f"--model.placement={spelling}"), resume=True, quiet=True)
    assert result.step == 3
    assert _changes(star_run) == ["max_steps"]  # no placement change: the same spec


@pytest.mark.parametrize("spelling", [
    pytest.param({**MINE, "block": {**MINE["block"], "qkv_norm": "kq"}}, id="letters-kq"),  # the letters are a set
    pytest.param(placements.Placement.from_dict(MINE).to_dict(), id="defaults-written-out"),  # as config.json has it
])
def test_another_spelling_of_ones_own_spec_resumes_the_run(make_cfg, mine_run, spelling):
    assert train(make_cfg(mine_run, "--max_steps=3", _placement(spelling)), resume=True, quiet=True).step == 3
    assert _changes(mine_run) == ["max_steps"]


def test_a_new_name_or_default_init_for_ones_own_spec_is_allowed_and_logged(make_cfg, mine_run):
    renamed = {**MINE, "name": "mine_v2", "init": "megatron"}  # init draws fresh weights: a resume draws none
    assert train(make_cfg(mine_run, "--max_steps=3", _placement(renamed)), resume=True, quiet=True).step == 3
    (event,) = [e for e in read_metrics(mine_run, "event") if e["event"] == "config_changed_on_resume"]
    assert event["fields"] == ["max_steps", "model.placement"]
    assert event["values"]["model.placement"] == [MINE, renamed]


# the tiny model has 2 blocks: MINE's block 1 is its override, block 2 its own block
@pytest.mark.parametrize("spec", [
    pytest.param({**MINE, "overrides": [*MINE["overrides"], {"block": MINE["block"], "first_n": 2}]},
                 id="an-override-equal-to-the-block-it-replaces"),
    pytest.param({**MINE, "overrides": [{"block": MINE["overrides"][0]["block"], "first_fraction": 0.5}]},
                 id="first_fraction-covering-the-same-blocks"),  # ⌊0.5·2⌋ = 1, as first_n=1
    pytest.param({**MINE, "overrides": [{**MINE["overrides"][0], "block": {**MINE["overrides"][0]["block"],
                                                                          "depth_scaled_norms": True}}]},
                 id="a-field-its-block-ignores"),  # LayerNorm Scaling's 1/√l is 1 in block 1
])
def test_a_spec_written_otherwise_that_builds_the_same_blocks_resumes_the_run_and_is_logged(make_cfg, mine_run, spec):
    """Each was refused as "a different model", its spec fields compared, though the model it builds, parameter
    for parameter and function for function, is the run's own."""
    assert train(make_cfg(mine_run, "--max_steps=3", _placement(spec)), resume=True, quiet=True).step == 3
    (event,) = [e for e in read_metrics(mine_run, "event") if e["event"] == "config_changed_on_resume"]
    assert event["fields"] == ["max_steps", "model.placement"] and event["values"]["model.placement"] == [MINE, spec]


@pytest.mark.parametrize(("spec", "named"), [
    pytest.param({**MINE, "block": {**MINE["block"], "qkv_norm": "QKV"}}, r"block 2: qkv_norm: 'QK' -> 'QKV'$",
                 id="letters"),
    pytest.param({**MINE, "overrides": []}, r"block 1: attn\.out_norm: False -> True, ffn\.skip: 'input' -> "
                                            r"'normed', qkv_norm: 'QKV' -> 'QK'$", id="no-override"),
    pytest.param("hybridnorm_star", r"which computes otherwise: block 2: attn\.in_norm: True -> False, "
                                    r"attn\.out_norm: True -> False, qkv_norm: 'QK' -> 'QKV'$", id="a-preset"),
    pytest.param({**MINE, "block": {**MINE["block"], "qkv_norm_scope": "full"},
                  "overrides": [{**MINE["overrides"][0], "block": {**MINE["overrides"][0]["block"],
                                                                   "qkv_norm_scope": "full"}}]},
                 r"otherwise: blocks 1-2: qkv_norm_scope: 'head' -> 'full'$", id="every-block"),
    pytest.param({**MINE, "final_norm": False}, r"otherwise: final_norm: True -> False$", id="model-level"),
])
def test_a_spec_that_computes_otherwise_is_refused_naming_its_fields(make_cfg, mine_run, spec, named):
    before = _files(mine_run)
    option = f"--model.placement={spec}" if isinstance(spec, str) else _placement(spec)
    with pytest.raises(ConfigError, match=r"cannot resume .* as a different model \(model\.placement: the spec named "
                                          r"'mine' -> .*, which computes otherwise: ") as e:
        train(make_cfg(mine_run, "--max_steps=3", option), resume=True, quiet=True)
    assert re.search(named, str(e.value).split("; recorded in")[0])
    assert _files(mine_run) == before
