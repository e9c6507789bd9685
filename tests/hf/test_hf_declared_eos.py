"""A tokenizer whose end-of-text token is none of our aliases, declared the Hugging Face way by its folder:
DeepSeek's ``<｜end▁of▁sentence｜>`` (its V3 and R1 models, and the R1-Distill-Llama models that
``hybridnorm import`` reads). Before, such a folder was refused ("no end-of-text token"). Now the folder's
``eos_token`` is the end-of-text token, and it travels with the tokenizer: into the data cache (documents are
separated by it, the cache key covers it), the run folder, every checkpoint's copy of the run files, the
resume guard, ``export`` and ``import``. Oracles: transformers' own reading of the same folder
(``AutoTokenizer``), a stock ``LlamaForCausalLM`` greedy loop, and the token files counted by hand."""

from __future__ import annotations

import hashlib
import json
import shutil
from pathlib import Path

import numpy as np
import pytest
import torch

pytest.importorskip("transformers", reason="the hf extra (transformers) is not installed")
from eos_helpers import BOS, EOS, PAD, deepseek_tokenizer, save_folder  # tests/hf/
from train_helpers import cli_in_process, tiny_overrides

from hybridnorm.data import load_tokenizer, prepare_data
from hybridnorm.data.tokenizer import BPETokenizer
from hybridnorm.errors import ConfigError
from hybridnorm.loading import load_run
from hybridnorm.train.checkpoint import CheckpointError
from hybridnorm.train.config import TrainConfig, apply_overrides

PROMPT = "The lord said unto"


@pytest.fixture(scope="module")
def hf_tok(corpus: Path):
    return deepseek_tokenizer(corpus)


@pytest.fixture(scope="module")
def folder(tmp_path_factory: pytest.TempPathFactory, hf_tok) -> Path:
    return save_folder(hf_tok, tmp_path_factory.mktemp("ds") / "r1_distill_style", model=True)


cli = cli_in_process  # the command's own main, in this process


def test_the_folders_declared_eos_is_the_end_of_text_token_as_transformers_reads_it(folder: Path) -> None:
    import transformers

    theirs = transformers.AutoTokenizer.from_pretrained(folder)
    assert (theirs.eos_token, theirs.bos_token) == (EOS, BOS)
    for path in (folder, folder / "tokenizer.json"):
        tok = load_tokenizer(path)
        assert (tok.eot_id, tok.start_id) == (theirs.eos_token_id, theirs.bos_token_id) == (1, 0)
        assert tok.declared_eos == EOS and tok.files == ("tokenizer.json", "tokenizer_config.json")
        assert tok.encode(PROMPT) == theirs(PROMPT, add_special_tokens=False).input_ids


@pytest.mark.parametrize("eos_value", [EOS, {"content": EOS, "lstrip": False, "normalized": False,
                                             "rstrip": False, "single_word": False, "special": True}])
def test_special_tokens_map_declares_it_when_tokenizer_config_does_not(tmp_path: Path, hf_tok, eos_value) -> None:
    hf_tok.save(str(tmp_path / "tokenizer.json"))
    (tmp_path / "tokenizer_config.json").write_text(json.dumps({"model_max_length": 4096, "eos_token": None}))
    (tmp_path / "special_tokens_map.json").write_text(json.dumps({"bos_token": BOS, "eos_token": eos_value}))
    assert load_tokenizer(tmp_path).eot_id == hf_tok.token_to_id(EOS)


def test_a_vocabulary_with_an_alias_keeps_it_and_reads_no_other_file(tmp_path: Path, corpus: Path) -> None:
    """Qwen's chat models declare <|im_end|>, Llama 3 Instruct <|eot_id|>: their documents' separator stays
    the alias, the fingerprint is the file's alone, and a broken declaring file beside it is never read."""
    hf = deepseek_tokenizer(corpus, specials=("<|endoftext|>", "<|im_end|>"))
    hf.save(str(tmp_path / "tokenizer.json"))
    (tmp_path / "tokenizer_config.json").write_text(json.dumps({"eos_token": "<|im_end|>"}))
    tok = load_tokenizer(tmp_path)
    assert tok.eot_id == hf.token_to_id("<|endoftext|>") and tok.declared_eos is None
    assert tok.fingerprint == hashlib.sha256(hf.to_str().encode()).hexdigest() == BPETokenizer(hf).fingerprint
    assert tok.files == ("tokenizer.json",)
    (tmp_path / "tokenizer_config.json").write_text("{ not json")
    assert load_tokenizer(tmp_path).fingerprint == tok.fingerprint


@pytest.mark.parametrize(("files", "error"), [
    ({}, r"has no end-of-text token \(one of <\|endoftext\|>, .*\), and no tokenizer_config\.json or "
         r"special_tokens_map\.json beside it names one \(eos_token\)"),
    ({"tokenizer_config.json": {"eos_token": None}}, "has no end-of-text token"),
    ({"tokenizer_config.json": {"eos_token": "<nope>"}}, r"its declared eos_token '<nope>' is not one of its tokens"),
    ({"tokenizer_config.json": {"eos_token": 5}}, r"tokenizer_config\.json: eos_token must be a token .*got 5"),
    ({"tokenizer_config.json": {"eos_token": ""}}, r"tokenizer_config\.json: eos_token must be a token"),
    ({"tokenizer_config.json": "{ not json"}, r"cannot read .*tokenizer_config\.json: "),
    ({"special_tokens_map.json": {"eos_token": {"content": 7}}}, r"special_tokens_map\.json: eos_token must be"),
    ({"tokenizer_config.json": "[" * 100_000}, r"cannot read .*tokenizer_config\.json: .*nest"),
])
def test_a_missing_or_bad_declaration_is_one_error_naming_the_file(tmp_path: Path, hf_tok, files, error) -> None:
    hf_tok.save(str(tmp_path / "tokenizer.json"))
    for name, content in files.items():
        (tmp_path / name).write_text(content if isinstance(content, str) else json.dumps(content))
    with pytest.raises(ConfigError, match=error):
        load_tokenizer(tmp_path / "tokenizer.json")


def test_saved_it_writes_its_declaration_and_the_fingerprint_covers_it(tmp_path: Path, folder: Path,
                                                                       hf_tok) -> None:
    tok = load_tokenizer(folder)
    tok.save(tmp_path / "copy")
    assert json.loads((tmp_path / "copy" / "tokenizer_config.json").read_text(encoding="utf-8")) == {"eos_token": EOS}
    again = load_tokenizer(tmp_path / "copy" / "tokenizer.json")
    assert (again.eot_id, again.start_id, again.fingerprint) == (tok.eot_id, tok.start_id, tok.fingerprint)
    other = load_tokenizer(save_folder(hf_tok, tmp_path / "pad_eos", eos=PAD))  # the same tokenizer.json
    assert other.hf.to_str() == tok.hf.to_str() and other.eot_id == hf_tok.token_to_id(PAD)
    assert other.fingerprint != tok.fingerprint != hashlib.sha256(tok.hf.to_str().encode()).hexdigest()


def test_prepared_documents_are_separated_by_the_declared_token(tmp_path: Path, corpus: Path, folder: Path,
                                                                hf_tok) -> None:
    pad_folder = save_folder(hf_tok, tmp_path / "pad_eos", eos=PAD)
    n_docs = {}
    for f, eos in ((folder, EOS), (pad_folder, PAD)):
        data = prepare_data(str(corpus), tokenizer=str(f / "tokenizer.json"), cache_dir=tmp_path / "cache")
        assert data.tokenizer.eot_id == hf_tok.token_to_id(eos)
        train = np.asarray(data.train_tokens())
        n_docs[eos] = (data.stats.train_docs, data.dir)
        # every document: BOS, its tokens, the end-of-text token (data/tokens.py); the text has neither
        assert (train == hf_tok.token_to_id(eos)).sum() == (train == hf_tok.token_to_id(BOS)).sum() \
            == data.stats.train_docs > 0
        assert train[0] == hf_tok.token_to_id(BOS) and train[-1] == hf_tok.token_to_id(eos)
        hit = prepare_data(str(corpus), tokenizer=str(f / "tokenizer.json"), cache_dir=tmp_path / "cache")
        assert hit.cached and hit.dir == data.dir and hit.tokenizer.eot_id == data.tokenizer.eot_id
    assert n_docs[EOS][1] != n_docs[PAD][1]  # two tokenizers, two cache entries


def test_train_checkpoint_resume_export_and_generate_carry_it(tmp_path: Path, corpus: Path, folder: Path,
                                                              monkeypatch: pytest.MonkeyPatch) -> None:
    import transformers

    import hybridnorm.train.trainer as trainer

    monkeypatch.setattr(trainer, "measured_peak_flops", lambda *a, **k: 1e12)
    own = tmp_path / "tok"  # a folder of the user's, which the test edits later
    shutil.copytree(folder, own)
    run = tmp_path / "run"
    args = [a for a in tiny_overrides(corpus, tmp_path / "cache", run) if not a.startswith("--data.tokenizer")]

    def cfg(steps: int) -> TrainConfig:
        return TrainConfig.from_dict(apply_overrides({}, [*args, f"--data.tokenizer={own / 'tokenizer.json'}",
                                                          "--model.vocab_size=320", f"--max_steps={steps}"]))

    trainer.train(cfg(2), quiet=True)
    ckpt = run / "checkpoints" / "step_000002"
    manifest = json.loads((ckpt / "manifest.json").read_text())
    assert "tokenizer_config.json" in manifest
    assert json.loads((ckpt / "tokenizer_config.json").read_text(encoding="utf-8")) == {"eos_token": EOS}
    trainer.train(cfg(3), resume=True, quiet=True)  # resumes: the recorded tokenizer is this one
    assert (run / "checkpoints" / "step_000003").is_dir()

    (own / "tokenizer_config.json").write_text(json.dumps({"eos_token": PAD}))  # another separator now
    with pytest.raises(ConfigError, match=r"cannot resume .* with another tokenizer"):
        trainer.train(cfg(4), resume=True, quiet=True)

    moved = tmp_path / "moved_step"  # a checkpoint copied out of its run opens with its own copies
    shutil.copytree(run / "checkpoints" / "step_000003", moved)
    out = cli("generate", str(moved), "--prompt", PROMPT, "--temperature", "0", "--max-new-tokens", "4")
    assert out.stdout.strip()
    (moved / "tokenizer_config.json").write_text(json.dumps({"eos_token": PAD}))  # not what it was written with
    with pytest.raises(CheckpointError, match=r"moved_step/tokenizer_config\.json is truncated or corrupt"):
        load_run(moved)

    cli("export", str(run), "--to", "hf", str(tmp_path / "exported"))
    exported = transformers.AutoTokenizer.from_pretrained(tmp_path / "exported")
    config = json.loads((tmp_path / "exported" / "config.json").read_text())
    assert exported.eos_token == EOS and config["eos_token_id"] == exported.eos_token_id == 1
    assert exported(PROMPT).input_ids[0] == exported.bos_token_id == 0


def test_a_stray_declaration_in_a_checkpoint_is_refused(tmp_path: Path, tiny_run: Path) -> None:
    """A checkpoint whose tokenizer has an alias records no tokenizer_config.json: one dropped in later is not
    what it was written with (and is never read in its place)."""
    ckpt = tmp_path / "step"
    shutil.copytree(sorted((tiny_run / "checkpoints").iterdir())[-1], ckpt)
    load_run(ckpt)
    (ckpt / "tokenizer_config.json").write_text(json.dumps({"eos_token": "<|endoftext|>"}))
    with pytest.raises(CheckpointError, match=r"step/tokenizer_config\.json is not recorded in .*manifest\.json"):
        load_run(ckpt)


def test_import_reads_the_folder_and_generate_equals_the_stock_model(tmp_path: Path, folder: Path) -> None:
    import transformers

    cli("import", str(folder), "--out", str(tmp_path / "imported"))
    ckpt = tmp_path / "imported" / "checkpoints" / "step_000000"
    assert "tokenizer_config.json" in json.loads((ckpt / "manifest.json").read_text())
    assert load_tokenizer(tmp_path / "imported" / "tokenizer.json").eot_id == 1

    tok = transformers.AutoTokenizer.from_pretrained(folder)
    model = transformers.LlamaForCausalLM.from_pretrained(folder).eval()
    ids = tok(PROMPT).input_ids
    with torch.no_grad():
        for _ in range(8):
            ids.append(int(model(torch.tensor([ids])).logits[0, -1].argmax()))
    for source in (folder, tmp_path / "imported"):  # the folder as it is, and the run folder made of it
        out = cli("generate", str(source), "--prompt", PROMPT, "--temperature", "0", "--max-new-tokens", "8")
        assert out.stdout.rstrip("\n") == tok.decode(ids[1:])
