"""lm-eval ``generate_until`` requests decoded together as one left-padded batch, as lm-eval's HF backend
(``HFLM``) decodes a batch through transformers' ``generate``. The speed trick for
:func:`~hybridnorm.eval.scoring.generate_until`, its plain twin: every reply is the reply that request gets
alone (tested equal, greedy and sampled at a batch of one).

What a batch shares, as in transformers' ``generate`` under ``HFLM``:

* **One forward per token for every row.** Contexts are left-padded (the padding masked, positions counting
  real tokens), and a row that has emitted an end-of-text token is fed that token from then on.
* **One draw per token for every row** (``torch.multinomial`` over the (B, V) probabilities), until the batch
  ends where ``HFLM``'s batch ends: every row has emitted an end-of-text token, or every row has shown the
  *same* stop string in its last ``len(encode(stop)) + 2`` tokens (lm-eval's ``MultiTokenEOSCriteria``), or
  ``max_gen_toks`` is reached. So a sampled batch consumes torch's generator as ``HFLM``'s batch of the same
  requests does, and draws the same tokens. A greedy batch lets each row go once its reply is complete (what
  comes after a reply's end changes nothing), so it ends with its last reply.

Each reply ends at its first end-of-text token or stop string, exactly as in the plain twin. Not shared with
``HFLM``: its repetition penalty also counts the left-padding tokens of a row as seen; here only real tokens
are (so a penalized reply does not depend on its batch).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from hybridnorm.data.tokenizer import Tokenizer, with_start
from hybridnorm.errors import ConfigError
from hybridnorm.eval.scoring import GREEDY, context_room, cut_at_stop, generate_until, shows_stop
from hybridnorm.nn.model import TransformerLM, left_padded
from hybridnorm.nn.sampling import Sampling


@torch.inference_mode()
def generate_until_batch(model: TransformerLM, tokenizer: Tokenizer, contexts: Sequence[str],
                         until: Sequence[str] = (), max_gen_toks: int = 256, stop_ids: Sequence[int] = (),
                         sampling: Sampling = GREEDY, generator: torch.Generator | None = None) -> list[str]:
    """:func:`~hybridnorm.eval.scoring.generate_until` of each of ``contexts`` (same arguments), computed as
    one batch. Where ``max_gen_toks`` fills the model's window (the plain twin then slides the window per reply;
    ``HFLM`` refuses), the requests run one at a time."""
    if max_gen_toks < 0:
        raise ConfigError(f"max_gen_toks={max_gen_toks} must be >= 0")
    if not contexts:
        return []
    max_len, vocab, eot = model.config.max_seq_len, model.config.vocab_size, tokenizer.eot_id
    room = context_room(max_len, max_gen_toks)  # the plain twin's left truncation, HFLM's
    rows = [with_start(tokenizer, tokenizer.encode(c))[-room:] for c in contexts]
    B, P = len(rows), max(map(len, rows))
    if P + max_gen_toks > max_len:
        return [generate_until(model, tokenizer, c, until, max_gen_toks, stop_ids, sampling, generator)
                for c in contexts]
    device = model.embed.weight.device
    ids, real = left_padded(rows, eot, device)  # (B, P) each: left-padded, 1 over a row's own tokens
    mask = None if bool(real.all()) else torch.cat([real, real.new_ones(B, max_gen_toks)], 1)
    seen = None  # (B, V_emb) the real tokens so far, for the repetition penalty
    cache = model.new_cache(B, P + max_gen_toks)
    logits = model(ids, cache=cache, attention_mask=None if mask is None else mask[:, :P])[:, -1]  # (B, V_emb)
    if sampling.repetition_penalty != 1.0:
        seen = torch.zeros(B, logits.shape[-1], dtype=torch.bool, device=device)
        # a padding position marks the row's last token (real under left padding), never False: scatter_ has
        # no defined order where a row's padding and one of its tokens write one entry (the pad is end-of-text)
        seen.scatter_(1, torch.where(real.bool(), ids, ids[:, -1:]), True)
    stops = torch.tensor(sorted({eot, *stop_ids}), device=device)
    strings = [s for s in until if s]
    tracked = {s: len(tokenizer.encode(s)) + 2 for s in strings} if not sampling.greedy else {}
    shown = {s: [False] * B for s in tracked}  # HFLM's per-stop-string trackers (a sampled batch's end)
    emitted: list[list[int]] = [[] for _ in rows]  # every token a row was fed after its context
    replies: list[list[int] | None] = [None] * B  # a row's reply once complete
    active = list(range(B))  # the rows still in the batch (a greedy batch lets complete rows go)
    ended = torch.zeros(B, dtype=torch.bool, device=device)  # rows that emitted an end-of-text token
    for step in range(max_gen_toks):
        nxt = sampling.next_token(logits[:, :vocab].float(), None if seen is None else seen[:, :vocab],
                                  generator)[:, 0]  # (A,) one draw for every row in the batch
        nxt = torch.where(ended, eot, nxt)  # an ended row is fed end-of-text (transformers: its pad token)
        newly = torch.isin(nxt, stops) & ~ended
        ended |= newly
        if seen is not None:
            seen[torch.arange(len(active), device=device), nxt] = True
        for b, tok, stop in zip(active, nxt.tolist(), newly.tolist(), strict=True):  # a host sync a token
            emitted[b].append(tok)
            if replies[b] is None and (stop or shows_stop(tokenizer, emitted[b], strings)):
                replies[b] = emitted[b][:-1] if stop else list(emitted[b])
            for s, look in tracked.items():
                shown[s][b] = shown[s][b] or s in tokenizer.decode(emitted[b][-look:])
        if step + 1 == max_gen_toks or _batch_ends(replies, ended, shown, sampling.greedy):
            break
        if sampling.greedy and any(replies[b] is not None for b in active):  # complete replies leave the batch
            stay = torch.tensor([i for i, b in enumerate(active) if replies[b] is None], device=device)
            active = [active[i] for i in stay.tolist()]
            cache.keep_rows(stay)
            nxt, ended = nxt[stay], ended[stay]
            seen = None if seen is None else seen[stay]
            mask = None if mask is None else mask[stay]
        logits = model(nxt[:, None], cache=cache,
                       attention_mask=None if mask is None else mask[:, :P + step + 1])[:, -1]
    return [cut_at_stop(tokenizer.decode(emitted[b] if r is None else r, skip_special_tokens=True), until)
            for b, r in enumerate(replies)]


def _batch_ends(replies: list[list[int] | None], ended: torch.Tensor, shown: dict[str, list[bool]],
                greedy: bool) -> bool:
    """Greedy: every reply is complete. Sampled: where transformers' ``generate`` ends ``HFLM``'s batch, so
    that the batch draws from the generator as often as ``HFLM``'s does (this implies every reply complete)."""
    if greedy:
        return all(r is not None for r in replies)
    return bool(ended.all()) or any(all(flags) for flags in shown.values())
