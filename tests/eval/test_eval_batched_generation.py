"""``generate_until_batch`` (lm-eval's ``generate_until`` requests as one left-padded batch) against its plain
twin ``generate_until`` (one request alone): every reply equal, whatever the batch, its padding, the stop
strings and tokens, the repetition penalty; sampled at a batch of one, the same draws. (That a sampled batch
draws what ``HFLM``'s batch draws is tested against ``HFLM`` itself in test_eval_generation_kwargs.py.)"""

from __future__ import annotations

import copy
import importlib.util
import itertools
from pathlib import Path

import pytest
import torch
from eval_helpers import tiny_model

from hybridnorm.errors import ConfigError
from hybridnorm.eval.batched_generation import generate_until_batch
from hybridnorm.eval.scoring import generate_until
from hybridnorm.nn.sampling import Sampling

L = 48  # the tiny model's max_seq_len
# other lengths, so rows are left-padded by different amounts; one longer than any window (left-truncated)
CONTEXTS = ["the lord said", "", "and", "behold, the river of", "in the beginning god created the heaven",
            "x", "and it came to pass " * 6]


@pytest.fixture(scope="module")
def model64(model):
    """The trained tiny model in float64: a batch's and a row's logits then agree to ~1e-15, so no near-tie
    can flip a greedy choice between the two (in fp32 they agree to rounding, and do here, but not by design)."""
    return copy.deepcopy(model).double()


def batched(model, tok, contexts, batch_size, *args, **kwargs):
    return [text for i in range(0, len(contexts), batch_size)
            for text in generate_until_batch(model, tok, contexts[i:i + batch_size], *args, **kwargs)]


@pytest.mark.parametrize("batch_size", [1, 2, 3, 7])
@pytest.mark.parametrize(("until", "max_gen"), [((), 17), ((" ",), 17), (("e", "th", ""), 20), ((), 0), ((), 1)])
def test_a_greedy_reply_is_the_reply_alone(model64, tok, batch_size, until, max_gen):
    alone = [generate_until(model64, tok, c, until, max_gen) for c in CONTEXTS]
    assert batched(model64, tok, CONTEXTS, batch_size, until, max_gen) == alone
    if max_gen == 17 and not until:
        assert len(set(alone)) > 3 and all(alone)  # the replies are not degenerate


def _stops_at_several_steps(replies: list[str]) -> list[int]:
    """Two ASCII bytes (the byte tokenizer's ids) that, as stop tokens, end these replies at three or more
    different lengths, read off the replies (fixed bytes depended on the trained weights: "l" and "q" ended
    only one reply early on torch 2.11)."""
    chars = sorted({c for r in replies for c in r if c.isascii() and c.isprintable()})
    for pair in itertools.combinations(chars, 2):
        if len({min((r.index(c) for c in pair if c in r), default=len(r)) for r in replies}) > 2:
            return [ord(c) for c in pair]
    raise AssertionError(f"no two bytes end these replies at three lengths: {replies}")


@pytest.mark.parametrize("batch_size", [2, 7])
def test_stop_tokens_and_the_repetition_penalty_act_per_row(model64, tok, batch_size):
    """Rows end at other steps on a stop token (the batch goes on without them); the penalty counts a row's own
    tokens only, not its left padding."""
    free = [generate_until(model64, tok, c, (), 17) for c in CONTEXTS]
    stop = _stops_at_several_steps(free)  # bytes some replies emit early, others late or not at all
    alone = [generate_until(model64, tok, c, (), 17, stop_ids=stop) for c in CONTEXTS]
    assert alone != free and len({len(t) for t in alone}) > 2
    assert batched(model64, tok, CONTEXTS, batch_size, (), 17, stop_ids=stop) == alone
    penalized = Sampling(temperature=0.0, repetition_penalty=1.8)
    alone = [generate_until(model64, tok, c, (".",), 17, sampling=penalized) for c in CONTEXTS]
    assert alone != [generate_until(model64, tok, c, (".",), 17) for c in CONTEXTS]  # the penalty bites
    assert batched(model64, tok, CONTEXTS, batch_size, (".",), 17, sampling=penalized) == alone


@pytest.mark.parametrize("sampling", [Sampling(temperature=1.0), Sampling(temperature=0.9, top_k=5, top_p=0.9),
                                      Sampling(temperature=1.2, repetition_penalty=1.3)])
def test_a_batch_of_one_draws_what_the_plain_twin_draws(model, tok, sampling):
    def replies(fn):
        gen = torch.Generator().manual_seed(3)
        return [fn(c, gen) for c in CONTEXTS]

    alone = replies(lambda c, g: generate_until(model, tok, c, ("e",), 15, sampling=sampling, generator=g))
    assert alone == replies(lambda c, g: generate_until_batch(model, tok, [c], ("e",), 15, sampling=sampling,
                                                              generator=g)[0])
    # a batch draws one token per row per step, in another order than one request after another
    gen = torch.Generator().manual_seed(3)
    together = generate_until_batch(model, tok, CONTEXTS, ("e",), 15, sampling=sampling, generator=gen)
    assert len(together) == len(CONTEXTS) and together != alone


def test_past_the_window_the_requests_run_alone(model, tok):
    """Context + max_gen_toks longer than the window: each reply slides its own window as the plain twin does."""
    alone = [generate_until(model, tok, c, (), L) for c in CONTEXTS[:3]]
    assert max(map(len, alone)) > L // 2  # some reply went past the window
    assert generate_until_batch(model, tok, CONTEXTS[:3], (), L) == alone


def test_nothing_to_do_and_a_bad_length(model, tok):
    assert generate_until_batch(model, tok, [], ("x",), 5) == []
    with pytest.raises(ConfigError, match="max_gen_toks=-1 must be >= 0"):
        generate_until_batch(model, tok, ["a"], (), -1)


def test_the_benchmark_runs_and_its_replies_agree(capsys):
    """benchmarks/generate_until.py as its docstring writes it, shrunk: it prints both timings and every reply
    agreeing (it measures; this only checks that it runs and compares what it says it compares)."""
    script = Path(__file__).resolve().parents[2] / "benchmarks" / "generate_until.py"
    spec = importlib.util.spec_from_file_location("generate_until_benchmark", script)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    module.main(["--d-model", "64", "--layers", "1", "--requests", "5", "--batch-size", "2", "--max-gen", "6",
                 "--reps", "1"])
    out = capsys.readouterr().out
    assert "replies equal: 5/5" in out and "one at a time:" in out and "batched (2):" in out and "speed-up:" in out


@pytest.mark.parametrize("overrides", [dict(placement="post"), dict(placement="resi_dual"),
                                       dict(placement="peri"), dict(placement="mix_ln"),
                                       dict(placement="hybridnorm", moe=dict(num_experts=4, top_k=2))],
                         ids=["post", "resi_dual", "peri", "mix_ln", "hybridnorm-moe"])
def test_every_kind_of_block_gives_the_reply_alone(tok, overrides):
    """Other placements (a second residual stream, norms after the sublayer) and a dropless MoE (the padding
    is routed to experts too, and must change no real token's output), trained briefly, in float64."""
    model = tiny_model(seed=1, train_steps=30, **overrides).double()
    alone = [generate_until(model, tok, c, (".",), 12) for c in CONTEXTS]
    assert len(set(alone)) > 1
    assert batched(model, tok, CONTEXTS, 4, (".",), 12) == alone


@pytest.mark.cuda
@pytest.mark.parametrize("batch_size", [3, 7])
def test_on_a_gpu_a_batch_gives_the_cpu_replies_alone(model64, tok, batch_size):
    """The batch on CUDA (float64, its left-padded attention through CUDA's kernels) == the plain twin on the
    CPU, one request at a time: greedy, with stop strings, and with the repetition penalty."""
    gpu = copy.deepcopy(model64).cuda()
    penalized = Sampling(temperature=0.0, repetition_penalty=1.8)
    for until, sampling in (((), Sampling(temperature=0.0)), ((" ", "th"), Sampling(temperature=0.0)),
                            ((".",), penalized)):
        alone = [generate_until(model64, tok, c, until, 17, sampling=sampling) for c in CONTEXTS]
        assert batched(gpu, tok, CONTEXTS, batch_size, until, 17, sampling=sampling) == alone
