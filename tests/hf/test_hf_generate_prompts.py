"""``hybridnorm generate --prompt A --prompt B ...``: the prompts as one left-padded batch. Oracles: greedy, the
same command with each prompt alone; sampled, transformers' ``generate`` of the exported folder given the
same prompts as its tokenizer left-pads them (``padding_side="left"``), after ``torch.manual_seed(seed)``."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from train_helpers import cli_in_process

transformers = pytest.importorskip("transformers")

PROMPTS = ["And God said", "In the beginning God created the heaven", "Behold"]  # three lengths
FLAGS = dict(temperature=0.8, top_k=0, top_p=0.9, min_p=0.05, repetition_penalty=1.3)


def _args(source: Path, *extra: str) -> list[str]:
    return ["generate", str(source), *[w for p in PROMPTS for w in ("--prompt", p)], "--max-new-tokens=30", *extra]


@pytest.mark.parametrize("extra", [[], ["--repetition-penalty=1.3"], ["--ignore-eos"]])
def test_greedy_prompts_together_print_what_each_prints_alone(trained_run: Path, extra: list[str]) -> None:
    flags = ["--temperature=0", *extra]
    alone = [cli_in_process("generate", str(trained_run), "--prompt", p, "--max-new-tokens=30", *flags).stdout
             for p in PROMPTS]
    assert all(len(a) > len(p) + 5 for a, p in zip(alone, PROMPTS, strict=True))
    assert cli_in_process(*_args(trained_run, *flags)).stdout == "\n".join(alone)  # a blank line between


@pytest.mark.parametrize("seed", [3, 11])
def test_sampled_prompts_draw_what_transformers_draws_for_the_padded_batch(trained_run: Path, exported: Path,
                                                                          seed: int) -> None:
    tok = transformers.AutoTokenizer.from_pretrained(exported)
    model = transformers.AutoModelForCausalLM.from_pretrained(exported).eval()
    batch = tok(PROMPTS, return_tensors="pt", padding=True, padding_side="left")
    torch.manual_seed(seed)
    with torch.no_grad():
        out = model.generate(**batch, max_new_tokens=30, do_sample=True, **FLAGS)
    width, eos = batch.input_ids.shape[1], tok.eos_token_id
    want = []
    for row, real in zip(out.tolist(), batch.attention_mask.sum(1).tolist(), strict=True):
        new = row[width:]
        new = new[:new.index(eos) + 1] if eos in new else new  # transformers pads a finished row with eos
        want.append(tok.decode(row[width - real + 1:width] + new))  # after the start token, as the command
    flags = [f"--{k.replace('_', '-')}={v}" for k, v in FLAGS.items()]
    for source in (trained_run, exported):
        got = cli_in_process(*_args(source, f"--seed={seed}", *flags)).stdout
        assert got == "\n\n".join(want) + "\n", source
    alone = [cli_in_process("generate", str(exported), "--prompt", p, "--max-new-tokens=30", f"--seed={seed}",
                            *flags).stdout for p in PROMPTS]
    assert "\n".join(alone) != got  # the rows drew from one stream, as transformers' batch does


def test_every_prompt_is_checked_and_the_window_counts_the_longest(trained_run: Path) -> None:
    bad = cli_in_process("generate", str(trained_run), "--prompt", "ok", "--prompt", "\udcff", ok=False)
    assert bad.stderr.startswith("error: --prompt='\\udcff' is not valid UTF-8 text") and bad.stdout == ""
    long = "In the beginning " * 40  # the byte-level model's window is its seq_len
    over = cli_in_process("generate", str(trained_run), "--prompt", "a", "--prompt", long, "--max-new-tokens=5",
                          ok=False)
    assert over.stderr.startswith("error: a prompt of ") and "max_seq_len" in over.stderr and over.stdout == ""
    assert "(--prompt 2)" in over.stderr  # which one
