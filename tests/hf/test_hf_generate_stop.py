"""``hybridnorm generate`` stops after the end-of-text token, as transformers' ``generate`` stops at the eos
of the same folder (``--ignore-eos`` goes on). Oracle: a stock ``LlamaForCausalLM`` and its ``generate``,
on a DeepSeek-style folder whose declared eos is made a token the model emits a few steps in, so where the
two stop can be compared (a random model emits a real end-of-text token by chance only)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
import torch

pytest.importorskip("transformers", reason="the hf extra (transformers) is not installed")
from eos_helpers import deepseek_tokenizer, save_folder  # tests/hf/

PROMPT, N = "The lord said unto", 12


def cli(*args: str) -> str:
    done = subprocess.run([sys.executable, "-m", "hybridnorm.cli", *args], capture_output=True, text=True,
                          timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    return done.stdout.rstrip("\n")


def test_generate_stops_where_transformers_generate_stops(tmp_path: Path, corpus: Path) -> None:
    import transformers

    hf = deepseek_tokenizer(corpus)
    first = save_folder(hf, tmp_path / "first", model=True)
    tok = transformers.AutoTokenizer.from_pretrained(first)
    model = transformers.LlamaForCausalLM.from_pretrained(first).eval()
    ids = tok(PROMPT).input_ids
    with torch.no_grad():  # the greedy continuation without any stop: full forwards
        for _ in range(N):
            ids.append(int(model(torch.tensor([ids])).logits[0, -1].argmax()))
    new = ids[-N:]
    k = next(i for i in range(2, N) if new[i] not in new[:i] and new[i] != hf.token_to_id("<｜▁pad▁｜>"))
    eos = hf.id_to_token(new[k])  # first emitted at step k: declared the folder's eos (the same weights)
    folder = save_folder(hf, tmp_path / "stops", eos=eos, model=True)

    theirs_tok = transformers.AutoTokenizer.from_pretrained(folder)
    theirs = transformers.LlamaForCausalLM.from_pretrained(folder).eval()
    assert theirs_tok.eos_token_id == theirs.generation_config.eos_token_id == new[k]
    prompt = theirs_tok(PROMPT, return_tensors="pt").input_ids
    out = theirs.generate(prompt, max_new_tokens=N, do_sample=False)[0].tolist()
    assert out == ids[: len(out)] and len(out) == prompt.shape[1] + k + 1  # transformers stopped after it
    want = theirs_tok.decode(out[1:])  # as `hybridnorm generate` prints: everything after the start token

    cli("import", str(folder), "--out", str(tmp_path / "imported"))
    for source in (folder, tmp_path / "imported"):
        args = ("generate", str(source), "--prompt", PROMPT, "--temperature", "0", "--max-new-tokens", str(N))
        assert cli(*args) == want
        assert cli(*args, "--ignore-eos") == tok.decode(ids[1:])
