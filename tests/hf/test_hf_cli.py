"""``hybridnorm export`` / ``hybridnorm import`` on the command line."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

pytest.importorskip("transformers", reason="the hf extra (transformers) is not installed")
import transformers

from hybridnorm.cli import main
from hybridnorm.loading import load_run
from hybridnorm.train.checkpoint import verify_checkpoint


def test_export_own_class_then_import_back(trained_run: Path, tmp_path: Path, capsys) -> None:
    assert main(["export", str(trained_run), "--to", "hf", str(tmp_path / "hf")]) == 0
    out = capsys.readouterr().out
    assert "as HybridNormForCausalLM (hybridnorm's own class" in out and "per-layer overrides" in out
    meta = json.loads((tmp_path / "hf" / "hybridnorm_export.json").read_text())
    assert meta["class"] == "HybridNormForCausalLM" and meta["placement"]["name"] == "hybridnorm_star"

    assert main(["import", str(tmp_path / "hf"), "--out", str(tmp_path / "back")]) == 0
    assert "placement hybridnorm_star" in capsys.readouterr().out
    a, b = load_run(trained_run), load_run(tmp_path / "back")
    x = torch.randint(0, a.tokenizer.vocab_size, (1, 16))
    with torch.no_grad():
        assert torch.equal(a.model(x), b.model(x))
    assert b.tokenizer.encode("the lord said") == a.tokenizer.encode("the lord said")
    for name in ("config.yaml", "tokenizer.json"):  # the imported checkpoint keeps its run's files, hashed
        assert (b.checkpoint / name).read_bytes() == (tmp_path / "back" / name).read_bytes()
        assert name in verify_checkpoint(b.checkpoint)
    # the imported run generates through the normal CLI path
    assert main(["generate", str(tmp_path / "back"), "--prompt", "the", "--max-new-tokens", "5"]) == 0


def test_export_pre_norm_run_as_llama_in_bf16(trained_run: Path, tmp_path: Path, capsys, make_cfg) -> None:
    from hybridnorm.train.trainer import train

    cfg = make_cfg(tmp_path / "pre", "--model.placement=pre", "--max_steps=3")
    train(cfg, quiet=True)
    assert main(["export", str(tmp_path / "pre"), "--to", "hf", str(tmp_path / "hf"), "--dtype", "bfloat16"]) == 0
    assert "as LlamaForCausalLM (stock class" in capsys.readouterr().out
    model = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "hf")
    assert type(model).__name__ == "LlamaForCausalLM" and model.dtype == torch.bfloat16


@pytest.mark.parametrize(("argv", "needles"), [
    (["export", "{run}", "--to", "onnx", "{tmp}/x"], ["--to 'onnx'", "'hf'"]),
    (["export", "{run}", "--to", "hf", "{tmp}/x", "--arch", "llama"], ["cannot export as llama", "overrides"]),
    (["export", "{run}", "--to", "hf", "{tmp}/x", "--dtype", "int8"], ["--dtype='int8'", "bfloat16"]),
    (["export", "{tmp}/missing", "--to", "hf", "{tmp}/x"], ["missing does not exist (expected a run folder"]),
    (["import", "{tmp}", "--out", "{tmp}/r"], ["not a Hugging Face model folder"]),
])
def test_bad_export_import_arguments_are_one_error_line(trained_run: Path, tmp_path: Path, capsys, argv,
                                                        needles) -> None:
    argv = [a.format(run=trained_run, tmp=tmp_path) for a in argv]
    assert main(argv) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("error:"), err
    for n in needles:
        assert n in err[0]


def test_export_refuses_a_non_empty_folder_and_import_a_corrupt_config(trained_run: Path, tmp_path: Path,
                                                                      capsys) -> None:
    (tmp_path / "full").mkdir()
    (tmp_path / "full" / "keep.txt").write_text("mine")
    assert main(["export", str(trained_run), "--to", "hf", str(tmp_path / "full")]) == 2
    assert "is not empty: it holds files of its own (keep.txt)" in capsys.readouterr().err
    assert (tmp_path / "full" / "keep.txt").read_text() == "mine"  # nothing lost
    (tmp_path / "bad").mkdir()
    (tmp_path / "bad" / "tokenizer.json").write_bytes((trained_run / "tokenizer.json").read_bytes())
    (tmp_path / "bad" / "config.json").write_text("{not json")
    assert main(["import", str(tmp_path / "bad"), "--out", str(tmp_path / "r")]) == 2
    assert str(tmp_path / "bad" / "config.json") in capsys.readouterr().err


def test_truncated_weights_are_refused_by_file_name(trained_run: Path, tmp_path: Path, capsys) -> None:
    assert main(["export", str(trained_run), "--to", "hf", str(tmp_path / "hf")]) == 0
    weights = tmp_path / "hf" / "model.safetensors"
    weights.write_bytes(weights.read_bytes()[:1000])
    capsys.readouterr()
    assert main(["import", str(tmp_path / "hf"), "--out", str(tmp_path / "r")]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error:") and str(tmp_path / "hf") in err
    assert not (tmp_path / "r" / "checkpoints").exists()


def test_an_imported_model_fine_tunes_with_train_resume(trained_run: Path, tmp_path: Path, corpus: Path,
                                                        cache_dir: Path, no_peak_measure: None) -> None:
    assert main(["export", str(trained_run), "--to", "hf", str(tmp_path / "hf")]) == 0
    assert main(["import", str(tmp_path / "hf"), "--out", str(tmp_path / "ft")]) == 0
    before = load_run(tmp_path / "ft").model.state_dict()
    assert main(["train", str(tmp_path / "ft" / "config.yaml"), "--out", str(tmp_path / "ft"), "--resume",
                 "--max-steps", "2", f"--data.source={corpus}", f"--data.cache_dir={cache_dir}", "--seq_len=32",
                 "--batch_size=2", "--precision=fp32", "--device=cpu"]) == 0
    after = load_run(tmp_path / "ft")
    assert after.checkpoint.name == "step_000002"
    changed = [k for k, v in after.model.state_dict().items() if not torch.equal(v, before[k])]
    assert changed  # it trained from the imported weights, not from scratch


def test_generate_and_eval_take_an_hf_folder_like_the_run(trained_run: Path, tmp_path: Path, capsys) -> None:
    assert main(["export", str(trained_run), "--to", "hf", str(tmp_path / "hf")]) == 0
    questions = tmp_path / "q.jsonl"
    questions.write_text('{"context": "the lord said", "endings": ["unto moses", "qqq zzz"], "label": 0}\n'
                         '{"context": "milk and", "endings": ["honey", "brass gates"], "label": 0}\n')
    outputs = []
    for src in (trained_run, tmp_path / "hf"):
        capsys.readouterr()
        assert main(["generate", str(src), "--prompt", "the people", "--max-new-tokens", "20"]) == 0
        assert main(["eval", str(src), "--mc", str(questions), "--output", str(tmp_path / "r.json")]) == 0
        capsys.readouterr()
        outputs.append(json.loads((tmp_path / "r.json").read_text()))
    strip = [{k: v for k, v in o.items() if k not in ("checkpoint", "run")} for o in outputs]
    assert strip[0] == strip[1]
