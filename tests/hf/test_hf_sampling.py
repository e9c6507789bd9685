"""Sampling draws what transformers' ``generate()`` draws. Oracle: transformers' own decoding loop and logits
processors (``generate(do_sample=True, temperature=..., top_k=..., top_p=..., min_p=...,
repetition_penalty=...)`` after ``torch.manual_seed(s)``) on ``HybridNormForCausalLM`` with the weights of
our ``TransformerLM``, whose ``generate`` gets a generator seeded with ``s``: the same tokens, every one.
Then the command: ``hybridnorm generate`` of a run and of its export with sampling flags prints the text
``AutoModelForCausalLM.generate`` of the export samples with the same seed."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

pytest.importorskip("transformers", reason="the hf extra (transformers) is not installed")

from test_hf_generate import pair, prompts  # tests/hf/: tiny randomized HF model + TransformerLM twins
from train_helpers import cli_in_process  # tests/

import hybridnorm.hf  # noqa: F401  (registers the Auto classes)
from hybridnorm import TransformerLM
from hybridnorm.hf import HybridNormForCausalLM
from hybridnorm.nn.sampling import Sampling

NEW, SEEDS = 24, (0, 1, 2)

# every filter alone, and together, as a user would combine them (transformers' order: the penalty on the
# raw logits, then temperature, top-k, top-p, min-p)
SETTINGS = [
    dict(temperature=0.9, top_k=20),
    dict(temperature=1.0, top_k=0, top_p=0.7),
    dict(temperature=1.4, top_k=0, min_p=0.15),
    dict(temperature=1.0, top_k=0, repetition_penalty=1.6),
    dict(temperature=1.0, top_k=0, repetition_penalty=0.6),
    dict(temperature=0.7, top_k=30, top_p=0.9, min_p=0.05, repetition_penalty=1.3),
    dict(temperature=2.0, top_k=40, top_p=0.6, min_p=0.1),
]


@pytest.fixture(scope="module")
def models() -> tuple[HybridNormForCausalLM, TransformerLM]:
    """An HF model and a TransformerLM with the same randomized weights (norm gains included)."""
    return pair(n_layers=2)


def ours_sampled(ours: TransformerLM, x: torch.Tensor, seed: int, **kw) -> torch.Tensor:
    return ours.generate(x, NEW, generator=torch.Generator().manual_seed(seed), **kw)


@pytest.mark.parametrize("kw", SETTINGS, ids=lambda kw: ",".join(f"{k}={v}" for k, v in kw.items()))
@torch.no_grad()
def test_sampling_draws_the_tokens_transformers_generate_draws(models, kw: dict) -> None:
    hf, ours = models
    x = prompts()
    changed = False
    for seed in SEEDS:
        torch.manual_seed(seed)
        want = hf.generate(x, max_new_tokens=NEW, min_new_tokens=NEW, do_sample=True, **kw)
        got = ours_sampled(ours, x, seed, **kw)
        assert torch.equal(got, want), (seed, got[:, -NEW:].tolist(), want[:, -NEW:].tolist())
        plain = ours_sampled(ours, x, seed, temperature=kw["temperature"])  # no filter, no penalty
        changed |= not torch.equal(got, plain)
    assert changed, "the setting never changed a draw: the comparison above would not see it ignored"


@pytest.mark.parametrize("penalty", [1.5, 0.7])
@torch.no_grad()
def test_greedy_decoding_applies_the_repetition_penalty_as_transformers(models, penalty: float) -> None:
    hf, ours = models
    x = prompts()
    want = hf.generate(x, max_new_tokens=NEW, min_new_tokens=NEW, do_sample=False, repetition_penalty=penalty)
    got = ours.generate(x, NEW, temperature=0, repetition_penalty=penalty)
    assert torch.equal(got, want)
    assert not torch.equal(got, ours.generate(x, NEW, temperature=0))  # the penalty changed the text


def test_each_filter_against_its_definition() -> None:
    """Hand-made logits whose answer is known: top-p keeps the fewest tokens reaching p, min-p those at or above
    min_p x the top probability, the penalty divides positive and multiplies negative logits of seen tokens."""
    probs = torch.tensor([[0.5, 0.25, 0.15, 0.1]])
    logits = probs.log()
    kept = lambda s: torch.isfinite(s.filtered(logits))[0].tolist()  # noqa: E731
    assert kept(Sampling(top_p=0.5)) == [True, False, False, False]  # 0.5 reaches 0.5
    assert kept(Sampling(top_p=0.6)) == [True, True, False, False]
    assert kept(Sampling(top_p=0.9)) == [True, True, True, False]   # 0.9 needs the third
    assert kept(Sampling(top_p=1e-9)) == [True, False, False, False]  # the top token always stays
    assert kept(Sampling(min_p=0.3)) == [True, True, True, False]   # 0.15 >= 0.3 x 0.5; 0.1 is not
    # after the temperature: at T = 0.5 the probabilities are ∝ p² (0.725, 0.181, 0.065, 0.029)
    assert kept(Sampling(min_p=0.2, temperature=0.5)) == [True, True, False, False]
    seen = torch.tensor([[True, False, True, False]])
    raw = torch.tensor([[2.0, 1.0, -1.0, 0.5]])
    assert Sampling(repetition_penalty=2.0).penalize(raw, seen).tolist() == [[1.0, 1.0, -2.0, 0.5]]


FLAGS = dict(temperature=0.8, top_k=0, top_p=0.9, min_p=0.05, repetition_penalty=1.3)
PROMPT = "And God said"


@pytest.mark.parametrize("seed", [3, 11])
def test_the_command_samples_what_transformers_samples_from_the_export(trained_run: Path, exported: Path,
                                                                       seed: int) -> None:
    import transformers

    tok = transformers.AutoTokenizer.from_pretrained(exported)
    model = transformers.AutoModelForCausalLM.from_pretrained(exported).eval()
    prompt = tok(PROMPT, return_tensors="pt").input_ids
    torch.manual_seed(seed)
    with torch.no_grad():
        out = model.generate(prompt, max_new_tokens=30, do_sample=True, **FLAGS)[0].tolist()
    want = tok.decode(out[1:])  # as `hybridnorm generate` prints: everything after the start token
    flags = [f"--{k.replace('_', '-')}={v}" for k, v in FLAGS.items()]
    for source in (trained_run, exported):
        got = cli_in_process("generate", str(source), "--prompt", PROMPT, "--max-new-tokens=30", f"--seed={seed}",
                             *flags).stdout
        assert got == want + "\n", source  # print's newline
    default = cli_in_process("generate", str(exported), "--prompt", PROMPT, "--max-new-tokens=30",
                             f"--seed={seed}").stdout
    assert default != want + "\n"  # the flags were used


def test_the_command_chooses_its_device_and_the_cpu_is_the_default_without_a_gpu(exported: Path) -> None:
    args = ["generate", str(exported), "--prompt", PROMPT, "--max-new-tokens=20", "--seed=5"]
    on_cpu = cli_in_process(*args, "--device", "cpu").stdout
    assert len(on_cpu) > len(PROMPT) + 5
    if not torch.cuda.is_available():
        assert cli_in_process(*args).stdout == on_cpu


@pytest.mark.cuda
@pytest.mark.parametrize("seed", [3, 11])
def test_on_a_gpu_the_command_samples_what_transformers_samples_there(trained_run: Path, exported: Path,
                                                                      seed: int) -> None:
    """``generate --device cuda`` draws from the GPU's own generator seeded with ``--seed``: the stream
    transformers' generate draws from on the GPU after ``torch.manual_seed(seed)``; the same weights on the GPU,
    the export and the run alike (and greedy text as on the CPU)."""
    import transformers

    tok = transformers.AutoTokenizer.from_pretrained(exported)
    model = transformers.AutoModelForCausalLM.from_pretrained(exported).cuda().eval()
    prompt = tok(PROMPT, return_tensors="pt").input_ids.cuda()
    torch.manual_seed(seed)
    with torch.no_grad():
        out = model.generate(prompt, max_new_tokens=30, do_sample=True, **FLAGS)[0].tolist()
    want = tok.decode(out[1:])
    flags = [f"--{k.replace('_', '-')}={v}" for k, v in FLAGS.items()]
    for source in (trained_run, exported):
        got = cli_in_process("generate", str(source), "--prompt", PROMPT, "--max-new-tokens=30", f"--seed={seed}",
                             "--device", "cuda", *flags).stdout
        assert got == want + "\n", source
    greedy = ["generate", str(exported), "--prompt", PROMPT, "--max-new-tokens=30", "--temperature=0"]
    assert cli_in_process(*greedy, "--device", "cuda").stdout == cli_in_process(*greedy, "--device", "cpu").stdout
