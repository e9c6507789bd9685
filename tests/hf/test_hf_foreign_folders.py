"""Foreign Hugging Face folders: no code from the folder ever runs, nothing is asked on stdin, and nothing is
unpickled unless ``hybridnorm import --allow-pickle`` asks for it (then only through weights_only).

The remote-code cases run the real command line in a subprocess with ``y`` waiting on stdin, the answer
transformers' own prompt would take as consent; the marker file the folder's code would write must never
appear. The rest call ``hybridnorm.cli.main`` in-process."""

from __future__ import annotations

import io
import json
import os
import shutil
import subprocess
import sys
import warnings
from pathlib import Path

import pytest
import torch

pytest.importorskip("transformers", reason="the hf extra (transformers) is not installed")
from safetensors.torch import load_file

from hybridnorm.cli import main
from hybridnorm.config import ModelConfig
from hybridnorm.data.tokenizer import ByteTokenizer
from hybridnorm.hf.export import export_model
from hybridnorm.loading import load_run
from hybridnorm.nn.model import TransformerLM

EVIL_CODE = """import pathlib
pathlib.Path({marker!r}).write_text("the folder's code ran")
from transformers import PretrainedConfig, PreTrainedModel
class EvilConfig(PretrainedConfig):
    model_type = {model_type!r}
class EvilModel(PreTrainedModel):
    config_class = EvilConfig
"""


def _tiny_folder(path: Path, placement: str = "pre", seed: int = 0) -> tuple[Path, TransformerLM]:
    """A real tiny model (random init) exported as an HF folder: Llama for ``pre``, ours otherwise."""
    torch.manual_seed(seed)
    model = TransformerLM(ModelConfig.from_preset("tiny", placement=placement, vocab_size=257)).eval()
    export_model(model, path, ByteTokenizer())
    return path, model


@pytest.fixture(scope="module")
def llama_dir(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, TransformerLM]:
    return _tiny_folder(tmp_path_factory.mktemp("foreign") / "llama")


def _evil_folder(tmp_path: Path, source: Path, model_type: str) -> tuple[Path, Path]:
    """A folder whose config.json points transformers (auto_map) at a .py file that writes a marker."""
    evil, marker = tmp_path / "evil", tmp_path / "MARKER"
    evil.mkdir()
    for name in ("tokenizer.json", "model.safetensors"):
        (evil / name).write_bytes((source / name).read_bytes())
    cfg = {**json.loads((source / "config.json").read_text()), "model_type": model_type,
           "auto_map": {"AutoConfig": "evil.EvilConfig", "AutoModelForCausalLM": "evil.EvilModel"}}
    (evil / "config.json").write_text(json.dumps(cfg))
    (evil / "evil.py").write_text(EVIL_CODE.format(marker=str(marker), model_type=model_type))
    return evil, marker


def _one_error_line(err: str) -> str:
    lines = [ln for ln in err.strip().splitlines() if ln.strip()]
    assert len(lines) == 1 and lines[0].startswith("error:"), err
    assert "Traceback" not in err
    return lines[0]


@pytest.mark.parametrize("model_type", ["evil_thing", "llama"])  # unknown type, and a known type + auto_map
@pytest.mark.parametrize("command", ["import", "generate", "eval", "export"])
def test_remote_code_never_runs_and_stdin_is_never_read(llama_dir, tmp_path: Path, model_type: str,
                                                       command: str, monkeypatch, capsys) -> None:
    """Its stdin answers "y" to any prompt (transformers' "run the custom code?"): in a real process for one
    command per folder, in this process (``sys.stdin``) for the rest."""
    evil, marker = _evil_folder(tmp_path, llama_dir[0], model_type)
    argv = {"import": ["import", str(evil), "--out", str(tmp_path / "run")],
            "generate": ["generate", str(evil), "--max-new-tokens", "2"],
            "eval": ["eval", str(evil)],
            "export": ["export", str(evil), "--to", "hf", str(tmp_path / "out")]}[command]
    if command == "import":
        env = {**os.environ, "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1"}
        proc = subprocess.run([sys.executable, "-m", "hybridnorm.cli", *argv], input="y\ny\ny\n", text=True,
                              capture_output=True, timeout=300, cwd=tmp_path, env=env)
        code, out, err = proc.returncode, proc.stdout, proc.stderr
    else:
        monkeypatch.chdir(tmp_path)
        monkeypatch.setattr(sys, "stdin", io.StringIO("y\ny\ny\n"))
        code = main(argv)
        out, err = capsys.readouterr()
        assert sys.stdin.read() == "y\ny\ny\n"  # nothing of it read
    assert code == 2, err
    line = _one_error_line(err)
    assert str(evil / "config.json") in line
    assert ("auto_map" in line) if model_type == "llama" else ("model_type='evil_thing'" in line)
    assert "Do you wish to run the custom code" not in out + err
    assert not marker.exists()


def _import_err(argv: list[str], capsys) -> str:
    assert main(argv) == 2
    return _one_error_line(capsys.readouterr().err)


@pytest.mark.parametrize(("edit", "needle"), [
    (lambda c: c.pop("model_type"), "model_type=None"),
    (lambda c: c.update(model_type=["llama"]), "model_type=['llama']"),
    (lambda c: c.update(auto_map="evil.Evil"), "auto_map"),
    (lambda c: c.update(text_config={"auto_map": {"AutoConfig": "evil.C"}}), "text_config.auto_map"),
    (lambda c: c.update(quantization_config={"quant_method": "bitsandbytes"}), "quantization_config"),
    (lambda c: c.update(architectures=["LlamaForSequenceClassification"]), "architectures"),
    (lambda c: c.update(hidden_size="wide"), "config.json"),
    (lambda c: c.update(num_hidden_layers=-3), "config.json"),
    # each was a ZeroDivisionError from transformers naming no field (two of them blamed "the weights")
    (lambda c: c.update(num_attention_heads=0), "num_attention_heads=0 must be >= 1"),
    (lambda c: c.update(num_key_value_heads=0), "num_key_value_heads=0 must be >= 1"),
    (lambda c: c.update(head_dim=0), "head_dim=0 must be >= 1"),
])
def test_config_json_is_checked_before_transformers_reads_it(llama_dir, tmp_path: Path, capsys, edit,
                                                             needle) -> None:
    folder = tmp_path / "f"
    shutil.copytree(llama_dir[0], folder)
    cfg = json.loads((folder / "config.json").read_text())
    edit(cfg)
    (folder / "config.json").write_text(json.dumps(cfg))
    line = _import_err(["import", str(folder), "--out", str(tmp_path / "r")], capsys)
    assert needle in line and str(folder / "config.json") in line
    assert not (tmp_path / "r").exists()


@pytest.mark.parametrize("text", ["[1, 2]", "null", "[" * 100_000, '{"model_type": "llama"'])
def test_config_json_that_is_not_a_json_object_is_one_error(tmp_path: Path, capsys, text: str) -> None:
    (tmp_path / "f").mkdir()
    (tmp_path / "f" / "tokenizer.json").write_text("{}")
    (tmp_path / "f" / "config.json").write_text(text)
    assert str(tmp_path / "f" / "config.json") in _import_err(["import", str(tmp_path / "f"), "--out",
                                                               str(tmp_path / "r")], capsys)


def test_deeply_nested_config_json_is_one_error_line(llama_dir, tmp_path: Path, capsys) -> None:
    folder = tmp_path / "f"
    shutil.copytree(llama_dir[0], folder)
    cfg = json.loads((folder / "config.json").read_text())
    for depth in (200, 900, 5000):  # found by a walk; at about the recursion limit; past the JSON decoder's
        deep = json.dumps(cfg)[:-1] + ', "x": ' + '{"a": ' * depth + '{"auto_map": 1}' + "}" * (depth + 1)
        (folder / "config.json").write_text(deep)
        assert str(folder / "config.json") in _import_err(["import", str(folder), "--out", str(tmp_path / "r")],
                                                          capsys)
    assert not (tmp_path / "r").exists()


def test_own_export_with_its_shim_still_loads_but_a_changed_auto_map_does_not(tmp_path: Path, capsys) -> None:
    folder, model = _tiny_folder(tmp_path / "own", placement="hybridnorm_star")
    cfg = json.loads((folder / "config.json").read_text())
    assert cfg["model_type"] == "hybridnorm" and "auto_map" in cfg  # the shim map export writes for others
    (folder / "modeling_hybridnorm.py").write_text("raise SystemExit('the shim must never be imported here')\n")
    assert main(["import", str(folder), "--out", str(tmp_path / "run")]) == 0
    x = torch.randint(0, 257, (1, 12))
    with torch.no_grad():
        assert torch.equal(load_run(tmp_path / "run").model(x), model(x))
    cfg["auto_map"]["AutoModelForCausalLM"] = "evil.EvilModel"
    (folder / "config.json").write_text(json.dumps(cfg))
    capsys.readouterr()
    assert "auto_map" in _import_err(["import", str(folder), "--out", str(tmp_path / "run2")], capsys)


def _pickle_folder(tmp_path: Path, source: Path, name: str = "pytorch_model.bin") -> Path:
    folder = tmp_path / "pickled"
    folder.mkdir()
    for f in ("config.json", "tokenizer.json"):
        (folder / f).write_bytes((source / f).read_bytes())
    torch.save(load_file(source / "model.safetensors"), folder / name)
    return folder


@pytest.mark.parametrize("name", ["pytorch_model.bin", "model.pt", "weights.pth", "last.ckpt"])
def test_pickle_weights_are_refused_by_default_naming_the_file_and_the_flag(llama_dir, tmp_path: Path, capsys,
                                                                            name: str) -> None:
    folder = _pickle_folder(tmp_path, llama_dir[0], name)
    for argv in (["import", str(folder), "--out", str(tmp_path / "r")],
                 ["generate", str(folder), "--max-new-tokens", "2"],
                 ["export", str(folder), "--to", "hf", str(tmp_path / "x")]):
        line = _import_err(argv, capsys)
        assert str(folder / name) in line and "--allow-pickle" in line and "weights_only=True" in line
    assert not (tmp_path / "r").exists()


def test_allow_pickle_imports_a_real_tiny_model_exactly(llama_dir, tmp_path: Path, capsys) -> None:
    folder = _pickle_folder(tmp_path, llama_dir[0])
    assert main(["import", str(folder), "--out", str(tmp_path / "run"), "--allow-pickle"]) == 0
    run = load_run(tmp_path / "run")
    x = torch.randint(0, 257, (2, 16))
    with torch.no_grad():
        assert torch.equal(run.model(x), llama_dir[1](x))
    ckpt_files = {p.suffix for p in (tmp_path / "run").rglob("*") if p.is_file()}
    assert not ckpt_files & {".bin", ".pt", ".pth", ".ckpt"}  # the run folder itself holds no pickle


class _RunsCode:
    """Unpickling this calls os.system: the weights_only unpickler must refuse it."""

    def __init__(self, marker: Path) -> None:
        self.marker = marker

    def __reduce__(self):
        return (os.system, (f"touch {self.marker}",))


def test_allow_pickle_still_never_runs_a_pickles_code(llama_dir, tmp_path: Path, capsys) -> None:
    folder = _pickle_folder(tmp_path, llama_dir[0])
    marker = tmp_path / "MARKER"
    torch.save({"model.embed_tokens.weight": _RunsCode(marker)}, folder / "pytorch_model.bin")
    line = _import_err(["import", str(folder), "--out", str(tmp_path / "r"), "--allow-pickle"], capsys)
    assert "weights_only=True" in line and str(folder / "pytorch_model.bin") in line
    assert not marker.exists()


def test_safetensors_win_over_pickles_and_shard_indexes_stay_in_the_folder(llama_dir, tmp_path: Path,
                                                                          capsys) -> None:
    folder = tmp_path / "both"
    shutil.copytree(llama_dir[0], folder)
    (folder / "training_args.bin").write_bytes(b"not even a pickle: never opened")
    assert main(["import", str(folder), "--out", str(tmp_path / "r")]) == 0  # no flag needed: .bin never read
    (folder / "model.safetensors").rename(folder / "model-00001-of-00001.safetensors")
    index = folder / "model.safetensors.index.json"
    index.write_text(json.dumps({"weight_map": {"lm_head.weight": "../../outside.safetensors"}}))
    capsys.readouterr()
    line = _import_err(["import", str(folder), "--out", str(tmp_path / "r2")], capsys)
    assert str(index) in line and "outside.safetensors" in line


@pytest.mark.parametrize("damage", ["drop a weight", "config disagrees with the weights"])
def test_weights_that_are_not_the_configs_model_are_refused_not_randomly_filled(llama_dir, tmp_path: Path, capsys,
                                                                               damage: str) -> None:
    """transformers only warns (a multi-line report) and fills such weights randomly; we refuse by name."""
    from safetensors.torch import save_file

    folder = tmp_path / "f"
    shutil.copytree(llama_dir[0], folder)
    if damage == "drop a weight":
        sd = load_file(folder / "model.safetensors")
        del sd["model.layers.1.mlp.up_proj.weight"]
        save_file(sd, folder / "model.safetensors", metadata={"format": "pt"})
        needle = "lack 'model.layers.1.mlp.up_proj.weight'"
    else:
        cfg = json.loads((folder / "config.json").read_text())
        (folder / "config.json").write_text(json.dumps({**cfg, "vocab_size": 100}))
        needle = "model.embed_tokens.weight has shape (257, 64), the config implies (100, 64)"
    line = _import_err(["import", str(folder), "--out", str(tmp_path / "r")], capsys)
    assert needle in line and str(folder) in line


@pytest.mark.parametrize("slow", [None, "tokenizer.model", "vocab.json"])
@pytest.mark.parametrize("command", ["import", "generate"])
def test_a_folder_without_tokenizer_json_is_one_error_that_says_how_to_convert(llama_dir, tmp_path: Path, capsys,
                                                                              slow: str | None, command: str) -> None:
    """A Llama-2-style folder ships only SentencePiece's tokenizer.model: the error says how transformers
    writes the tokenizer.json we read (the conversion itself is transformers', never run by us)."""
    folder = tmp_path / "no_tok"
    folder.mkdir()
    for name in ("config.json", "model.safetensors"):
        (folder / name).write_bytes((llama_dir[0] / name).read_bytes())
    if slow is not None:
        (folder / slow).write_bytes(b"\x0a\x05<unk>")
    argv = ["import", str(folder), "--out", str(tmp_path / "run")] if command == "import" else \
        ["generate", str(folder), "--max-new-tokens", "2"]
    assert main(argv) == 2
    line = _one_error_line(capsys.readouterr().err)
    assert f"{folder} has no tokenizer.json" in line
    if slow is None:
        assert "transformers converts" not in line
    else:
        assert f"it has {slow}, which transformers converts" in line
        assert f"AutoTokenizer.from_pretrained('{folder}').save_pretrained('{folder}')" in line
    assert not (tmp_path / "run").exists() and sorted(p.name for p in folder.iterdir()) == \
        sorted(["config.json", "model.safetensors", *([slow] if slow else [])])


@pytest.mark.parametrize("command", ["import", "export"])
@pytest.mark.parametrize(("field", "value"), [("attention_dropout", 0.1), ("router_jitter_noise", 0.3),
                                              ("resid_pdrop", 0.1), ("attention_dropout", 0.0)])
def test_a_training_only_field_left_behind_is_one_warning_naming_it(llama_dir, tmp_path: Path, command: str,
                                                                     field: str, value: float) -> None:
    """Dropout and router jitter act only in training; TransformerLM has neither, so a folder that
    sets one imports (or re-exports) with the same eval-mode function, and the run says what it left."""
    folder = tmp_path / "f"
    shutil.copytree(llama_dir[0], folder)
    cfg = json.loads((folder / "config.json").read_text())
    (folder / "config.json").write_text(json.dumps({**cfg, field: value}))
    out = tmp_path / "out"
    argv = ["import", str(folder), "--out", str(out)] if command == "import" else \
        ["export", str(folder), "--to", "hf", str(out)]
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        assert main(argv) == 0
    warned = [str(w.message) for w in caught if "not carried over" in str(w.message)]
    if value:
        assert len(warned) == 1 and f"{field}={value}" in warned[0] and str(folder / "config.json") in warned[0]
    else:
        assert warned == []
    assert out.is_dir()
