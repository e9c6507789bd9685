"""benchmarks/gpu_mfu.py without a GPU: it says so and exits 0; on the CPU (``--device cpu``) the same
code path runs end to end on a tiny model and prints its table (eager blocks: no compile in a quick test)."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import pytest
import torch

SCRIPT = Path(__file__).resolve().parents[1] / "benchmarks" / "gpu_mfu.py"


@pytest.fixture(scope="module")
def gpu_mfu():
    spec = importlib.util.spec_from_file_location("gpu_mfu", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the message of a machine without a GPU")
def test_without_a_gpu_it_exits_cleanly_with_a_message(gpu_mfu, capsys):
    assert gpu_mfu.main([]) == 0
    assert "no CUDA GPU is available" in capsys.readouterr().out


def test_cpu_smoke_run_prints_a_row_per_configuration(gpu_mfu, capsys, monkeypatch):
    monkeypatch.setattr(gpu_mfu, "measured_peak_flops", lambda *a, **k: 1e12)  # skip the matmul timing
    assert gpu_mfu.main(["--device", "cpu", "--size", "tiny", "--seq", "32", "--batch", "2", "--steps", "1",
                         "--warmup", "1", "--no-compile", "--placements", "pre,hybridnorm_star"]) == 0
    rows = [line.split() for line in capsys.readouterr().out.splitlines()]
    table = [r for r in rows if r and r[0] in ("pre", "hybridnorm_star")]
    assert [(r[0], r[1]) for r in table] == [("pre", "off"), ("pre", "on"), ("hybridnorm_star", "off"),
                                             ("hybridnorm_star", "on")]
    # the LM head + loss the trainer runs on a GPU under --compile=true: compiled (compile_head_loss)
    assert all(r[2] == "off" and r[3] == "2" and r[4] == "compiled" and r[5] == "auto" and r[-1] != "loss!)"
               and r[10].endswith("%") for r in table)
    assert gpu_mfu.peak_flops(torch.device("cpu"), False)[1] == "measured bf16 matmul"


@pytest.mark.parametrize("loss", ["plain", "fast"])
def test_cpu_smoke_run_with_each_head_and_loss(gpu_mfu, capsys, monkeypatch, loss):
    monkeypatch.setattr(gpu_mfu, "measured_peak_flops", lambda *a, **k: 1e12)
    assert gpu_mfu.main(["--device", "cpu", "--size", "tiny", "--seq", "32", "--batch", "2", "--steps", "1",
                         "--warmup", "1", "--no-compile", "--placements", "pre", "--ac", "off", "--loss", loss]) == 0
    out = capsys.readouterr().out
    row = next(line.split() for line in out.splitlines() if line.startswith("pre "))
    assert row[4] == loss and row[-1] != "loss!)" and row[10].endswith("%")


def test_set_overrides_preset_fields_and_names_a_bad_one(gpu_mfu):
    import argparse

    import hybridnorm as hn

    sets = ["n_layers=1", "moe={num_experts: 2, top_k: 1}"]
    args = argparse.Namespace(size="tiny-moe", batch=2, seq=32, steps=1, warmup=1, no_compile=True, set=sets)
    got = gpu_mfu.measure(args, "pre", False, torch.device("cpu"))
    want = hn.ModelConfig.from_preset("tiny-moe", placement="pre", n_layers=1, moe={"num_experts": 2, "top_k": 1})
    want = want.build("meta")
    preset = hn.ModelConfig.from_preset("tiny-moe", placement="pre").build("meta")
    assert got["params"] == want.num_params() != preset.num_params()
    assert got["finite"]
    with pytest.raises(hn.ConfigError, match="n_layer"):
        gpu_mfu.measure(argparse.Namespace(**{**vars(args), "set": ["n_layer=1"]}), "pre", False, torch.device("cpu"))


def test_a_grid_of_batches_and_losses_is_measured_and_kept_as_json(gpu_mfu, capsys, monkeypatch, tmp_path):
    monkeypatch.setattr(gpu_mfu, "measured_peak_flops", lambda *a, **k: 1e12)
    rows_path = tmp_path / "out" / "rows.json"
    assert gpu_mfu.main(["--device", "cpu", "--size", "tiny", "--seq", "32", "--batch", "1,2", "--steps", "1",
                         "--warmup", "1", "--no-compile", "--placements", "pre", "--ac", "off",
                         "--loss", "fast,plain", "--json", str(rows_path)]) == 0
    rows = json.loads(rows_path.read_text())
    assert [(r["loss"], r["batch"]) for r in rows] == [("fast", 1), ("fast", 2), ("plain", 1), ("plain", 2)]
    assert {(r["attention"], r["sdpa_kernel"]) for r in rows} == {("auto", "flash_attention")}  # torch's, on a CPU
    for r in rows:  # MFU as the table defines it, from the row's own numbers
        assert r["finite"] and r["mfu"] == pytest.approx(r["tokens_per_s"] * r["flops_per_token"] / r["peak_flops"])
    printed = [line.split() for line in capsys.readouterr().out.splitlines() if line.startswith("pre ")]
    assert [(r[4], int(r[3])) for r in printed] == [("fast", 1), ("fast", 2), ("plain", 1), ("plain", 2)]


@pytest.mark.parametrize(("flag", "value", "message"), [("--batch", "4,x", "comma list of integers"),
                                                         ("--batch", "0", "positive"),
                                                         ("--loss", "fast,chunky", "fast, plain, compiled")])
def test_a_bad_list_is_refused_naming_the_valid_values(gpu_mfu, capsys, flag, value, message):
    with pytest.raises(SystemExit) as exit_:
        gpu_mfu.parse_args([flag, value])
    assert exit_.value.code == 2
    assert message in capsys.readouterr().err


def test_profile_writes_where_the_step_goes(gpu_mfu, capsys, monkeypatch, tmp_path):
    monkeypatch.setattr(gpu_mfu, "measured_peak_flops", lambda *a, **k: 1e12)
    monkeypatch.syspath_prepend(str(SCRIPT.parent))  # step_profile.py beside the script
    assert gpu_mfu.main(["--device", "cpu", "--size", "tiny", "--seq", "32", "--batch", "2", "--steps", "1",
                         "--warmup", "1", "--no-compile", "--placements", "hybridnorm_star", "--ac", "off",
                         "--loss", "fast", "--profile", str(tmp_path), "--profile-steps", "2"]) == 0
    (row,) = json.loads((tmp_path / "profile.json").read_text())
    prof = row["profile"]
    assert prof["steps"] == 2 and prof["device"] == "cpu"
    # every record lands in exactly one category, so the categories add up to the time in operators
    assert sum(prof["categories"].values()) == pytest.approx(prof["busy_ms"], rel=1e-9)
    # the regions this step has: blocks' matmuls, the fused head + loss, attention, norms, AdamW
    assert {"matmul", "LM head matmul", "loss (not matmul)", "attention", "norms", "optimizer"} <= \
        set(prof["categories"])
    assert 0.0 <= prof["idle_share"] <= 1.0 and prof["busy_ms"] > 0
    md = (tmp_path / "profile.md").read_text()
    assert md.startswith("### tiny hybridnorm_star, AC off, float8 off, batch 2 x 32, fast head + loss")
    assert "| LM head matmul |" in md and "| `aten::mm` | matmul |" in md


def test_a_profile_that_fails_costs_the_profile_not_the_row(gpu_mfu, capsys, monkeypatch, tmp_path):
    """A profiler that cannot start, or results this torch does not carry (an AttributeError while reading
    them): the row measured before the profile is kept, with the failure in its place."""
    monkeypatch.syspath_prepend(str(SCRIPT.parent))  # step_profile.py beside the script
    import step_profile

    def broken(*args, **kwargs):
        raise AttributeError("'_ProfilerResult' object has no attribute 'trace_start_ns'")

    monkeypatch.setattr(gpu_mfu, "measured_peak_flops", lambda *a, **k: 1e12)
    monkeypatch.setattr(step_profile, "profile_steps", broken)
    out = tmp_path / "rows.json"
    assert gpu_mfu.main(["--device", "cpu", "--size", "tiny", "--seq", "32", "--batch", "2", "--steps", "1",
                         "--warmup", "1", "--no-compile", "--placements", "pre", "--ac", "off", "--loss", "fast",
                         "--profile", str(tmp_path), "--json", str(out)]) == 0
    (row,) = json.loads(out.read_text())
    assert row["tokens_per_s"] > 0 and row["profile"].startswith("profiler failed: AttributeError: ")
    assert "profiler failed: AttributeError" in capsys.readouterr().out



def test_float8_rows_train_through_the_float8_linears(gpu_mfu, monkeypatch, tmp_path):
    monkeypatch.setattr(gpu_mfu, "measured_peak_flops", lambda *a, **k: 1e12)
    real, swapped = gpu_mfu.convert_to_float8, []
    monkeypatch.setattr(gpu_mfu, "convert_to_float8", lambda model: swapped.append(real(model)))
    rows_path = tmp_path / "rows.json"
    assert gpu_mfu.main(["--device", "cpu", "--size", "tiny", "--seq", "32", "--batch", "2", "--steps", "1",
                         "--warmup", "1", "--no-compile", "--placements", "pre", "--ac", "off", "--float8", "both",
                         "--json", str(rows_path)]) == 0
    rows = json.loads(rows_path.read_text())
    assert [r["float8"] for r in rows] == [False, True] and all(r["finite"] for r in rows)
    assert len(swapped) == 1 and len(swapped[0]) == 4 * 2  # the float8 row only: 4 linears in each of 2 blocks


def test_batch_plan_measures_the_planners_largest_micro_batch_per_configuration(gpu_mfu, capsys, monkeypatch,
                                                                                tmp_path):
    from hybridnorm.train.plan import PlanOptions, plan

    monkeypatch.setattr(gpu_mfu, "measured_peak_flops", lambda *a, **k: 1e12)
    out = tmp_path / "rows.json"
    common = ["--device", "cpu", "--size", "tiny", "--seq", "32", "--steps", "1", "--warmup", "1", "--no-compile",
              "--loss", "fast"]
    assert gpu_mfu.main([*common, "--placements", "pre,hybridnorm_star", "--batch", "plan", "--gpu-mem", "0.003",
                         "--json", str(out)]) == 0
    rows = json.loads(out.read_text())
    for placement in ("pre", "hybridnorm_star"):
        mode = plan(PlanOptions(size="tiny", gpus=1, gpu_mem=0.003, seq_len=32, placement=placement,
                                loss="fast")).modes[0]
        got = {r["ac"]: r["batch"] for r in rows if r["placement"] == placement}
        assert got == {False: mode.max_micro_batch, True: mode.max_micro_batch_ckpt}  # checkpointing fits more
        assert got[True] > got[False] >= 1
    # a memory where nothing fits: no row, said once per configuration, not a crash
    assert gpu_mfu.main([*common, "--placements", "pre", "--batch", "plan", "--gpu-mem", "0.002"]) == 0
    assert capsys.readouterr().out.count("the plan fits no sequence; skipped") == 2


@pytest.mark.parametrize(("extra", "message"), [
    (["--batch", "plan"], "--batch plan needs --gpu-mem GIB on a machine without a GPU"),
    (["--batch", "plan", "--gpu-mem", "1", "--set", "n_layers=1"], "with --set give --batch numbers"),
])
def test_batch_plan_refuses_what_it_cannot_plan(gpu_mfu, extra, message):
    with pytest.raises(SystemExit, match=message):
        gpu_mfu.main(["--device", "cpu", "--size", "tiny", "--seq", "32", "--no-compile", *extra])


def test_attention_preferences_are_rows_that_record_the_kernel_torch_chose(gpu_mfu, monkeypatch, tmp_path):
    monkeypatch.setattr(gpu_mfu, "measured_peak_flops", lambda *a, **k: 1e12)
    rows_path = tmp_path / "rows.json"
    assert gpu_mfu.main(["--device", "cpu", "--size", "tiny", "--seq", "32", "--batch", "2", "--steps", "1",
                         "--warmup", "1", "--no-compile", "--placements", "pre", "--ac", "off",
                         "--attention", "auto,cudnn,math", "--json", str(rows_path)]) == 0
    rows = json.loads(rows_path.read_text())
    # a CPU has no cuDNN attention: the preference falls through to torch's flash kernel; math is the composite
    assert [(r["attention"], r["sdpa_kernel"]) for r in rows] == [
        ("auto", "flash_attention"), ("cudnn", "flash_attention"), ("math", "math")]
    assert all(r["finite"] for r in rows)
    with pytest.raises(SystemExit):
        gpu_mfu.parse_args(["--attention", "fast"])
