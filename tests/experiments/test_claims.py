"""The claim table's rules on synthetic run records: each status (supported, contradicted, inconclusive,
suggestive, untested) from data built to produce it, and the README being rewritten/checked in place."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from hybridnorm.experiments import claims


def _run(placement, lr, seed, val, verdict="trained", init="megatron", ratio=1.0, done=True, layers=None):
    knobs = {"optim.lr": lr} if layers is None else {"model.n_layers": layers}
    return {"placement": placement, "init": init, "knobs": knobs, "seed": seed, "verdict": verdict, "done": done,
            "final_val_loss": val, "grad_ratio_first_last": ratio}


def _study(root: Path, name: str, runs: list[dict]) -> None:
    (root / name).mkdir(parents=True, exist_ok=True)
    (root / name / "runs.json").write_text(json.dumps({"runs": runs}))


def _table(root: Path) -> dict[str, str]:
    """claim text -> status, from the generated markdown."""
    rows = [r.split(" | ") for r in claims.claim_table(root).splitlines() if r.startswith("| ") and "---" not in r]
    return {r[0].lstrip("| "): r[1] for r in rows[1:]}


def test_lower_loss_is_judged_at_each_placements_best_lr_with_a_paired_interval(tmp_path):
    runs = []
    for seed, noise in enumerate([0.0, 0.01, -0.01]):
        runs += [_run("pre", 1e-3, seed, 4.50 + noise), _run("pre", 2e-3, seed, 4.40 + noise),
                 _run("hybridnorm", 1e-3, seed, 4.30 + noise),  # its best lr: clearly below pre's best
                 _run("hybridnorm", 2e-3, seed, 6.1, "collapsed"),
                 _run("hybridnorm_star", 1e-3, seed, 4.45 + noise * 3),
                 _run("hybridnorm_star", 2e-3, seed, 4.41 - noise * 5)]  # ~ pre's best: inconclusive
    _study(tmp_path, claims.STUDY_A, runs)
    t = _table(tmp_path)
    assert t["hybridnorm reaches lower loss than Pre-Norm (init megatron)"] == "**supported**"
    assert t["hybridnorm_star reaches lower loss than Pre-Norm (init megatron)"] == "inconclusive"
    # no post_shifted runs: the stability claim needs them, so it is not judged at all
    assert not any(claim.startswith("hybridnorm trains at every lr") for claim in t)
    assert t["Post-Norm breaks with depth where HybridNorm trains"].startswith("untested")  # no study B


def test_contradicted_and_one_seed_is_only_suggestive(tmp_path):
    runs = [_run("pre", 1e-3, 0, 4.2), _run("hybridnorm", 1e-3, 0, 4.3), _run("hybridnorm_star", 1e-3, 0, 4.1),
            _run("post_shifted", 1e-3, 0, 4.25)]
    runs += [_run(p, 1e-3, s, v) for s in (1, 2) for p, v in (("pre", 4.2 + s / 100), ("post_shifted", 4.3))]
    _study(tmp_path, claims.STUDY_A, runs)
    t = _table(tmp_path)
    assert t["hybridnorm reaches lower loss than Pre-Norm (init megatron)"] == "suggestive against (1 seed)"
    assert t["hybridnorm_star reaches lower loss than Pre-Norm (init megatron)"] == "suggestive for (1 seed)"

    worse = [_run(p, 1e-3, s, v + s / 100) for s in range(3) for p, v in (("pre", 4.2), ("hybridnorm", 4.3))]
    _study(tmp_path, claims.STUDY_A, worse)
    assert _table(tmp_path)["hybridnorm reaches lower loss than Pre-Norm (init megatron)"] == "**contradicted**"


def test_stability_uses_only_lrs_every_placement_finished(tmp_path):
    runs = [_run(p, 1e-2, 0, 6.15, "collapsed") for p in ("hybridnorm", "hybridnorm_star", "post_shifted")]
    runs += [_run("pre", 1e-2, 0, 4.2), _run("pre", 1e-3, 0, 4.6)]  # pre also ran 1e-3: not compared
    runs += [_run("hybridnorm", 1e-3, 0, None, done=False)]
    _study(tmp_path, claims.STUDY_A, runs)
    t = _table(tmp_path)
    row = "hybridnorm trains at every lr Pre-Norm trains at, and where Post-Norm does not (init megatron)"
    assert t[row] == "**contradicted** (1 seed)"
    assert t["hybridnorm reaches lower loss than Pre-Norm (init megatron)"].startswith("untested so far")

    ok = [_run("pre", 1e-2, s, 4.2) for s in (0, 1)] + [_run("hybridnorm", 1e-2, s, 4.1) for s in (0, 1)]
    ok += [_run("hybridnorm_star", 1e-2, s, 4.1) for s in (0, 1)]
    ok += [_run("post_shifted", 1e-2, s, 6.1, "collapsed") for s in (0, 1)]
    _study(tmp_path, claims.STUDY_A, ok)
    assert _table(tmp_path)[row] == "**supported**"


@pytest.mark.parametrize(("post_ok", "hybrid_ok", "status"), [
    ({12: True, 24: True, 48: False}, {12: True, 24: True, 48: True}, "**supported**"),
    ({12: True, 24: True, 48: True}, {12: True, 24: True, 48: True}, "**contradicted**"),
    ({12: True, 24: True, 48: True}, {12: True, 24: False, 48: False}, "**contradicted**"),
])
def test_depth_claim(tmp_path, post_ok, hybrid_ok, status):
    runs = []
    for depth in (12, 24, 48):
        for s in (0, 1):
            runs.append(_run("post_shifted", 1e-3, s, 4.0, "trained" if post_ok[depth] else "diverged", layers=depth))
            runs.append(_run("hybridnorm", 1e-3, s, 4.0, "trained" if hybrid_ok[depth] else "stalled", layers=depth))
    _study(tmp_path, claims.STUDY_B, runs)
    assert _table(tmp_path)["Post-Norm breaks with depth where hybridnorm trains"] == status


def test_readme_table_is_rewritten_between_markers_and_checked(tmp_path):
    _study(tmp_path, claims.STUDY_A, [_run("pre", 1e-3, 0, 4.2)])
    readme = tmp_path / "README.md"
    readme.write_text(f"intro\n{claims.BEGIN}\nstale\n{claims.END}\noutro\n")
    assert claims.main([str(tmp_path), "--check"]) == 1
    assert "stale" in readme.read_text()  # --check never writes
    assert claims.main([str(tmp_path)]) == 0
    text = readme.read_text()
    assert text.startswith("intro\n") and text.endswith("outro\n") and "stale" not in text
    assert "from 1 finished runs of study A" in text
    assert claims.main([str(tmp_path), "--check"]) == 0


def test_study_tables_are_computed_from_the_runs_and_kept_in_step(tmp_path):
    """Each study's measurement table in the README is generated: a cell is the mean ± sample std of the
    finished seeds (hand-computed here) with their verdict counts; unfinished runs count only in the total;
    rows keep the grid's order; --check fails once a run record changes and the table was not rewritten."""
    from hybridnorm.experiments import study_tables

    runs = [_run("pre", 1e-3, 0, 4.0), _run("pre", 1e-3, 1, 4.2), _run("pre", 1e-3, 2, 4.4, done=False),
            _run("hybridnorm", 1e-3, 0, 6.15, verdict="collapsed"), _run("hybridnorm", 1e-3, 1, 4.1),
            _run("hybridnorm", 1e-2, 0, None, verdict="diverged")]
    _study(tmp_path, claims.STUDY_A, runs)
    begin, end = study_tables.markers(claims.STUDY_A)
    readme = tmp_path / "README.md"
    readme.write_text(f"{claims.BEGIN}\n{claims.END}\nA:\n{begin}\nstale\n{end}\n")
    assert claims.main([str(tmp_path), "--check"]) == 1
    assert claims.main([str(tmp_path)]) == 0
    text = readme.read_text()
    lines = text.split(begin)[1].split(end)[0].strip().splitlines()
    assert lines[0] == "| placement | init | lr 0.001 | lr 0.01 |"
    # pre at 1e-3: seeds 0 and 1 finished -> mean 4.1, std sqrt(((0.1)^2 * 2) / 1) = 0.1414
    assert lines[2] == "| pre | megatron | 4.100 ± 0.141 (n=2: 2 trained) | — |"
    assert lines[3] == ("| hybridnorm | megatron | 5.125 ± 1.450 (n=2: 1 trained, 1 collapsed) | "
                        "no val loss (n=1: 1 diverged) |")
    assert "5 finished runs of 6" in text and "stale" not in text
    assert claims.main([str(tmp_path), "--check"]) == 0
    runs[1]["final_val_loss"] = 4.3  # the data moved on; the README did not
    _study(tmp_path, claims.STUDY_A, runs)
    assert claims.main([str(tmp_path), "--check"]) == 1


def test_a_broken_table_block_is_one_error_naming_the_readme(tmp_path, capsys):
    from hybridnorm.experiments import study_tables

    _study(tmp_path, claims.STUDY_B, [_run("pre", None, 0, 4.0, layers=12)])
    begin, _ = study_tables.markers(claims.STUDY_B)
    readme = tmp_path / "README.md"
    readme.write_text(f"{claims.BEGIN}\n{claims.END}\n{begin}\nno end marker\n")
    assert claims.main([str(tmp_path)]) == 2
    err = capsys.readouterr().err
    assert str(readme) in err and "table:B_depth:end" in err and err.count("\n") == 1
    readme.write_text("no claims markers at all\n")
    assert claims.main([str(tmp_path), "--check"]) == 2
    assert "claims:begin" in capsys.readouterr().err


@pytest.mark.parametrize(("runs_json", "says"), [
    ('{"runs": [{"init": "megatron", "knobs": {}, "seed": 0, "done": true}]}', "no valid 'placement'"),
    ('{"runs": [{"placement": "pre", "init": "megatron", "knobs": {"optim.lr": "big"}, "seed": 0, '
     '"done": true, "verdict": "trained", "final_val_loss": 4.0}]}', "no valid 'knobs'"),
    ('{"runs": [{"placement": "pre", "init": "megatron", "knobs": {}, "seed": "0", "done": true}]}',
     "no valid 'seed'"),
    ('{"runs": [{"placement": "pre", "init": "megatron", "knobs": {}, "seed": 0, "done": true, '
     '"final_val_loss": "4.0"}]}', "no valid 'final_val_loss'"),
    ('{"runs": [7]}', "run record 0"),
    ('[1, 2]', "expected a mapping"),
])
def test_a_damaged_runs_json_is_one_error_naming_it(tmp_path, capsys, runs_json, says):
    """A hand-edited or truncated runs.json stops the claim check with one line naming the file, never a
    KeyError or ValueError traceback from deep inside the tables."""
    (tmp_path / claims.STUDY_A).mkdir()
    path = tmp_path / claims.STUDY_A / "runs.json"
    path.write_text(runs_json)
    (tmp_path / "README.md").write_text(f"{claims.BEGIN}\n{claims.END}\n")
    assert claims.main([str(tmp_path), "--check"]) == 2
    err = capsys.readouterr().err
    assert str(path) in err and says in err and err.count("\n") == 1
