"""Log-likelihood scoring straight on a :class:`~hybridnorm.nn.model.TransformerLM`: the three request kinds
of lm-eval (``loglikelihood``, ``loglikelihood_rolling``, ``generate_until``) without an HF wrapper.

Conventions, chosen to match lm-eval's HF backend (``HFLM``) so that numbers are comparable:

* **A start token.** Every context is prefixed with the tokenizer's ``start_id``: for our tokenizers the
  EOT, since our training data separates documents with it, so the model has learned "after EOT a document
  starts"; for a tokenizer whose post-processor adds a BOS (Llama's, Mistral's), that BOS, which HFLM's
  tokenizer adds too. It gives an empty context something to condition on (HFLM does the same with its
  ``prefix_token_id``, the BOS, else the EOS, for an empty context and for rolling log-likelihoods). A
  context whose text already begins with that token (a chat template's ``{{ bos_token }}``) keeps that one
  and gets no second: HFLM's ``has_bos_prefix`` rule (:func:`~hybridnorm.data.tokenizer.with_start`).
* **Pair encoding** follows ``HFLM._encode_pair``: trailing spaces of the context move to the
  continuation, and the continuation ids are ``encode(context + continuation)[len(encode(context)):]``,
  so a BPE merge across the boundary is scored as the model would have seen the whole text.
* **Windows.** A sequence never exceeds ``config.max_seq_len``: a context is left-truncated so that
  context + continuation fits; a continuation (or document) longer than the window is cut into disjoint
  windows of ``max_seq_len`` predictions, each conditioned on as much preceding text as fits — lm-eval's
  ``get_rolling_token_windows(context_len=1)`` + ``make_disjoint_window``: every token is scored once.
* **Padding rows.** Logits beyond ``config.vocab_size`` (rows added by ``pad_vocab_multiple``) are not
  tokens: they are dropped before the softmax and can never be the greedy choice.

Batches are right-padded: a causal model's logits at a position never depend on later positions, so the
padding needs no attention mask. Windows are sorted longest first (as lm-eval does) to waste little padding,
and windows with the same inputs (one-token answers to one question) share one forward.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch

from hybridnorm.data.tokenizer import Tokenizer, with_start
from hybridnorm.errors import ConfigError
from hybridnorm.nn.attention import KVCache
from hybridnorm.nn.model import TransformerLM
from hybridnorm.nn.sampling import Sampling

RowRule = Callable[[int, int, int], int]  # (a batch's longest row, rows done, rows in all) -> rows of the batch

GREEDY = Sampling(temperature=0.0)

TokenPair = tuple[list[int], list[int]]


@dataclass(frozen=True)
class Window:
    """One forward pass: ``inputs`` (at most ``max_seq_len`` ids) whose last ``len(targets)`` positions
    predict ``targets`` (the tokens that follow each of those positions)."""

    inputs: list[int]
    targets: list[int]


def windows(seq: Sequence[int], start: int, max_len: int) -> list[Window]:
    """Disjoint windows that score ``seq[start:]``, each token once, given as much of ``seq`` before it as
    fits in ``max_len`` positions.

    Targets are taken ``max_len`` at a time from ``start``; the window predicting ``seq[a:b]`` reads
    ``seq[max(0, b-1-max_len) : b-1]``. For ``seq = [start] + doc`` and ``start = 1`` this is exactly lm-eval's
    rolling windows; for a (context, continuation) pair that fits it is ``(ctx + cont)[-(max_len+1):][:-1]``.
    """
    if start < 1:
        raise ValueError(f"start={start}: the first scored token needs at least one token before it")
    if max_len < 1:
        raise ValueError(f"max_len={max_len} must be >= 1")
    out, a, n = [], start, len(seq)
    while a < n:
        b = min(a + max_len, n)
        out.append(Window(list(seq[max(0, b - 1 - max_len):b - 1]), list(seq[a:b])))
        a = b
    return out


def encode_pair(tokenizer: Tokenizer, context: str, continuation: str) -> TokenPair:
    """(context ids with the start-token prefix, continuation ids) by lm-eval's ``HFLM._encode_pair`` rule."""
    n_spaces = len(context) - len(context.rstrip())
    if n_spaces:
        continuation = context[-n_spaces:] + continuation
        context = context[:-n_spaces]
    whole = tokenizer.encode(context + continuation)
    ctx = tokenizer.encode(context)
    return with_start(tokenizer, ctx), whole[len(ctx):]


@torch.inference_mode()
def score_windows(model: TransformerLM, wins: Sequence[Window], batch_size: int | RowRule = 8,
                  ) -> list[tuple[float, bool]]:
    """(sum of log p(target), whether every target is the argmax) for each window, in the given order.
    ``batch_size``: rows per forward, or a rule giving them from (the batch's longest row, rows done, rows in
    all): ``batch_size="auto"`` (:class:`~hybridnorm.eval.auto_batch.AutoBatch`)."""
    if isinstance(batch_size, int) and batch_size < 1:
        raise ConfigError(f"batch_size={batch_size} must be >= 1")
    max_len, vocab = model.config.max_seq_len, model.config.vocab_size
    for w in wins:
        if not 1 <= len(w.targets) <= len(w.inputs) <= max_len:
            raise ValueError(f"bad window: {len(w.inputs)} inputs, {len(w.targets)} targets, "
                             f"max_seq_len={max_len}")
    device = model.embed.weight.device
    # windows with the same inputs share one forward: a question's one-token answers (" A", " B", ...) are
    # scored from the same logits, as lm-eval's HF backend does, instead of one row each
    sharing: dict[tuple[int, ...], list[int]] = {}
    for i, w in enumerate(wins):
        sharing.setdefault(tuple(w.inputs), []).append(i)
    order = sorted(sharing, key=len, reverse=True)  # longest first: little padding
    out: list[tuple[float, bool]] = [(0.0, True)] * len(wins)
    lo = 0
    while lo < len(order):
        rows = batch_size if isinstance(batch_size, int) else batch_size(len(order[lo]), lo, len(order))
        chunk, lo = order[lo:lo + rows], lo + rows
        ids = torch.zeros(len(chunk), len(chunk[0]), dtype=torch.long)  # (B, T), right-padded
        for row, inputs in enumerate(chunk):
            ids[row, :len(inputs)] = torch.tensor(inputs)
        logits = model(ids.to(device))  # (B, T, V_emb)
        for row, inputs in enumerate(chunk):
            for i in sharing[inputs]:
                n_in, n_tgt = len(inputs), len(wins[i].targets)
                logp = logits[row, n_in - n_tgt:n_in, :vocab].float().log_softmax(-1)  # (n_tgt, vocab)
                tgt = torch.tensor(wins[i].targets, device=device)  # (n_tgt,)
                ll = logp.gather(-1, tgt[:, None]).double().sum().item()
                out[i] = (ll, bool((logp.argmax(-1) == tgt).all()))
    return out


def loglikelihood(model: TransformerLM, pairs: Sequence[TokenPair], batch_size: int | RowRule = 8,
                  ) -> list[tuple[float, bool]]:
    """(sum log p(continuation | context), whether the continuation is the greedy argmax) per token pair.

    Contexts are left-truncated so context + continuation fits ``max_seq_len``; a continuation longer than
    that is scored in disjoint windows (see :func:`windows`). An empty continuation scores (0.0, True).
    Each context must hold at least one token: prefix the tokenizer's ``start_id`` (:func:`encode_pair` does).
    """
    max_len = model.config.max_seq_len
    wins, owner = [], []
    for i, (ctx, cont) in enumerate(pairs):
        if not ctx:
            raise ConfigError(f"pair {i}: empty context; prefix the tokenizer's start_id so the first "
                              f"continuation token has something to condition on")
        for w in windows([*ctx, *cont], len(ctx), max_len):
            wins.append(w)
            owner.append(i)
    return _combine(score_windows(model, wins, batch_size), owner, len(pairs))


def loglikelihood_rolling(model: TransformerLM, docs: Sequence[Sequence[int]], prefix_id: int,
                          batch_size: int | RowRule = 8) -> list[float]:
    """Sum log p(doc) per token list, conditioned on ``prefix_id`` (the tokenizer's ``start_id``), every token
    scored once in disjoint windows — lm-eval's ``loglikelihood_rolling``. An empty document scores 0.0."""
    wins, owner = [], []
    for i, doc in enumerate(docs):
        for w in windows([prefix_id, *doc], 1, model.config.max_seq_len):
            wins.append(w)
            owner.append(i)
    return [ll for ll, _ in _combine(score_windows(model, wins, batch_size), owner, len(docs))]


def _combine(scores: list[tuple[float, bool]], owner: list[int], n: int) -> list[tuple[float, bool]]:
    lls, greedy = [0.0] * n, [True] * n
    for (ll, g), i in zip(scores, owner, strict=True):
        lls[i] += ll
        greedy[i] = greedy[i] and g
    return list(zip(lls, greedy, strict=True))


def loglikelihood_text(model: TransformerLM, tokenizer: Tokenizer, pairs: Sequence[tuple[str, str]],
                       batch_size: int | RowRule = 8) -> list[tuple[float, bool]]:
    """:func:`loglikelihood` of (context, continuation) strings encoded with :func:`encode_pair`."""
    return loglikelihood(model, [encode_pair(tokenizer, c, x) for c, x in pairs], batch_size)


def loglikelihood_rolling_text(model: TransformerLM, tokenizer: Tokenizer, texts: Sequence[str],
                               batch_size: int | RowRule = 8) -> list[float]:
    """:func:`loglikelihood_rolling` of whole strings, each conditioned on the start token only."""
    return loglikelihood_rolling(model, tokenizer.encode_batch(list(texts)), tokenizer.start_id, batch_size)


def cut_at_stop(text: str, until: Sequence[str]) -> str:
    """``text`` up to the earliest occurrence of any non-empty stop string (lm-eval's post-processing)."""
    cut = min((i for s in until if s and (i := text.find(s)) >= 0), default=len(text))
    return text[:cut]


def shows_stop(tokenizer: Tokenizer, reply: Sequence[int], until: Sequence[str]) -> bool:
    """Whether the reply's text, special tokens included, holds a non-empty stop string: where a reply ends
    (the text itself is cut by :func:`cut_at_stop`)."""
    strings = [s for s in until if s]
    if not strings:
        return False
    text = tokenizer.decode(list(reply))
    return any(s in text for s in strings)


def greedy_until(model: TransformerLM, tokenizer: Tokenizer, context: str, until: Sequence[str] = (),
                 max_gen_toks: int = 256, stop_ids: Sequence[int] = ()) -> str:
    """:func:`generate_until` decoding greedily."""
    return generate_until(model, tokenizer, context, until, max_gen_toks, stop_ids)


def context_room(max_len: int, max_gen_toks: int) -> int:
    """How many of a context's last tokens a reply of ``max_gen_toks`` tokens keeps in a window of ``max_len``:
    HFLM's ``max_length - max_gen_toks`` (before 2026-12-02 at least half the window, so that a reply of more
    than half the window saw another context than HFLM's); half the window where HFLM refuses to generate."""
    return max_len - max_gen_toks if max_gen_toks < max_len else max(max_len // 2, 1)


@torch.inference_mode()
def generate_until(model: TransformerLM, tokenizer: Tokenizer, context: str, until: Sequence[str] = (),
                   max_gen_toks: int = 256, stop_ids: Sequence[int] = (), sampling: Sampling = GREEDY,
                   generator: torch.Generator | None = None) -> str:
    """The continuation of ``context`` (prefixed with the start token) up to ``max_gen_toks`` tokens, the
    EOT token or one of ``stop_ids`` (a run's other stop tokens: where an HF model's ``generate`` stops for
    lm-eval's HF backend), or the first stop string in ``until`` (which is cut off, as lm-eval does). Each
    token is chosen by ``sampling`` (greedy by default; a repetition penalty counts the context's tokens and
    the reply's, as transformers' does), a draw from ``generator`` (default: torch's global one, which
    lm-eval seeds). The reply is decoded without special tokens, as HFLM decodes it.

    As in HFLM the context is left-truncated to its last ``max_seq_len - max_gen_toks`` tokens, leaving room for
    ``max_gen_toks`` new ones (:func:`context_room`). Where ``max_gen_toks >= max_seq_len`` (HFLM refuses
    that) it keeps the last half of the window, and when the window is full generation slides on from its last
    half.
    """
    if max_gen_toks < 0:
        raise ConfigError(f"max_gen_toks={max_gen_toks} must be >= 0")
    max_len, vocab, stops = model.config.max_seq_len, model.config.vocab_size, {tokenizer.eot_id, *stop_ids}
    device = model.embed.weight.device
    ids = with_start(tokenizer, tokenizer.encode(context))[-context_room(max_len, max_gen_toks):]
    seen = None
    if sampling.repetition_penalty != 1.0:  # (1, V) the tokens the penalty applies to
        seen = torch.zeros(1, vocab, dtype=torch.bool, device=device)
        seen[0, torch.tensor(ids, device=device)] = True

    def prefill(tokens: list[int]) -> tuple[torch.Tensor, KVCache]:
        cache = model.new_cache(1, max_len)
        return model(torch.tensor([tokens], device=device), cache=cache)[0, -1], cache  # (V_emb,)

    logits, cache = prefill(ids)
    out: list[int] = []
    for _ in range(max_gen_toks):
        nxt = int(sampling.next_token(logits[None, :vocab].float(), seen, generator))
        if nxt in stops:
            break
        out.append(nxt)
        if seen is not None:
            seen[0, nxt] = True
        if shows_stop(tokenizer, out, until):
            break
        if cache.pos >= max_len:  # the window is full: continue from its last half
            logits, cache = prefill([*ids, *out][-(max_len // 2):])
        else:
            logits = model(torch.tensor([[nxt]], device=device), cache=cache)[0, -1]
    # the stop strings are looked for in the text with special tokens, the reply is the text without them, as
    # HFLM's stopping criteria and its tok_decode do (a special token mid-reply is not in lm-eval's answer)
    return cut_at_stop(tokenizer.decode(out, skip_special_tokens=True), until)
