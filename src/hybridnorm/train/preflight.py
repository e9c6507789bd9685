"""Environment checks made before any work: will the model fit in memory, can the output folder be written.

Both faults are knowable up front, and found late they cost a traceback, minutes of work, or worse: on CPU
allocating a model larger than the machine ends in the kernel's OOM killer (no message at all), on a GPU in
an out-of-memory traceback; an output path that is a file, lies under a file or is read-only fails only
when the first file is written. So:

**Memory** (:func:`check_fits`). Every place that builds a model from a config it did not create (training,
loading a run, loading a Hugging Face folder) compares an estimate with the memory available now:

- the parameter count, computed from the config's shapes (:func:`param_count`; nothing is allocated);
- bytes per parameter: 4 for fp32 weights (every loader loads fp32; training keeps fp32 master weights
  under bf16 autocast), plus for training 4 for the gradients and 8 for AdamW's two fp32 moments: 16;
- times ``copies``, for loaders that hold the weights twice for a moment (file tensors + model).

Activations, caches and the allocator's slack come on top, so the estimate is a lower bound: a refusal is
certain to be right, a pass is not a promise. Available memory is ``MemAvailable`` of ``/proc/meminfo``
(capped by a cgroup limit when one is set) on the CPU and ``torch.cuda.mem_get_info`` on CUDA; where neither
can be read (other systems, other devices) the check is skipped rather than guessed.

**Output folders** (:func:`check_writable_dir`): the path must be a folder or not exist yet, every existing
parent a folder, and the nearest existing one writable, proven by creating and deleting a probe file (a
read-only file system, a full quota); a folder whose permission bits deny writing to everyone is refused
even for root, who could write anyway, because read-only is what its owner asked for.

**One rule for what an output folder may already hold** (:func:`check_output_folder`), shared by every
command that writes a run or a Hugging Face folder (``train --out``, ``import --out``, ``export --to hf``):
it may be missing or empty; a non-empty folder only if it is of the command's own kind (a run folder for
``train``, which resumes or refuses there by its own rules; nothing for ``import`` and ``export``, which
make new folders); and never the command's input or a folder inside it. Files a user keeps there (their own
``config.yaml``, a source model's ``tokenizer.json``) are therefore never overwritten.
"""

from __future__ import annotations

import contextlib
import os
import re
import shutil
import stat
import tempfile
from collections.abc import Iterable, Iterator
from pathlib import Path
from typing import Any

import torch

from hybridnorm import leftovers, plain_data
from hybridnorm.errors import ConfigError, write_failure

FP32_BYTES = 4
TRAIN_BYTES_PER_PARAM = 4 + 4 + 2 * 4  # fp32 weights, gradients, AdamW exp_avg and exp_avg_sq
MEMINFO = Path("/proc/meminfo")
# cgroup v2, then v1: a container's limit, which MemAvailable (the host's view) does not show
CGROUP_LIMITS = ((Path("/sys/fs/cgroup/memory.max"), Path("/sys/fs/cgroup/memory.current")),
                 (Path("/sys/fs/cgroup/memory/memory.limit_in_bytes"),
                  Path("/sys/fs/cgroup/memory/memory.usage_in_bytes")))
_NO_LIMIT = 1 << 60  # cgroup v1 writes "unlimited" as a number near 2**63


def param_count(mc: Any) -> int:
    """Parameters of ``TransformerLM(mc)`` from its shapes alone (``mc``: a ModelConfig). Exact for the
    matrices; the norms' vectors are counted at their most (LayerNorm weight + bias in every slot a
    placement may use): 3 % over at the toy ``tiny`` size, under 0.5 % from ``small`` up."""
    d, L, H, Hkv, D = mc.d_model, mc.n_layers, mc.n_heads, mc.kv_heads, mc.head_dim
    V = mc.embedding_size
    attn = d * (H + 2 * Hkv) * D + H * D * d
    if mc.moe is not None:
        h = mc.moe.expert_hidden_size or mc.ffn_hidden_size
        ffn = mc.moe.num_experts * 3 * d * h + mc.moe.num_experts * d  # experts' w_in (d, 2h), w_out (h, d), router
    else:
        ffn = 3 * d * mc.ffn_hidden_size
    norms = 6 * 2 * d + 4 * 2 * max(H, Hkv) * D + 2  # in/out/post norms of both sublayers, Q/K/V/C norms, DyT α
    embed = V * d * (1 if mc.tie_embeddings else 2)
    return embed + L * (attn + ffn + norms) + 2 * 2 * d  # + embedding and final norms


def rope_bytes(mc: Any) -> int:
    """Bytes building the RoPE tables takes at its peak (``nn.rope.rope_tables``): float64 angles and their
    cos or sin, then the two fp32 tables, (max_seq_len, head_dim / 2) each. Allocated whatever the weights,
    so a huge ``model.max_seq_len`` alone can exhaust memory."""
    return mc.max_seq_len * (mc.head_dim // 2) * (8 + 8 + 4 + 4) + 8 * mc.max_seq_len


def estimate_bytes(mc: Any, *, training: bool, copies: int = 1) -> int:
    """Bytes the model's parameters (and for training their gradients and AdamW state) and its RoPE tables
    occupy at least."""
    per_param = TRAIN_BYTES_PER_PARAM if training else FP32_BYTES * copies
    return param_count(mc) * per_param + rope_bytes(mc)


def _read_int(path: Path) -> int | None:
    try:
        text = path.read_text(encoding="ascii").strip()
    except (OSError, UnicodeDecodeError):
        return None
    return int(text) if text.isdigit() else None  # "max" (cgroup v2, no limit) reads as None


def _cpu_available() -> tuple[int, str] | None:
    try:
        lines = MEMINFO.read_text(encoding="ascii").splitlines()
    except (OSError, UnicodeDecodeError):
        return None
    avail = None
    for line in lines:
        key, _, value = line.partition(":")
        if key == "MemAvailable" and value.split() and value.split()[0].isdigit():
            avail = int(value.split()[0]) * 1024  # reported in kB
    if avail is None:
        return None
    where = f"MemAvailable in {MEMINFO}"
    for limit_file, usage_file in CGROUP_LIMITS:
        limit, usage = _read_int(limit_file), _read_int(usage_file)
        if limit is not None and usage is not None and limit < _NO_LIMIT and limit - usage < avail:
            avail, where = max(limit - usage, 0), f"the cgroup limit {limit_file} less usage"
            break
    return avail, where


def available_bytes(device: torch.device) -> tuple[int, str] | None:
    """(bytes free now, where that was read) on ``device``, or None where it cannot be read."""
    if device.type == "cpu":
        return _cpu_available()
    if device.type == "cuda":
        try:
            free, _total = torch.cuda.mem_get_info(device)
        except (RuntimeError, AssertionError, ValueError):  # no CUDA build or driver: the device check says so
            return None
        return int(free), f"torch.cuda.mem_get_info({device})"
    return None


def _size(n: int) -> str:
    for unit, scale in (("TiB", 2**40), ("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if n >= scale:
            return f"{n / scale:.2f} {unit}"
    return f"{n} bytes"


def check_fits(mc: Any, device: torch.device | str = "cpu", *, training: bool, copies: int = 1,
               shards: int = 1, what: str = "the model", activations: tuple[int, str] = (0, "")) -> None:
    """ConfigError if ``mc``'s parameters (plus gradients and AdamW state when ``training``) cannot fit in
    the memory available on ``device`` now; silent where that cannot be read. ``shards`` > 1 (FSDP over that
    many ranks): the training state is split between them, but each rank still builds the whole fp32 model
    once before sharding it, so it needs the larger of the two. ``activations``: (bytes one micro-batch's
    forward keeps for its backward on each rank, the batch options that set it, named when it is they that
    cannot fit); the planner's count (``plan.activation_bytes``), measured on CPU at 80-90 % of the growth of
    the process's peak memory with the batch, so still a lower bound."""
    device = torch.device(device)
    need = estimate_bytes(mc, training=training, copies=copies)
    if training and shards > 1:
        need = max(estimate_bytes(mc, training=False), -(-(need - rope_bytes(mc)) // shards) + rope_bytes(mc))
    act, batch = activations
    free = available_bytes(device)
    if free is None or need + act <= free[0]:
        return
    n = param_count(mc)
    how = (f"{n:,} parameters x {TRAIN_BYTES_PER_PARAM} bytes (fp32 weights, gradients, AdamW's two moments)"
           + (f" / {shards} FSDP shards, at least the whole fp32 model while it is built" if shards > 1 else "")
           if training else f"{n:,} parameters x {FP32_BYTES} bytes (fp32)" + (f" x {copies} copies while loading"
                                                                              if copies > 1 else ""))
    rope = rope_bytes(mc)
    if rope > (need + act) // 2:  # the tables, not the weights, are what cannot fit: name their field
        raise ConfigError(f"model.max_seq_len={mc.max_seq_len}: {what} needs at least {_size(need)} on {device}, "
                          f"{_size(rope)} of it for the RoPE tables of that many positions, but only "
                          f"{_size(free[0])} is available ({free[1]}); use a smaller model.max_seq_len")
    if need <= free[0]:  # the weights fit, one micro-batch's activations do not: name the batch
        raise ConfigError(f"{batch}: {what} needs at least {_size(need + act)} on {device}, {_size(act)} of it "
                          f"for the activations one micro-batch keeps for its backward, but only "
                          f"{_size(free[0])} is available ({free[1]}); use a smaller batch_size (grad_accum keeps "
                          f"the step's batch) or activation_checkpointing=true")
    raise ConfigError(f"{what} needs at least {_size(need)} on {device} ({how}; activations come on top) but only "
                      f"{_size(free[0])} is available ({free[1]}); use a smaller model (model.d_model / n_layers / "
                      "vocab) or a machine with more memory")


def check_writable_dir(path: str | Path, what: str = "output folder") -> Path:
    """ConfigError naming ``path`` unless a folder can be created (or already is) there and written into.
    Creates nothing: a command that fails later leaves no empty folder behind."""
    path = Path(path)
    if path.exists() and not path.is_dir():
        raise ConfigError(f"{what} {path} is a file, not a folder")
    existing = path
    while not existing.exists():
        if existing.is_symlink():  # a dangling link: mkdir would fail on it with a confusing message
            raise ConfigError(f"{what} {path}: {existing} is a broken symbolic link")
        if existing.parent == existing:
            break
        existing = existing.parent
    if not existing.is_dir():
        raise ConfigError(f"{what} {path} lies under {existing}, which is a file, not a folder")
    try:
        mode = existing.stat().st_mode
        if not mode & (stat.S_IWUSR | stat.S_IWGRP | stat.S_IWOTH):
            raise ConfigError(f"{what} {path}: {existing} is read-only (mode {stat.filemode(mode)})")
        fd, probe = tempfile.mkstemp(prefix=".hybridnorm-write-probe-", dir=existing)
        os.close(fd)
        os.unlink(probe)
    except OSError as e:  # EACCES, EROFS, EDQUOT, ENOSPC: say which, on one line
        raise ConfigError(f"{what} {path}: cannot write in {existing}: {e.strerror or e}") from None
    return path


# What makes a folder a run folder: what only the trainer, ``import`` or a grid write (the lock from the
# trainer's first moment on), recognised by what it holds as well as by its name (:func:`_written_by_us`):
# a user's own metrics.jsonl or train.lock is theirs to keep. Not config.yaml: users keep their own configs
# under that name.
RUN_MARKERS = ("checkpoints", "metrics.jsonl", "point.json", "train.lock")
# the keys of the JSON object each marker file holds (metrics.jsonl: on its first line, the run's meta record)
_MARKER_KEYS = {"metrics.jsonl": ("kind", "step"), "point.json": ("point", "config"),
                "train.lock": ("pid", "host", "since")}
_STEP_DIR = re.compile(r"^step_\d+$")
# ... and a report folder of `compare`/`sweep`: a runs/ folder holding a grid point (runs/NAME/point.json, the
# first thing a grid writes). A summary.md or a `runs` entry alone is anybody's: a report would overwrite it.
REPORT_POINT = ("runs", "*", "point.json")


def folder_kind(path: Path) -> str:
    """"missing", "empty", "run" (any of :data:`RUN_MARKERS`), "report" (a grid point under runs/:
    :data:`REPORT_POINT`) or "other" (a non-empty folder of anything else)."""
    if not path.exists():
        return "missing"
    try:
        entries = [p.name for p in path.iterdir()]
    except OSError as e:
        raise ConfigError(f"cannot list {path}: {e.strerror or e}") from None
    if not entries:
        return "empty"
    if any(_written_by_us(path / m) for m in RUN_MARKERS if m in entries):
        return "run"
    try:
        report = "runs" in entries and any(p.is_file() for p in path.glob("/".join(REPORT_POINT)))
    except OSError as e:
        raise ConfigError(f"cannot list {path / 'runs'}: {e.strerror or e}") from None
    return "report" if report else "other"


def _written_by_us(marker: Path) -> bool:
    """``checkpoints``: a folder holding a ``step_<N>`` folder; a marker file: the JSON object it holds has
    the keys ours have. Empty, either may be ours (a trainer stopped between creating and writing it) and
    holds nothing to lose. Anything unreadable is not ours."""
    try:
        if marker.name == "checkpoints":
            held = list(marker.iterdir()) if marker.is_dir() else None
            return held is not None and (not held or any(_STEP_DIR.match(p.name) and p.is_dir() for p in held))
        if not marker.is_file():
            return False
        if marker.stat().st_size == 0:
            return True
        with open(marker, "rb") as f:
            text = f.readline(1 << 20) if marker.name == "metrics.jsonl" else f.read(1 << 20)
        value = plain_data.loads(text)
    except (OSError, ValueError):
        return False
    return isinstance(value, dict) and all(k in value for k in _MARKER_KEYS[marker.name])


@contextlib.contextmanager
def staged_folder(out: Path, what: str) -> Iterator[Path]:
    """A hidden folder beside ``out`` to write into, renamed to ``out`` (a missing or empty folder) when the
    block succeeds and removed when it fails: a failed or interrupted write leaves no half folder, and a
    folder that someone filled meanwhile is not touched (the rename is refused). What a writer killed
    outright left behind is cleared first (:mod:`hybridnorm.leftovers`)."""
    out.parent.mkdir(parents=True, exist_ok=True)
    leftovers.clear_dead(out.parent, out.name, "partial")
    tmp = Path(tempfile.mkdtemp(prefix=leftovers.temp_prefix(out.name, "partial"), dir=out.parent))
    try:
        yield tmp
        mask = os.umask(0)
        os.umask(mask)
        os.chmod(tmp, 0o777 & ~mask)  # mkdtemp makes 0700; the folder gets the usual mode
        os.rename(tmp, out)
    except Exception as e:  # a full disk, a file-size limit: the OS's reason, naming the folder asked for
        if (reason := write_failure(e)) is None:
            raise
        raise ConfigError(f"{what} {out}: cannot write: {reason}; nothing was left behind") from None
    finally:
        shutil.rmtree(tmp, ignore_errors=True)  # gone after the rename; removed on any failure


def _inside(path: Path, folder: Path) -> bool:
    return path == folder or folder in path.parents


def check_output_folder(path: str | Path, what: str, *, may_hold: tuple[str, ...] = (),
                        inputs: Iterable[str | Path | tuple[str, str | Path] | None] = ()) -> Path:
    """The one output-folder rule (module docstring): ConfigError naming ``path`` (as ``what``, e.g.
    "--out") unless it is writable (:func:`check_writable_dir`), is none of ``inputs`` and lies inside none
    of them, and is missing, empty, or of a kind in ``may_hold`` (``"run"``). An input given as (option,
    path) is named by its option too (``data.source=/``). Creates nothing."""
    path = check_writable_dir(path, what)
    here = path.resolve()
    for given in inputs:
        option, given = given if isinstance(given, tuple) else ("", given)
        if given is None:
            continue
        source = Path(given).resolve()
        if source.is_dir() and _inside(here, source):
            named = f"{option}={given}" if option else str(given)
            raise ConfigError(f"{what} {path} is {'the input folder' if here == source else 'inside the input folder'}"
                              f" {named}: the command never writes into what it reads; choose another folder")
    kind = folder_kind(path)
    if kind in ("missing", "empty") or kind in may_hold:
        return path
    names = sorted(p.name for p in path.iterdir())
    shown = ", ".join(names[:4]) + (f", ... ({len(names)} entries)" if len(names) > 4 else "")
    allowed = "a new or empty folder" + ("" if not may_hold else f" or a {' or '.join(may_hold)} folder")
    held = "files of its own" if kind == "other" else f"a {kind}"
    raise ConfigError(f"{what} {path} is not empty: it holds {held} ({shown}) and needs to be {allowed}; "
                      "nothing there was changed, choose another folder")


def check_output_file(path: str | Path, what: str, *, example: str,
                      inputs: Iterable[tuple[str, str | Path | None]] = ()) -> Path:
    """The one output-file rule: ConfigError naming ``path`` (as ``what``, e.g. "--output") unless it is no
    folder (``example``: a file name to suggest), its folder is writable, and it is none of ``inputs``
    ((label, path): a file the command reads, or a folder it reads from, such as the run or checkpoint) and
    lies inside none of them: a command never overwrites what it reads (a checkpoint's weights, the
    questions being scored). Creates nothing."""
    out = Path(path)
    if out.is_dir():
        raise ConfigError(f"{what} {out} is a folder: name the file to write, e.g. {out / example}")
    here = out.resolve()
    for label, given in inputs:
        if given is None or str(given) in ("", "-"):
            continue
        source = Path(given).resolve()
        same = here == source or (out.exists() and source.exists() and os.path.samefile(out, source))
        if same or (source.is_dir() and source in here.parents):
            raise ConfigError(f"{what} {path} is {'' if same else 'inside '}{label} {given}: the command never "
                              "writes over what it reads; name a file elsewhere")
    check_writable_dir(out.parent, f"{what} {path}: its folder")
    return out
