"""A grid run folder's files read back (``read_run``, ``run_grid``, the report) when they are damaged: each
damaged file is refused with one ConfigError that names it, never a traceback from deep inside a report,
and nothing in the folder is changed. A metrics line cut by a kill is still skipped, as the trainer's
resume purges it."""

from __future__ import annotations

import json
import tempfile
from pathlib import Path

import pytest
from fuzz_helpers import SETTINGS, json_values
from hypothesis import given
from hypothesis import strategies as st

from hybridnorm.errors import ConfigError
from hybridnorm.experiments.claims import main as claims_main
from hybridnorm.experiments.grid import Grid, run_grid
from hybridnorm.experiments.report import write_report
from hybridnorm.experiments.runs import read_run
from hybridnorm.train.config import TrainConfig

POINT = {"placement": "pre", "init": "megatron", "knobs": {"optim.lr": 0.001}, "seed": 0}
RECORDS = [{"kind": "meta", "step": 0, "init": "megatron", "unigram_entropy": 6.0, "params": 10},
           {"kind": "train", "step": 10, "loss": 5.0, "tokens": 100, "lr": 0.001},
           {"kind": "eval", "step": 10, "val_loss": 5.0, "val_tokens": 100},
           {"kind": "event", "step": 5, "event": "spike", "metric": "loss"}]


GRID = Grid(placements=["pre"], axes=[("optim.lr", [0.001])], inits=["megatron"]).validate()


def _good_run(root: Path) -> Path:
    """The finished run folder of GRID's one point, written by hand."""
    run = root / "runs" / GRID.points()[0].name
    run.mkdir(parents=True)
    config = TrainConfig().with_overrides(["--max_steps=10", "--optim.lr=0.001"]).to_dict()
    (run / "point.json").write_text(json.dumps({"point": POINT, "config": config}))
    (run / "metrics.jsonl").write_text("\n".join(map(json.dumps, RECORDS)) + "\n")
    (run / "done.json").write_text("{}")
    return run


def _snapshot(folder: Path) -> dict[str, bytes]:
    return {str(p.relative_to(folder)): p.read_bytes() for p in sorted(folder.rglob("*")) if p.is_file()}


def _read_or_refuse(run: Path, culprit: str) -> None:
    """read_run and a report of it either work or raise one ConfigError naming ``culprit``; the run folder is
    not changed either way."""
    before = _snapshot(run)
    try:
        rec = read_run(run)
    except ConfigError as e:
        assert str(run / culprit) in str(e) and "\n" not in str(e), str(e)
    else:
        write_report([rec], run.parent.parent, baseline="pre")  # the grid folder, as sweep writes it
    assert _snapshot(run) == before


def test_the_good_folder_reads(tmp_path):
    rec = read_run(_good_run(tmp_path))
    assert rec.done and rec.final_val_loss == 5.0 and len(rec.events) == 1 and rec.verdict.verdict == "trained"


@pytest.mark.parametrize(("culprit", "content", "message"), [
    ("point.json", b"\x00\xff{[", "cannot read grid point file"),
    ("point.json", b"{not json", "grid point file .* not valid json"),
    ("point.json", b"[1, 2]", "expected a mapping of fields at the top, got list"),
    ("point.json", b'{"point": {"placement": 3}}', r"expected \{'point'"),
    ("point.json", json.dumps({"point": POINT, "config": {"model": "x"}}).encode(), "model"),
    ("point.json", json.dumps({"point": POINT, "config": {"model": {"d_model": "big"}}}).encode(),
     "model.d_model='big' must be an integer"),
    ("point.json", b'{"point": 1, "point": 2}', "duplicate key 'point'"),
    ("point.json", json.dumps({"point": {**POINT, "placement": ""},  # found by the property test below
                               "config": TrainConfig().to_dict()}).encode(), "placement '' is not a preset"),
    ("point.json", b"[" * 100_000, "nested deeper than 100 levels"),
    ("metrics.jsonl", b"\x00\xff\n", "cannot read metrics file"),
    ("metrics.jsonl", b'{"kind": "train", "step": 3, "loss": "x"}\n', "line 1: train record field 'loss'"),
    ("metrics.jsonl", b'{"kind": "train", "step": "3", "loss": 1.0}\n', "'step' must be an integer"),
    ("metrics.jsonl", b'{"step": 1}\n', "needs a string 'kind'"),
    ("metrics.jsonl", b"5\n", "must be a JSON object, got int"),
    ("metrics.jsonl", b'{"kind": "meta", "step": 0, "unigram_entropy": "6"}\n', "'unigram_entropy' has the wrong type"),
    ("metrics.jsonl", b'{"kind": "meta", "step": 0, "code": {"git_commit": 7}}\n', "'code' has the wrong type"),
    ("metrics.jsonl", b'{"kind": "meta", "step": 0, "hardware": {"threads": 1.5}}\n', "'hardware' has the wrong type"),
    ("metrics.jsonl", b'{"kind": "meta", "step": 0, "hardware": "H100"}\n', "'hardware' has the wrong type"),
    ("divergence.json", b"\x00\xff", "cannot read divergence report"),
    ("divergence.json", b'"diverged"', "expected a mapping"),
])
def test_each_damaged_file_is_one_error_naming_it(tmp_path, culprit, content, message):
    run = _good_run(tmp_path)
    (run / culprit).write_bytes(content)
    before = _snapshot(run)
    with pytest.raises(ConfigError, match=message) as e:
        read_run(run)
    assert str(run / culprit) in str(e.value) and "\n" not in str(e.value)
    base = TrainConfig().with_overrides(["--max_steps=10"])
    if culprit == "point.json":  # the grid that owns the folder refuses to train it, before training anything
        with pytest.raises(ConfigError, match=message):
            run_grid(base, GRID, tmp_path)
    # its report leaves the run out, says why, and still reports the rest
    (rec,) = run_grid(base, GRID, tmp_path, train=False)
    record = rec.to_record(tmp_path)
    assert record["verdict"] is None and not record["done"]
    assert record["verdict_reason"].startswith("unreadable: ") and str(run / culprit) in record["verdict_reason"]
    assert _snapshot(run) == before


@pytest.mark.parametrize("content", [None, b'{"kind": "meta"', json.dumps(RECORDS[0]).encode() + b"\n",
                                     json.dumps(RECORDS[2]).encode() + b"\n"])
def test_a_finished_run_whose_log_is_lost_is_unreadable_not_stalled(tmp_path, content):
    """done.json with no training record to judge (the log deleted, cut to a torn line, or only meta/eval
    records): once judged 'stalled (no loss logged)', a verdict about the model that the files cannot
    support. Now it is left out of the verdicts, and the report's row says why."""
    run = _good_run(tmp_path)
    metrics = run / "metrics.jsonl"
    if content is None:
        metrics.unlink()
    else:
        metrics.write_bytes(content)
    with pytest.raises(ConfigError, match="yet the run is marked finished") as e:
        read_run(run)
    assert str(metrics) in str(e.value)
    (rec,) = run_grid(TrainConfig().with_overrides(["--max_steps=10"]), GRID, tmp_path, train=False)
    assert rec.to_record(tmp_path)["verdict"] is None
    text = write_report([rec], tmp_path, baseline="pre").read_text()
    row = next(x for x in text.splitlines() if x.startswith(f"| {run.name} "))
    assert "| *unreadable* |" in row and "yet the run is marked finished" in row
    assert "| stalled |" not in text and "no loss logged" not in text


def test_a_cut_last_line_is_skipped_not_refused(tmp_path):
    run = _good_run(tmp_path)
    with (run / "metrics.jsonl").open("a") as f:
        f.write('{"kind": "train", "step": 11, "lo')
    assert [r["step"] for r in read_run(run).train] == [10]


@SETTINGS
@given(value=json_values, kind=st.sampled_from(["train", "eval", "diag", "meta", "event"]),
       field=st.sampled_from(["x", "loss", "step", "val_loss", "unigram_entropy", "init", "code", "kind", None]))
def test_any_json_in_a_metrics_record(value, kind, field):
    """A record with any JSON value put into one of its fields, or as the whole line (field None)."""
    with tempfile.TemporaryDirectory() as tmp:
        run = _good_run(Path(tmp))
        record = value if field is None else {"kind": kind, "step": 7, field: value}
        with (run / "metrics.jsonl").open("a") as f:
            f.write(json.dumps(record) + "\n")
        _read_or_refuse(run, "metrics.jsonl")


@SETTINGS
@given(data=st.data())
def test_any_json_in_a_point_file(data):
    """point.json with one node of its point or config replaced by any JSON value, or replaced whole."""
    with tempfile.TemporaryDirectory() as tmp:
        _damaged_point_reads_or_is_refused(_good_run(Path(tmp)), data)


def _damaged_point_reads_or_is_refused(run: Path, data: st.DataObject) -> None:
    spec = json.loads((run / "point.json").read_text())
    where = data.draw(st.sampled_from(["whole", "point", "config", "model", "optim"]))
    value = data.draw(json_values)
    if where == "whole":
        spec = value
    elif where in ("point", "config"):
        spec[where][data.draw(st.sampled_from(sorted(spec[where])))] = value
    else:
        spec["config"][where][data.draw(st.sampled_from(sorted(spec["config"][where])))] = value
    (run / "point.json").write_text(json.dumps(spec))
    _read_or_refuse(run, "point.json")


def test_claims_tool_names_a_damaged_report(tmp_path, capsys):
    study = tmp_path / "A_lr_init_24_layers"
    study.mkdir()
    (study / "runs.json").write_text('{"runs": 5}')
    (tmp_path / "README.md").write_text("<!-- claims:begin -->\n<!-- claims:end -->\n")
    assert claims_main([str(tmp_path), "--check"]) == 2
    err = capsys.readouterr().err
    assert str(study / "runs.json") in err and "Traceback" not in err
