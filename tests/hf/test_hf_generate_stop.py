"""``hybridnorm generate`` stops where transformers' ``generate`` stops: after the end-of-text token, and for
a Hugging Face folder also after any other eos id the folder lists (Llama 3 Instruct's ``<|eot_id|>``,
Qwen3's ``<|im_end|>``); ``--ignore-eos`` goes on. Oracle: a stock ``LlamaForCausalLM`` and its
``generate``, on DeepSeek-style folders whose eos is made a token the model emits a few steps in, so that
where the two stop can be compared (a random model emits a real end-of-text token by chance only)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

pytest.importorskip("transformers", reason="the hf extra (transformers) is not installed")
from eos_helpers import EOS, PAD, deepseek_tokenizer, save_folder  # tests/hf/

PROMPT, N = "The lord said unto", 12


def cli(*args: str, ok: bool = True) -> subprocess.CompletedProcess:
    done = subprocess.run([sys.executable, "-m", "hybridnorm.cli", *args], capture_output=True, text=True,
                          timeout=300)
    assert (done.returncode == 0) == ok, done.stderr[-3000:]
    return done


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
