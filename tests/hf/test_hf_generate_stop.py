"""``hybridnorm generate`` stops where transformers' ``generate`` stops: after the end-of-text token, and for
a Hugging Face folder also after any other eos id the folder lists (Llama 3 Instruct's ``<|eot_id|>``,
Qwen3's ``<|im_end|>``); ``--ignore-eos`` goes on. Oracle: a stock ``LlamaForCausalLM`` and its
``generate``, on DeepSeek-style folders whose eos is made a token the model emits a few steps in, so that
where the two stop can be compared (a random model emits a real end-of-text token by chance only)."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
import torch
import yaml

pytest.importorskip("transformers", reason="the hf extra (transformers) is not installed")
from eos_helpers import EOS, PAD, deepseek_tokenizer, fine_tune, save_folder  # tests/hf/
from train_helpers import cli_in_process  # tests/

PROMPT, N = "The lord said unto", 12


cli = cli_in_process  # the command's own main, in this process


def generate(source: Path, *extra: str) -> str:
    return cli("generate", str(source), "--prompt", PROMPT, "--temperature", "0", "--max-new-tokens", str(N),
               *extra).stdout.rstrip("\n")


@pytest.fixture(scope="module")
def greedy(tmp_path_factory: pytest.TempPathFactory, corpus: Path):
    """(tokenizer, the prompt's ids + N greedy tokens of the stock model without any stop, a token first
    emitted at step k >= 2)."""
    import transformers

    hf = deepseek_tokenizer(corpus)
    first = save_folder(hf, tmp_path_factory.mktemp("first") / "f", model=True)
    tok = transformers.AutoTokenizer.from_pretrained(first)
    model = transformers.LlamaForCausalLM.from_pretrained(first).eval()
    ids = tok(PROMPT).input_ids
    with torch.no_grad():  # full forwards
        for _ in range(N):
            ids.append(int(model(torch.tensor([ids])).logits[0, -1].argmax()))
    new = ids[-N:]
    k = next(i for i in range(2, N) if new[i] not in new[:i] and new[i] not in (hf.token_to_id(PAD),
                                                                                hf.token_to_id(EOS)))
    return hf, ids, new[k]


def stock_generate(folder: Path, stop: int) -> str:
    """transformers' greedy generate of the folder, checked to stop right after ``stop``."""
    import transformers

    tok = transformers.AutoTokenizer.from_pretrained(folder)
    model = transformers.LlamaForCausalLM.from_pretrained(folder).eval()
    prompt = tok(PROMPT, return_tensors="pt").input_ids
    out = model.generate(prompt, max_new_tokens=N, do_sample=False)[0].tolist()
    assert out[-1] == stop and len(out) < prompt.shape[1] + N  # it stopped early, at the chosen token
    return tok.decode(out[1:])  # as `hybridnorm generate` prints: everything after the start token


def test_generate_stops_after_the_end_of_text_token_as_transformers(tmp_path: Path, greedy) -> None:
    """The tokenizer's declared eos is the emitted token: the end-of-text token of the folder and of the run
    imported from it."""
    hf, ids, stop = greedy
    folder = save_folder(hf, tmp_path / "stops", eos=hf.id_to_token(stop), model=True)  # the same weights
    want = stock_generate(folder, stop)
    assert want.startswith(PROMPT)
    cli("import", str(folder), "--out", str(tmp_path / "imported"))
    full = autotokenizer_decode(folder, ids[1:])
    for source in (folder, tmp_path / "imported"):
        assert generate(source) == want
        assert generate(source, "--ignore-eos") == full


@pytest.mark.parametrize("where", ["generation_config.json", "config.json"])
def test_a_folders_other_eos_ids_stop_it_too(tmp_path: Path, greedy, where: str) -> None:
    """Llama 3 Instruct's shape: the tokenizer's eos is one id, the folder lists more (generation_config.json,
    else config.json), and transformers stops at any of them."""
    hf, ids, stop = greedy
    folder = save_folder(hf, tmp_path / "listed", model=True)
    if where == "config.json":
        (folder / "generation_config.json").unlink(missing_ok=True)
    data = json.loads((folder / where).read_text())
    data["eos_token_id"] = [hf.token_to_id(EOS), stop, 10**6]  # an id past the vocabulary is never emitted
    (folder / where).write_text(json.dumps(data))
    assert generate(folder) == stock_generate(folder, stop)
    assert generate(folder, "--ignore-eos") == autotokenizer_decode(folder, ids[1:])


@pytest.mark.parametrize("value", ["x", [1, 2.5], {"a": 1}, True])
def test_a_malformed_eos_list_is_one_error_naming_the_file(tmp_path: Path, greedy, value: object) -> None:
    from hybridnorm.errors import ConfigError
    from hybridnorm.hf.folder import eos_ids

    hf, _, _ = greedy
    folder = save_folder(hf, tmp_path / "bad", model=True)
    data = json.loads((folder / "generation_config.json").read_text())
    (folder / "generation_config.json").write_text(json.dumps({**data, "eos_token_id": value}))
    with pytest.raises(ConfigError, match=r"generation_config\.json: eos_token_id=.* must be a token id or a list"):
        eos_ids(folder, 320)
    if value == "x":  # as the command line says it
        err = cli("generate", str(folder), "--prompt", PROMPT, ok=False).stderr.strip().splitlines()
        assert len(err) == 1 and "generation_config.json: eos_token_id='x' must be a token id" in err[0], err


def autotokenizer_decode(folder: Path, ids: list[int]) -> str:
    import transformers

    return transformers.AutoTokenizer.from_pretrained(folder).decode(ids)


def listing_folder(hf, path: Path, stop: int) -> Path:
    """Llama 3 Instruct's shape: the tokenizer's eos and one more id, both in generation_config.json."""
    folder = save_folder(hf, path, model=True)
    data = json.loads((folder / "generation_config.json").read_text())
    (folder / "generation_config.json").write_text(json.dumps({**data, "eos_token_id": [hf.token_to_id(EOS), stop]}))
    return folder


def test_an_imported_run_keeps_the_folders_other_eos_ids_and_its_export_lists_them(tmp_path: Path, greedy) -> None:
    """`import` writes the folder's other eos ids into the run's config (data.stop_tokens, as tokens);
    `generate` of the run stops where transformers' `generate` of the folder stops; `export` lists them in
    generation_config.json again, where transformers' `generate` of the export stops too; importing that
    export gives the same run config."""
    from hybridnorm.hf.export import export_run, import_hf
    from hybridnorm.train.config import TrainConfig

    hf, ids, stop = greedy
    folder = listing_folder(hf, tmp_path / "listed", stop)
    want = stock_generate(folder, stop)
    run = tmp_path / "imported"
    cli("import", str(folder), "--out", str(run))
    assert TrainConfig.load(run / "config.yaml").data.stop_tokens == (hf.id_to_token(stop),)
    assert generate(run) == want
    assert generate(run, "--ignore-eos") == autotokenizer_decode(folder, ids[1:])
    exported = tmp_path / "exported"
    export_run(run, exported)  # the command's function (its CLI: tests/hf/test_hf_cli.py)
    listed = json.loads((exported / "generation_config.json").read_text())["eos_token_id"]
    assert listed == [hf.token_to_id(EOS), stop]
    assert json.loads((exported / "config.json").read_text())["eos_token_id"] == hf.token_to_id(EOS)
    assert stock_generate(exported, stop) == want  # the same weights: the same text, stopped at the same token
    assert generate(exported) == want
    import_hf(exported, tmp_path / "again")
    assert (TrainConfig.load(tmp_path / "again" / "config.yaml").data.stop_tokens
            == TrainConfig.load(run / "config.yaml").data.stop_tokens)


def test_fine_tuning_an_imported_run_keeps_its_stop_tokens(tmp_path: Path, greedy, corpus: Path,
                                                           no_peak_measure: None) -> None:
    """The README's fine-tune command (`train RUN/config.yaml --out RUN --resume`) carries data.stop_tokens
    into the new checkpoint's own copy of the config, from which a copied-out checkpoint generates."""
    import shutil

    from hybridnorm.train.config import TrainConfig
    from hybridnorm.train.run import open_run

    hf, _, stop = greedy
    run = tmp_path / "imported"
    cli("import", str(listing_folder(hf, tmp_path / "listed", stop)), "--out", str(run))
    fine_tune(run, corpus, tmp_path / "cache", "--max_steps=1")
    ckpt = run / "checkpoints" / "step_000001"
    assert TrainConfig.load(ckpt / "config.yaml").data.stop_tokens == (hf.id_to_token(stop),)
    shutil.copytree(ckpt, tmp_path / "alone")  # a checkpoint copied out of its run opens on its own
    assert open_run(tmp_path / "alone").stop_ids == (stop,)


def test_a_stop_token_the_tokenizer_lacks_is_one_error(tmp_path: Path, greedy, corpus: Path,
                                                       no_peak_measure: None) -> None:
    """Set by hand: `train --data.stop_tokens=[...]` refuses a token that is not a vocabulary entry before it
    writes anything, and a run config edited to name one is refused by `generate`, naming the file."""
    from train_helpers import tiny_overrides  # tests/

    hf, _, stop = greedy
    run = tmp_path / "imported"
    cli("import", str(listing_folder(hf, tmp_path / "listed", stop)), "--out", str(run))
    ckpt = run / "checkpoints" / "step_000000"  # as written before checkpoints kept a copy of config.yaml:
    manifest = json.loads((ckpt / "manifest.json").read_text())  # the run's own, editable by hand, is read
    del manifest["config.yaml"]
    (ckpt / "manifest.json").write_text(json.dumps(manifest))
    (ckpt / "config.yaml").unlink()
    data = yaml.safe_load((run / "config.yaml").read_text(encoding="utf-8"))
    assert data["data"]["stop_tokens"] == [hf.id_to_token(stop)]
    data["data"]["stop_tokens"] = ["<|no such token|>"]
    (run / "config.yaml").write_text(yaml.safe_dump(data), encoding="utf-8")
    err = cli("generate", str(run), "--prompt", PROMPT, ok=False).stderr.strip().splitlines()
    assert len(err) == 1 and "data.stop_tokens names '<|no such token|>'" in err[0], err
    assert str(run / "config.yaml") in err[0]

    out = tmp_path / "trained"
    args = [*tiny_overrides(corpus, tmp_path / "cache", out), "--max_steps=1"]
    done = cli("train", *args, '--data.stop_tokens=["<|no such token|>"]', ok=False)  # as the command says it
    lines = done.stderr.strip().splitlines()
    assert len(lines) == 1 and "data.stop_tokens names '<|no such token|>', which is not a token of the run's bytes" \
        in lines[0], done.stderr
    assert not out.exists() or not any(out.iterdir())  # the trainer claims the folder; nothing is written

    import hybridnorm.train.trainer as trainer
    from hybridnorm.errors import ConfigError
    from hybridnorm.train.config import TrainConfig, apply_overrides

    for bad, says in (([""], "a stop token is one vocabulary entry, not ''"), ("<|endoftext|>", "must be a list")):
        with pytest.raises(ConfigError, match=r"^data\.stop_tokens=.*" + re.escape(says)):
            TrainConfig.from_dict(apply_overrides({}, [*args, f"--data.stop_tokens={json.dumps(bad)}"]))
    # the byte tokenizer's one named token is its end-of-text token: a valid (if redundant) stop token
    trainer.train(TrainConfig.from_dict(apply_overrides({}, [*args, '--data.stop_tokens=["<|endoftext|>"]'])),
                  quiet=True)
    assert (out / "checkpoints" / "step_000001").is_dir()


def test_lm_eval_generate_until_of_an_imported_run_stops_at_its_stop_tokens(tmp_path: Path, greedy) -> None:
    """lm-eval's own ``simple_evaluate`` of a generate_until task on the imported run: each generation ends
    before the folder's other eos id, as greedy decoding cut there by hand (the greedy ids without it)."""
    pytest.importorskip("lm_eval", reason="the eval extra (lm_eval) is not installed")
    from hybridnorm.eval.lm_eval_adapter import run_lm_eval
    from hybridnorm.eval.scoring import greedy_until
    from hybridnorm.train.run import open_run

    hf, ids, stop = greedy
    run = tmp_path / "imported"
    cli("import", str(listing_folder(hf, tmp_path / "listed", stop)), "--out", str(run))
    data = tmp_path / "gen.jsonl"
    data.write_text(json.dumps({"context": PROMPT, "answer": "x"}) + "\n", encoding="utf-8")
    tasks = tmp_path / "tasks"
    tasks.mkdir()
    (tasks / "tmp_stop.yaml").write_text(
        f"task: tmp_stop\ndataset_path: json\ndataset_kwargs:\n  data_files:\n    test: {data}\n"
        f"  cache_dir: {tmp_path / 'hf-cache'}\ntest_split: test\noutput_type: generate_until\n"
        "doc_to_text: '{{context}}'\ndoc_to_target: '{{answer}}'\ngeneration_kwargs:\n  until: ['\\n\\n\\n']\n"
        f"  max_gen_toks: {N}\n  do_sample: false\nmetric_list:\n  - metric: exact_match\nmetadata:\n  version: 1.0\n",
        encoding="utf-8")
    res = run_lm_eval(run, ["tmp_stop"], include_path=tasks, log_samples=True, include_defaults=False)
    got = res["samples"]["tmp_stop"][0]["filtered_resps"][0]
    new = ids[-N:]
    k = new.index(stop)
    r = open_run(run)
    assert got == r.tokenizer.decode(new[:k])  # lm-eval's context is the prompt without its trailing space
    assert got == greedy_until(r.model, r.tokenizer, PROMPT, ["\n\n\n"], N, stop_ids=[stop])
    assert greedy_until(r.model, r.tokenizer, PROMPT, ["\n\n\n"], N) == r.tokenizer.decode(new)  # unstopped
