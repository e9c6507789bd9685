"""Reading runs back: metrics.jsonl records grouped by kind, the grid point that made the run, its verdict
and its one machine-readable record.

A grid run folder holds ``point.json`` (the grid point and the full train config it was trained with),
``done.json`` once training has ended (finished or stopped by the non-finite guard), ``failed.json`` when its
worker failed (the error; removed when the point is tried again), and everything the trainer writes
(``metrics.jsonl`` with its ``meta``/``train``/``eval``/``diag``/``event`` records, one ``meta`` per session,
``divergence.json``, checkpoints). What the run actually did (tokens per step, data, code per session) is
read by :mod:`.as_run`.
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from hybridnorm import plain_data
from hybridnorm.config_text import read_file
from hybridnorm.errors import ConfigError
from hybridnorm.experiments import as_run
from hybridnorm.experiments.verdict import Verdict, collapse_signals, judge
from hybridnorm.placements import registry
from hybridnorm.train.config import TrainConfig


@dataclass
class RunRecord:
    """What one training run left behind in its folder."""

    path: Path
    placement: str
    seed: int
    init: str = "paper"                                         # the grid's init axis value
    knobs: dict[str, Any] = field(default_factory=dict)         # dotted config key -> value of this point
    config: dict[str, Any] = field(default_factory=dict)        # the full train config (point.json)
    done: bool = False                                          # training ended (finished or diverged)
    meta: dict[str, Any] = field(default_factory=dict)          # the trainer's last "meta" record
    metas: list[dict[str, Any]] = field(default_factory=list)   # every session's, in order (a resume adds one)
    train: list[dict[str, Any]] = field(default_factory=list)   # kind "train", in step order
    eval: list[dict[str, Any]] = field(default_factory=list)    # kind "eval"
    diag: list[dict[str, Any]] = field(default_factory=list)    # kind "diag"
    events: list[dict[str, Any]] = field(default_factory=list)  # spikes and other events
    divergence: dict[str, Any] | None = None
    label: str = ""                                             # the report's name for the run's group
    ran_note: str = ""                                          # the report's [bracket]: ran apart from its cell
    problem: str | None = None                                  # why its files could not be read (see unreadable)
    failed: str | None = None                                   # its worker's error (failed.json), if it failed
    best_gain: float | None = None                              # peers' largest gain over unigram (set_peer_gains)

    @property
    def diverged(self) -> bool:
        return self.divergence is not None or any(not math.isfinite(r.get("loss", 0.0)) for r in self.train)

    @property
    def diverged_at(self) -> int | None:
        if self.divergence is not None:
            return int(self.divergence.get("step", -1))
        return next((r["step"] for r in self.train if not math.isfinite(r.get("loss", 0.0))), None)

    def _at_end(self, records: list[dict[str, Any]]) -> bool:
        """The last of ``records`` is at the run's last step (max_steps, where the config records it)."""
        end = self.config.get("max_steps")
        return bool(records) and not self.diverged and (not isinstance(end, int) or records[-1]["step"] == end)

    @property
    def final_loss(self) -> float:
        """The train loss at max_steps (NaN: diverged, or not there yet)."""
        return self.train[-1]["loss"] if self._at_end(self.train) else math.nan

    @property
    def final_val_loss(self) -> float:
        """The val loss at max_steps (NaN: diverged, or not there yet); :meth:`to_record` also keeps the
        last one logged, with its step."""
        return self.eval[-1]["val_loss"] if self._at_end(self.eval) else math.nan

    @property
    def last_step(self) -> int:
        return self.train[-1]["step"] if self.train else 0

    @property
    def n_layers(self) -> int:
        layers = self.config.get("model", {}).get("n_layers")
        if isinstance(layers, int):
            return layers
        last = self.diag[-1] if self.diag else {}
        return sum(1 for k in last if re.fullmatch(r"grad_norm/blocks\.\d+", k))

    @property
    def resolved_init(self) -> str:
        """The init scheme the model was really built with (the trainer's meta record)."""
        return str(self.meta.get("init", self.init))

    @property
    def verdict(self) -> Verdict:
        return judge(diverged=self.diverged, diverged_at=self.diverged_at,
                     final_val_loss=self.eval[-1]["val_loss"] if self.eval else None,
                     unigram_entropy=self.meta.get("unigram_entropy"),
                     first_train_loss=self.train[0]["loss"] if self.train else None,
                     final_train_loss=self.train[-1]["loss"] if self.train else None,
                     last_diag=self.diag[-1] if self.diag else None, n_layers=self.n_layers,
                     best_gain=self.best_gain)

    @property
    def budget(self) -> tuple:
        """What makes two runs' losses comparable (:func:`.as_run.budget`): steps, tokens per step as
        trained, the data read and the tokenizer."""
        return as_run.budget(self)

    @property
    def unigram_gain(self) -> float | None:
        """Nats by which the final val loss is below the unigram baseline (None: either is missing)."""
        u, v = self.meta.get("unigram_entropy"), self.final_val_loss
        ok = isinstance(u, (int, float)) and isinstance(v, (int, float)) and math.isfinite(v)
        return u - v if ok else None

    def diag_at(self, step: int) -> dict[str, Any] | None:
        """The diagnostics record collected at ``step``, or the nearest earlier one."""
        before = [r for r in self.diag if r["step"] <= step]
        return before[-1] if before else None

    def by_layer(self, record: dict[str, Any] | None, prefix: str) -> list[float]:
        """Values of ``<prefix>/blocks.<i>`` ordered by block index (empty if not collected)."""
        if record is None:
            return []
        pat = re.compile(re.escape(prefix) + r"/blocks\.(\d+)$")
        found = sorted((int(m.group(1)), v) for k, v in record.items() if (m := pat.match(k)))
        return [v for _, v in found]

    def to_record(self, root: Path | None = None) -> dict[str, Any]:
        """The run's one machine-readable record (the report's ``runs.json`` holds a list of them)."""
        cfg, optim, model = self.config, self.config.get("optim", {}), self.config.get("model", {})
        # a run still training has no verdict yet (its loss so far would read as stalled): null, and why
        v = self.verdict if self.done else None
        verdict, reason = ((v.verdict, v.reason) if v else
                           (None, f"failed: {self.failed}") if self.failed else
                           (None, f"unreadable: {self.problem}") if self.problem else
                           (None, f"unfinished: step {self.last_step} of {cfg.get('max_steps', '?')}"))
        # final_*: at max_steps only; the last logged losses, whatever their step, are kept beside them with it
        last_eval, last_train = (self.eval[-1] if self.eval else {}), (self.train[-1] if self.train else {})
        return {
            "run": str(self.path.relative_to(root)) if root else str(self.path),
            "placement": self.placement, "init": self.resolved_init, "init_axis": self.init,
            "knobs": self.knobs, "seed": self.seed, "verdict": verdict, "verdict_reason": reason,
            "done": self.done, "failed": self.failed is not None,
            "final_train_loss": _num(self.final_loss), "final_val_loss": _num(self.final_val_loss),
            "last_train_loss": _num(last_train.get("loss")), "last_train_step": last_train.get("step"),
            "last_val_loss": _num(last_eval.get("val_loss")), "last_val_step": last_eval.get("step"),
            "val_tokens": as_run.val_tokens(self), "tokens_per_step": as_run.tokens_per_step(self),
            "unigram_entropy": self.meta.get("unigram_entropy"), "data": (as_run.data_keys(self) or [None])[-1],
            "data_sha256": (as_run.session_values(self, "data_sha256") or [None])[-1],
            "tokens_seen": as_run.tokens_seen(self), "steps": self.last_step,
            "max_steps": cfg.get("max_steps"), "lr": optim.get("lr"), "warmup_steps": optim.get("warmup_steps"),
            "grad_clip": optim.get("grad_clip"), "n_layers": self.n_layers, "d_model": model.get("d_model"),
            "params": self.meta.get("params"), "precision": cfg.get("precision"),
            "diverged_at": self.diverged_at, "code": self.meta.get("code"),  # None: made before it was logged
            "hardware": self.meta.get("hardware"), "sessions": as_run.sessions(self),
            "config_changes": as_run.config_changes(self),  # train --resume with other settings
            **{k: _num(x) for k, x in collapse_signals(self.diag[-1] if self.diag else None, self.n_layers).items()},
        }


def set_peer_gains(runs: list[RunRecord]) -> None:
    """Give each finished run the largest unigram gain among the finished runs of its budget (the reference
    of the verdict's relative rule)."""
    best: dict[tuple, float] = {}
    for r in runs:
        g = r.unigram_gain if r.done else None
        if g is not None:
            best[r.budget] = max(g, best.get(r.budget, g))
    for r in runs:
        r.best_gain = best.get(r.budget)


def _num(x: Any) -> float | None:
    """JSON has no NaN/inf: they become null (the verdict says why)."""
    return float(x) if isinstance(x, (int, float)) and math.isfinite(x) else None


def read_point(path: Path) -> dict[str, Any]:
    """A grid point file (``point.json``): {"point": {placement, init, knobs, seed}, "config": {...}}, its
    config one that ``TrainConfig.from_dict`` accepts. ConfigError naming the file otherwise."""
    data = read_file(path, "grid point file")
    point, config = data.get("point"), data.get("config")
    ok = (isinstance(point, dict) and isinstance(config, dict) and isinstance(point.get("placement"), str)
          and isinstance(point.get("init"), str) and isinstance(point.get("knobs"), dict)
          and all(isinstance(v, (str, int, float, bool)) for v in point["knobs"].values())  # grid values
          and isinstance(point.get("seed"), int) and not isinstance(point.get("seed"), bool))
    if not ok:
        raise ConfigError(f"grid point file {path}: expected {{'point': {{'placement': str, 'init': str, "
                          "'knobs': {field: value}, 'seed': int}, 'config': {...}}; delete the run folder to redo it")
    try:
        TrainConfig.from_dict(config)  # the types and ranges the trainer checks, so no reader trips on them
        registry.get(point["placement"])  # the report writes its equations
    except ConfigError as e:
        raise ConfigError(f"grid point file {path}: {e}; delete the run folder to redo it") from None
    return data


def _metric_records(path: Path) -> list[dict[str, Any]]:
    """The records of a ``metrics.jsonl``. A line that is not JSON is skipped (a line cut by a kill: the
    trainer purges it on resume); a record of the wrong shape is refused naming the file and line."""
    try:
        text = path.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as e:
        raise ConfigError(f"cannot read metrics file {path}: {e}") from None
    records = []
    for n, line in enumerate(text.splitlines(), 1):
        try:
            r = plain_data.loads(line)
        except ValueError:
            continue
        problem = _record_problem(r)
        if problem:
            raise ConfigError(f"metrics file {path}, line {n}: {problem}")
        records.append(r)
    return records


def _is_number(x: Any) -> bool:
    return isinstance(x, (int, float)) and not isinstance(x, bool)


def _record_problem(r: Any) -> str | None:
    """Why ``r`` is not a record the trainer writes, or None: a JSON object with a string ``kind``, an
    integer ``step``, and numbers only in the measured kinds (train, eval, diag)."""
    if not isinstance(r, dict):
        return f"a record must be a JSON object, got {type(r).__name__}"
    if not isinstance(r.get("kind"), str):
        return "a record needs a string 'kind'"
    if "step" in r and not (isinstance(r["step"], int) and not isinstance(r["step"], bool)):
        return f"'step' must be an integer, got {r['step']!r}"
    if r["kind"] in ("train", "eval", "diag"):
        missing = next((k for k in _REQUIRED.get(r["kind"], ()) if k not in r), None)
        if missing is not None:
            return f"a {r['kind']} record needs {missing!r}"
        bad = next((k for k, v in r.items() if k != "kind" and not _is_number(v)), None)
        if bad is not None:
            return f"{r['kind']} record field {bad!r} must be a number, got {r[bad]!r}"
    if r["kind"] == "meta":
        bad = next((k for k, ok in _META_FIELDS.items() if k in r and not ok(r[k])), None)
        if bad is not None:
            return f"meta record field {bad!r} has the wrong type: {r[bad]!r}"
    return None


# the fields of the measured kinds that the readers index directly
_REQUIRED = {"train": ("step", "loss"), "eval": ("step", "val_loss"), "diag": ("step",)}


def _is_code(x: Any) -> bool:  # provenance.code_versions(): strings, and a bool or None for git_dirty
    return x is None or (isinstance(x, dict) and all(v is None or isinstance(v, (str, bool)) for v in x.values()))


def _is_hardware(x: Any) -> bool:  # provenance.hardware(): strings (or None) and whole numbers
    return x is None or (isinstance(x, dict) and all(v is None or isinstance(v, (str, int)) for v in x.values()))


# the meta record's fields that the readers use, and what each must be (the trainer's _log_header writes them)
_META_FIELDS = {"placement": lambda x: isinstance(x, str), "init": lambda x: isinstance(x, str),
                "precision": lambda x: isinstance(x, str), "params": _is_number, "unigram_entropy": _is_number,
                "bigram_entropy": lambda x: x is None or _is_number(x),
                "train_tokens_available": _is_number, "val_tokens_available": _is_number, "code": _is_code,
                "hardware": _is_hardware, "tokens_per_step": _is_number, "data_sha256": lambda x: isinstance(x, str)}


def _number_or_none(x: Any) -> bool:
    return x is None or _is_number(x)


def _is_knob(key: str, value: Any) -> bool:
    """Any JSON scalar; the two knobs the tables are drawn over (lr, depth) must be numbers."""
    if key in ("optim.lr", "model.n_layers"):
        return _is_number(value)
    return value is None or isinstance(value, (str, int, float, bool))


# the fields of a runs.json record that the claim and study tables read, and what each must be
_RECORD_FIELDS = {"placement": lambda x: isinstance(x, str), "init": lambda x: isinstance(x, str),
                  "seed": lambda x: isinstance(x, int) and not isinstance(x, bool),
                  "knobs": lambda x: isinstance(x, dict) and all(_is_knob(k, v) for k, v in x.items()),
                  "done": lambda x: isinstance(x, bool), "verdict": lambda x: x is None or isinstance(x, str),
                  "final_val_loss": _number_or_none, "grad_ratio_first_last": _number_or_none}


def read_report(path: Path) -> list[dict[str, Any]]:
    """The run records of a study's ``runs.json`` (``to_record``'s, as the report writes them); ConfigError
    naming the file (and the record and field) if it is not a report's."""
    runs = read_file(path, "report file").get("runs")
    if not isinstance(runs, list):
        raise ConfigError(f"report file {path}: expected an object with 'runs': a list of run records")
    for i, r in enumerate(runs):
        bad = next((k for k, ok in _RECORD_FIELDS.items() if not isinstance(r, dict) or not ok(r.get(k))), None)
        if bad is not None:
            have = r.get(bad) if isinstance(r, dict) else r
            raise ConfigError(f"report file {path}: run record {i} has no valid {bad!r} (got {have!r})")
    return runs


def read_run(path: str | Path, placement: str | None = None, seed: int | None = None, init: str | None = None,
             knobs: dict[str, Any] | None = None) -> RunRecord:
    """A run folder's record; placement, seed, init and knobs come from ``point.json`` when the grid wrote
    one, else from the arguments (a grid point not started yet). A file of the folder that cannot be read
    or is not of the trainer's shape is refused with a ConfigError naming it."""
    path = Path(path)
    point: dict[str, Any] = {}
    point_file = path / "point.json"
    if point_file.is_file():
        point = read_point(point_file)
    p = point.get("point", {})
    rec = RunRecord(path, p.get("placement", placement or "?"), int(p.get("seed", seed or 0)),
                    init=p.get("init", init or "paper"), knobs=dict(p.get("knobs", knobs or {})),
                    config=point.get("config", {}),
                    done=(path / "done.json").is_file())
    metrics = path / "metrics.jsonl"
    if metrics.is_file():
        for r in _metric_records(metrics):
            kind = r["kind"]
            if kind == "meta":  # one per session; the last describes the data the final eval scored
                rec.meta = r
                rec.metas.append(r)
            else:
                {"train": rec.train, "eval": rec.eval, "diag": rec.diag}.get(kind, rec.events).append(r)
    div = path / "divergence.json"
    if div.is_file():
        rec.divergence = read_file(div, "divergence report")
    if rec.done and not rec.train and rec.divergence is None:  # judged on nothing, it would read as "stalled"
        state = "holds no training record" if metrics.is_file() else "is missing"
        raise ConfigError(f"metrics file {metrics} {state}, yet the run is marked finished (done.json): its log "
                          "was lost or cut short, so it cannot be judged; delete the run folder to retrain it")
    end = rec.config.get("max_steps")
    if rec.done and not rec.diverged and isinstance(end, int) and (not rec.eval or rec.eval[-1]["step"] != end):
        # the trainer evaluates at max_steps; without that record an earlier loss would be judged as final
        last = f"its last eval is at step {rec.eval[-1]['step']}" if rec.eval else "it holds no eval record"
        if rec.eval and rec.eval[-1]["step"] > end:  # trained on past its point (train --resume --max_steps=...)
            raise ConfigError(f"metrics file {metrics}: {last}, past the max_steps={end} of its grid point "
                              "(point.json): it was trained on after the grid finished it (train --resume with "
                              "more steps), so it is not this point's run and it is not judged; delete the run "
                              "folder to retrain it")
        raise ConfigError(f"metrics file {metrics}: {last}, yet the run is marked finished at step {end} "
                          "(done.json): its log was cut short, so its final loss is unknown and it is not judged; "
                          "delete the run folder to retrain it")
    if not rec.done:
        rec.failed = _failure(path)
    return rec


def _failure(path: Path) -> str | None:
    """The error of a point whose worker failed (``failed.json``; trying the point again removes it)."""
    failed = path / "failed.json"
    if not failed.is_file():
        return None
    why = read_file(failed, "grid failure record").get("error")
    return str(why) if why else f"see {failed}"


def read_run_or_unreadable(path: Path, placement: str, seed: int, init: str, knobs: dict[str, Any]) -> RunRecord:
    """:func:`read_run`, or for a folder whose files are damaged a record that is neither done nor judged and
    says why (``problem``), so that a report of the other runs of a grid is still written."""
    try:
        return read_run(path, placement, seed, init, knobs)
    except ConfigError as e:
        try:  # a failed worker may leave its folder unreadable too: the failure is what the report says
            failed = _failure(Path(path))
        except ConfigError:
            failed = None
        return RunRecord(Path(path), placement, seed, init=init, knobs=dict(knobs), problem=str(e), failed=failed)


def slug(name: str) -> str:
    return re.sub(r"[^A-Za-z0-9_.=-]+", "_", name)
