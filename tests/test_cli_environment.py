"""Environment faults, each one ``error:`` line naming the path or field and exit 2, no traceback: an output
folder that is a file, lies under a file or is read-only; a CUDA device that is not there; a model larger
than the memory available (an estimate made before anything is allocated)."""

from __future__ import annotations

import stat
from pathlib import Path

import pytest
import torch
from train_helpers import tiny_overrides

import hybridnorm.train.preflight as preflight
from hybridnorm.cli import main
from hybridnorm.config import ModelConfig
from hybridnorm.errors import ConfigError
from hybridnorm.nn.model import TransformerLM
from hybridnorm.train.distributed import resolve_device


def _one_error_line(capsys) -> str:
    err = capsys.readouterr().err
    lines = [ln for ln in err.strip().splitlines() if ln.strip()]
    assert len(lines) == 1 and lines[0].startswith("error:") and "Traceback" not in err, err
    return lines[0]


@pytest.fixture
def read_only(tmp_path: Path):
    """A folder with every write bit off (refused even for root, who could write anyway)."""
    folder = tmp_path / "ro"
    folder.mkdir()
    folder.chmod(stat.S_IRUSR | stat.S_IXUSR | stat.S_IRGRP | stat.S_IXGRP)
    yield folder
    folder.chmod(stat.S_IRWXU)


# -- output folders -------------------------------------------------------------------------------------

def _targets(tmp_path: Path, read_only: Path) -> dict[str, tuple[Path, str]]:
    (tmp_path / "a_file").write_text("keep me")
    return {"a file": (tmp_path / "a_file", "is a file"),
            "under a file": (tmp_path / "a_file" / "sub" / "out", "lies under"),
            "read-only parent": (read_only / "out", "read-only"),
            "read-only itself": (read_only, "read-only")}


@pytest.mark.parametrize("case", ["a file", "under a file", "read-only parent", "read-only itself"])
def test_export_into_an_unusable_folder_is_one_error_naming_it(tiny_run: Path, tmp_path: Path, read_only: Path,
                                                              capsys, case: str) -> None:
    pytest.importorskip("transformers", reason="export needs the hf extra")
    target, needle = _targets(tmp_path, read_only)[case]
    assert main(["export", str(tiny_run), "--to", "hf", str(target)]) == 2
    line = _one_error_line(capsys)
    assert str(target) in line and needle in line, line
    assert (tmp_path / "a_file").read_text() == "keep me"
    assert not any(read_only.iterdir())


@pytest.mark.parametrize("case", ["a file", "under a file", "read-only parent"])
def test_import_into_an_unusable_folder_is_one_error_naming_it(tiny_run: Path, tmp_path: Path, read_only: Path,
                                                              capsys, case: str) -> None:
    pytest.importorskip("transformers", reason="import needs the hf extra")
    assert main(["export", str(tiny_run), "--to", "hf", str(tmp_path / "hf")]) == 0
    capsys.readouterr()
    target, needle = _targets(tmp_path, read_only)[case]
    assert main(["import", str(tmp_path / "hf"), "--out", str(target)]) == 2
    line = _one_error_line(capsys)
    assert str(target) in line and needle in line, line


def test_check_writable_dir_creates_nothing_and_accepts_a_new_nested_folder(tmp_path: Path) -> None:
    target = tmp_path / "a" / "b" / "c"
    assert preflight.check_writable_dir(target) == target
    assert not (tmp_path / "a").exists() and list(tmp_path.iterdir()) == []  # the probe file is gone too
    (tmp_path / "link").symlink_to(tmp_path / "nowhere")
    with pytest.raises(ConfigError, match="broken symbolic link"):
        preflight.check_writable_dir(tmp_path / "link" / "x")


# -- devices --------------------------------------------------------------------------------------------

@pytest.mark.skipif(torch.cuda.is_available(), reason="this machine has CUDA")
@pytest.mark.parametrize("device", ["cuda", "cuda:0", "cuda:3"])
def test_train_on_cuda_without_cuda_is_one_error(corpus: Path, cache_dir: Path, tmp_path: Path, capsys,
                                                 device: str) -> None:
    argv = ["train", *tiny_overrides(corpus, cache_dir, tmp_path / "run"), "--max-steps", "1", f"--device={device}"]
    assert main(argv) == 2
    line = _one_error_line(capsys)
    assert f"device={device!r}" in line and "CUDA is not available" in line


def test_a_cuda_index_past_the_last_gpu_is_refused(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    assert resolve_device("cuda:1") == torch.device("cuda", 1)
    assert resolve_device("cuda", local_rank=1) == torch.device("cuda", 1)
    with pytest.raises(ConfigError, match=r"no cuda:2; this machine has 2 CUDA device\(s\), cuda:0..cuda:1"):
        resolve_device("cuda:2")
    with pytest.raises(ConfigError, match="no cuda:5"):
        resolve_device("cuda", local_rank=5)  # torchrun with more ranks than GPUs


@pytest.mark.cuda
def test_the_gpu_a_process_runs_on_becomes_its_current_device() -> None:
    """Rank k's pinned batches, nccl barrier and bare synchronize must act on cuda:k, not open a context on
    GPU 0 from every rank: ``init_distributed`` (train, compare/sweep, eval --tasks) sets the current device,
    also outside torchrun (``--device cuda:N``). Only a machine with several GPUs can tell (the last one is
    used); with one this checks the call runs."""
    from hybridnorm.train.distributed import init_distributed

    last = torch.device("cuda", torch.cuda.device_count() - 1)
    before = torch.cuda.current_device()
    try:
        assert not init_distributed(last).enabled  # not under torchrun: no group
        assert torch.cuda.current_device() == last.index
    finally:
        torch.cuda.set_device(before)


# -- memory ---------------------------------------------------------------------------------------------

@pytest.mark.parametrize(("size", "placement"), [("tiny", "pre"), ("tiny", "hybridnorm_star"), ("small", "olmo2"),
                                                 ("tiny-moe", "pre"), ("151m", "span"), ("moe-1b-7b", "pre")])
def test_the_parameter_estimate_bounds_the_real_count(size: str, placement: str) -> None:
    mc = ModelConfig.from_preset(size, placement=placement)
    with torch.device("meta"):  # the real count without allocating 7B parameters
        real = TransformerLM(mc).num_params()
    assert real <= preflight.param_count(mc) <= real * 1.03
    rope = preflight.rope_bytes(mc)  # the RoPE tables, allocated whatever the weights
    assert preflight.estimate_bytes(mc, training=True) == 16 * preflight.param_count(mc) + rope
    assert preflight.estimate_bytes(mc, training=False, copies=2) == 8 * preflight.param_count(mc) + rope


def test_fsdp_shards_the_training_state_but_each_rank_builds_the_whole_model_once(monkeypatch) -> None:
    mc = ModelConfig.from_preset("151m")
    n = preflight.param_count(mc)
    free = 6 * n  # below 16 B/param unsharded, above 16/4 = 4 B/param sharded over 4 ranks
    monkeypatch.setattr(preflight, "available_bytes", lambda device: (free, "a test's reader"))
    with pytest.raises(ConfigError, match="x 16 bytes"):
        preflight.check_fits(mc, "cpu", training=True)
    preflight.check_fits(mc, "cpu", training=True, shards=4)  # 4 B/param: fits
    # 16 shards would need only 1 B/param of training state, but the fp32 build itself takes 4 B/param
    monkeypatch.setattr(preflight, "available_bytes", lambda device: (3 * n, "a test's reader"))
    with pytest.raises(ConfigError, match="16 FSDP shards"):
        preflight.check_fits(mc, "cpu", training=True, shards=16)


@pytest.fixture
def little_memory(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(preflight, "available_bytes", lambda device: (1000, "a test's reader"))


def test_training_a_model_too_large_for_memory_is_refused_with_the_estimate(corpus: Path, cache_dir: Path,
                                                                           tmp_path: Path, capsys,
                                                                           little_memory: None) -> None:
    argv = ["train", *tiny_overrides(corpus, cache_dir, tmp_path / "run"), "--max-steps", "1"]
    assert main(argv) == 2
    line = _one_error_line(capsys)
    n = preflight.param_count(ModelConfig.from_preset("tiny", vocab_size=257))
    assert f"{n:,} parameters x 16 bytes" in line and "AdamW" in line
    assert "only 1000 bytes is available (a test's reader)" in line
    assert not list((tmp_path / "run").glob("checkpoints/*"))


def test_loading_a_run_too_large_for_memory_is_refused_before_the_weights(tiny_run: Path, capsys,
                                                                         little_memory: None) -> None:
    assert main(["generate", str(tiny_run), "--max-new-tokens", "2"]) == 2
    line = _one_error_line(capsys)
    assert f"the model of {tiny_run}" in line and "x 4 bytes (fp32)" in line and "1000 bytes" in line


def test_loading_an_hf_folder_too_large_for_memory_is_refused(tiny_run: Path, tmp_path: Path, capsys,
                                                             monkeypatch: pytest.MonkeyPatch) -> None:
    pytest.importorskip("transformers", reason="the hf extra")
    assert main(["export", str(tiny_run), "--to", "hf", str(tmp_path / "hf"), "--arch", "hybridnorm"]) == 0
    capsys.readouterr()
    monkeypatch.setattr(preflight, "available_bytes", lambda device: (1000, "a test's reader"))
    assert main(["import", str(tmp_path / "hf"), "--out", str(tmp_path / "r")]) == 2
    line = _one_error_line(capsys)
    assert f"the model in {tmp_path / 'hf'}" in line and "needs at least" in line
    assert not (tmp_path / "r").exists()


def test_a_huge_config_is_refused_by_the_real_reader_without_allocating(corpus: Path, cache_dir: Path,
                                                                       tmp_path: Path, capsys) -> None:
    if preflight.available_bytes(torch.device("cpu")) is None:
        pytest.skip("no /proc/meminfo here: the check is skipped by design")
    argv = ["train", *tiny_overrides(corpus, cache_dir, tmp_path / "run"), "--max-steps", "1",
            "--model.d_model=65536", "--model.n_heads=64", "--model.ffn_hidden_size=262144", "--model.n_layers=512"]
    assert main(argv) == 2  # 2.6e13 parameters: allocating would take the machine down, not raise
    assert "TiB" in _one_error_line(capsys)


def test_the_cpu_reader_takes_memavailable_capped_by_a_cgroup(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    meminfo = tmp_path / "meminfo"
    meminfo.write_text("MemTotal:       16000000 kB\nMemAvailable:    8000000 kB\n")
    limit, usage = tmp_path / "memory.max", tmp_path / "memory.current"
    monkeypatch.setattr(preflight, "MEMINFO", meminfo)
    monkeypatch.setattr(preflight, "CGROUP_LIMITS", ((limit, usage),))
    cpu = torch.device("cpu")
    assert preflight.available_bytes(cpu) == (8000000 * 1024, f"MemAvailable in {meminfo}")
    limit.write_text("max\n")  # cgroup v2: no limit
    usage.write_text("123\n")
    assert preflight.available_bytes(cpu)[0] == 8000000 * 1024
    limit.write_text(str(3 * 2**30))
    usage.write_text(str(2**30))
    assert preflight.available_bytes(cpu) == (2 * 2**30, f"the cgroup limit {limit} less usage")
    meminfo.write_text("MemTotal: 5 kB\n")  # no MemAvailable (very old kernels): skip, never guess
    assert preflight.available_bytes(cpu) is None
    preflight.check_fits(ModelConfig.from_preset("151m"), cpu, training=True)  # silent: nothing to compare with
