"""Log-likelihood scoring on a TransformerLM against naive oracles: every pair, window and greedy flag is
recomputed with one plain forward per continuation (or per token) and a Python-loop log_softmax."""

from __future__ import annotations

import random

import pytest
import torch
from eval_helpers import naive_pair, next_token_logprobs, tiny_model

from hybridnorm.errors import ConfigError
from hybridnorm.eval.scoring import (
    encode_pair,
    generate_until,
    greedy_until,
    loglikelihood,
    loglikelihood_rolling,
    loglikelihood_text,
    windows,
)
from hybridnorm.nn.sampling import Sampling

L = 48  # the tiny model's max_seq_len
EOT = 256


def _rand_ids(rng: random.Random, n: int) -> list[int]:
    return [rng.randrange(256) for _ in range(n)]


@pytest.mark.parametrize("n", [1, 2, 47, 48, 49, 50, 96, 97, 150])
@pytest.mark.parametrize("start", [1, 5, 60])
def test_windows_score_every_token_once_with_the_text_before_it(n, start):
    seq = list(range(1000, 1000 + n + start))
    wins = windows(seq, start, L)
    assert [t for w in wins for t in w.targets] == seq[start:]  # each token once, in order
    for w in wins:
        assert 1 <= len(w.targets) <= len(w.inputs) <= L
        first = seq.index(w.targets[0])
        # the inputs are exactly the tokens before the last target, ending where the targets start
        assert w.inputs == seq[first + len(w.targets) - 1 - len(w.inputs):first + len(w.targets) - 1]
        assert len(w.inputs) == min(L, first + len(w.targets) - 1)  # as much preceding text as fits


@pytest.mark.parametrize("n", [0, 1, 5, 47, 48, 49, 95, 96, 97, 150])
def test_rolling_windows_are_lm_evals(n):
    utils = pytest.importorskip("lm_eval.utils", reason="lm_eval is not installed (pip install 'hybridnorm[eval]')")
    doc = list(range(n))
    ours = windows([EOT, *doc], 1, L)
    theirs = [utils.make_disjoint_window(w) for w in utils.get_rolling_token_windows(doc, EOT, L, 1)]
    # lm-eval feeds (context + continuation)[-(max_length + 1):][:-1] and scores the last len(cont) positions
    assert [(w.inputs, w.targets) for w in ours] == [((c + x)[-(L + 1):][:-1], x) for c, x in theirs]


def test_pairs_equal_the_naive_oracle_and_batching_does_not_matter(model):
    rng = random.Random(1)
    pairs = [([EOT, *_rand_ids(rng, rng.randint(0, 30))], _rand_ids(rng, rng.randint(1, 17))) for _ in range(11)]
    one = loglikelihood(model, pairs, batch_size=1)
    for bs in (3, 64):
        many = loglikelihood(model, pairs, batch_size=bs)
        assert [g for _, g in many] == [g for _, g in one]
        assert [ll for ll, _ in many] == pytest.approx([ll for ll, _ in one], rel=1e-5, abs=1e-5)
    for (ctx, cont), (ll, greedy) in zip(pairs, one, strict=True):
        want_ll, want_greedy = naive_pair(model, ctx, cont)
        assert ll == pytest.approx(want_ll, rel=1e-5, abs=1e-5)
        assert greedy == want_greedy


def test_one_token_answers_to_one_context_share_one_forward(model):
    """A question's one-token answers (MMLU-style " A", " B", " C", " D": the same inputs, other targets) are
    scored from one forward of the context, as lm-eval's HF backend does: as many rows as distinct inputs, and
    every score still the naive oracle's."""
    rng = random.Random(7)
    ctxs = [[EOT, *_rand_ids(rng, rng.randint(1, 20))] for _ in range(5)]
    pairs = [(c, [a]) for c in ctxs for a in b" ABCD"] + [(ctxs[0], list(b" A"))]
    rows: list[int] = []
    handle = model.register_forward_pre_hook(lambda m, args: rows.append(args[0].shape[0]))
    try:
        got = loglikelihood(model, pairs, batch_size=4)
    finally:
        handle.remove()
    assert sum(rows) == 6  # 5 contexts + the two-token answer's own inputs (not 26)
    for (ctx, cont), (ll, greedy) in zip(pairs, got, strict=True):
        want_ll, want_greedy = naive_pair(model, ctx, cont)
        assert ll == pytest.approx(want_ll, rel=1e-5, abs=1e-5)
        assert greedy == want_greedy
    assert len({ll for ll, _ in got[:5]}) == 5  # other targets, other scores


def test_long_context_is_left_truncated_to_fit_the_window(model):
    rng = random.Random(2)
    ctx, cont = [EOT, *_rand_ids(rng, 100)], _rand_ids(rng, 7)
    (ll, greedy), = loglikelihood(model, [(ctx, cont)])
    kept = ctx[-(L + 1 - len(cont)):]  # context + continuation = L + 1 tokens: the last is only a target
    assert (ll, greedy) == pytest.approx(naive_pair(model, kept, cont), rel=1e-5, abs=1e-5)
    assert loglikelihood(model, [(kept, cont)])[0] == pytest.approx((ll, greedy), rel=1e-6, abs=1e-6)


def test_continuation_longer_than_the_window_is_scored_in_disjoint_windows(model):
    rng = random.Random(3)
    ctx, cont = [EOT, *_rand_ids(rng, 20)], _rand_ids(rng, 60)
    seq, s = ctx + cont, len(ctx)
    want = 0.0
    for p in range(s, len(seq)):  # first window: targets seq[s:s+L]; the rest: the last L+1 tokens
        lo = s - 1 if p < s + L else len(seq) - 1 - L
        want += next_token_logprobs(model, seq[lo:p])[seq[p]]
    (ll, _), = loglikelihood(model, [(ctx, cont)])
    assert ll == pytest.approx(want, rel=1e-5, abs=1e-5)


@pytest.mark.parametrize("n", [10, 48, 150])
def test_rolling_equals_a_naive_per_token_computation(model, n):
    """lm-eval's documented windows, written out per token: the first L tokens see [EOT] + everything
    before them; later full windows of L predictions see one token before the window; the last, partial
    window sees the L + 1 tokens before the end of the document."""
    rng = random.Random(n)
    doc = _rand_ids(rng, n)
    want = 0.0
    for j in range(n):
        k = j // L
        if k == 0:
            context = [EOT, *doc[:j]]
        elif (k + 1) * L <= n:
            context = doc[k * L - 1:j]
        else:
            context = doc[n - L - 1:j]
        assert 1 <= len(context) <= L
        want += next_token_logprobs(model, context)[doc[j]]
    got = loglikelihood_rolling(model, [doc, [], doc[:3]], EOT, batch_size=2)
    assert got[0] == pytest.approx(want, rel=1e-5, abs=1e-5)
    assert got[1] == 0.0  # an empty document has nothing to score
    assert got[2] == pytest.approx(naive_pair(model, [EOT], doc[:3])[0], rel=1e-5, abs=1e-5)


def test_greedy_flag(model):
    ctx = [EOT, *b"the lord said"]
    greedy = model.generate(torch.tensor([ctx]), 6, temperature=0)[0, len(ctx):].tolist()
    wrong = [*greedy[:-1], (greedy[-1] + 1) % 256]
    (ll_g, flag_g), (ll_w, flag_w) = loglikelihood(model, [(ctx, greedy), (ctx, wrong)])
    assert flag_g and not flag_w
    assert ll_g > ll_w
    assert loglikelihood(model, [(ctx, [])]) == [(0.0, True)]


def test_padding_rows_are_not_tokens(model, tok):
    """A hook makes the 63 padding rows' logits dominate: scores, greedy flags and generation must not
    change, because those rows are sliced off before the softmax and the argmax."""
    padded = tiny_model()
    padded.load_state_dict(model.state_dict())
    vocab, emb = padded.config.vocab_size, padded.config.embedding_size
    assert emb > vocab
    handle = padded.register_forward_hook(lambda m, i, out: torch.cat([out[..., :vocab], out[..., vocab:] + 50], -1))
    rng = random.Random(4)
    pairs = [([EOT, *_rand_ids(rng, 9)], _rand_ids(rng, 4)) for _ in range(4)]
    ctx = [EOT, *b"the lord said"]
    pairs.append((ctx, model.generate(torch.tensor([ctx]), 5, temperature=0)[0, len(ctx):].tolist()))
    try:
        assert padded(torch.tensor([ctx]))[0, -1].argmax() >= vocab  # the hook bites
        got = loglikelihood(padded, pairs)
        text = greedy_until(padded, tok, "the lord said", (), 12)
    finally:
        handle.remove()
    want = loglikelihood(model, pairs)
    assert [g for _, g in got] == [g for _, g in want] and got[-1][1]
    assert [ll for ll, _ in got] == pytest.approx([ll for ll, _ in want], rel=1e-5, abs=1e-5)
    assert text == greedy_until(model, tok, "the lord said", (), 12)


def test_encode_pair_moves_trailing_spaces_and_prefixes_eot(tok):
    assert encode_pair(tok, "hello  ", "world") == ([EOT, *b"hello"], list(b"  world"))
    assert encode_pair(tok, "", "abc") == ([EOT], list(b"abc"))


def test_encode_pair_with_bpe_takes_the_continuation_from_the_whole_encoding():
    from hybridnorm.data import train_bpe

    bpe = train_bpe(["the lord said unto moses, the lord said unto aaron"] * 20, vocab_size=300)
    ctx, cont = encode_pair(bpe, "the lord sa", "id unto")
    whole, head = bpe.encode("the lord said unto"), bpe.encode("the lord sa")
    assert ctx == [bpe.eot_id, *head] and cont == whole[len(head):]
    assert encode_pair(bpe, "the lord ", "said") == encode_pair(bpe, "the lord", " said")


def test_text_level_scoring_equals_token_level(model, tok):
    pairs = [("the lord", " said"), ("", "and"), ("by day ", "and by night")]
    assert loglikelihood_text(model, tok, pairs) == loglikelihood(model, [encode_pair(tok, *p) for p in pairs])


def test_empty_context_is_refused(model):
    with pytest.raises(ConfigError, match="empty context"):
        loglikelihood(model, [([], [1, 2])])


def test_greedy_until_stops_at_a_stop_string_and_at_max_gen_toks(model, tok):
    full = greedy_until(model, tok, "the lord said", (), 30)
    ids = model.generate(torch.tensor([[EOT, *b"the lord said"]]), 30, temperature=0)[0, 14:].tolist()
    assert full == tok.decode(ids[:ids.index(EOT)] if EOT in ids else ids)
    assert len(full.encode()) <= 30
    stop = full.strip()[2:4]
    assert stop and stop in full
    assert greedy_until(model, tok, "the lord said", [stop], 30) == full[:full.index(stop)]
    assert greedy_until(model, tok, "the lord said", (), 0) == ""
    long = greedy_until(model, tok, "the lord said", (), 3 * L)  # slides past the window: no error
    assert long.startswith(full) and len(long) > len(full)


def test_greedy_until_stops_before_a_stop_id(model, tok):
    """``stop_ids`` (a run's data.stop_tokens) end the text like the end-of-text token: before the first one
    emitted, against the unstopped greedy ids of ``generate``."""
    ids = model.generate(torch.tensor([[EOT, *b"the lord said"]]), 30, temperature=0)[0, 14:].tolist()
    ids = ids[:ids.index(EOT)] if EOT in ids else ids
    firsts = [k for k in range(1, len(ids)) if ids[k] not in ids[:k]]
    assert firsts  # the model emits more than one distinct token
    for k in firsts:
        assert greedy_until(model, tok, "the lord said", (), 30, stop_ids=[ids[k]]) == tok.decode(ids[:k])
        assert greedy_until(model, tok, "the lord said", (), 30, stop_ids=[999, ids[k], ids[0]]) == ""


def test_sampled_generate_until_draws_what_the_models_generate_draws(model, tok):
    """With a sampling setting and a seeded generator, the reply is ``TransformerLM.generate``'s draw (itself
    checked token for token against transformers' ``generate``): the penalty counts the context too. No
    autograd graph is built on the way (inference mode), though the weights require gradients."""
    setting = dict(temperature=0.9, top_k=20, top_p=0.95, repetition_penalty=1.3)
    grads = []
    hook = model.register_forward_hook(lambda m, a, out: grads.append(out.requires_grad))
    try:
        for seed in (0, 1, 2):
            got = generate_until(model, tok, "the lord said", (), 20, sampling=Sampling(**setting),
                                 generator=torch.Generator().manual_seed(seed))
            ids = model.generate(torch.tensor([[EOT, *b"the lord said"]]), 20, generator=torch.Generator().manual_seed(
                seed), **setting)[0, 14:].tolist()
            assert got == tok.decode(ids[:ids.index(EOT)] if EOT in ids else ids)
    finally:
        hook.remove()
    assert grads and not any(grads) and all(p.requires_grad for p in model.parameters())

