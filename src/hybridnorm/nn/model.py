"""The decoder-only LM: embedding → blocks (one spec each, from the placement) → final norm → head.

>>> from hybridnorm import ModelConfig, TransformerLM
>>> model = TransformerLM(ModelConfig.from_preset("tiny", placement="hybridnorm_star"))
>>> logits = model(torch.randint(0, 256, (2, 16)))          # (B, T, V)
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.nn.functional as F
from torch import Tensor, nn
from torch.utils.checkpoint import checkpoint

from hybridnorm.errors import ConfigError
from hybridnorm.nn import kernels
from hybridnorm.nn.attention import KVCache, has_hooks
from hybridnorm.nn.block import Block
from hybridnorm.nn.init import init_weights
from hybridnorm.nn.moe import mean_router_losses, recorded_router_losses
from hybridnorm.nn.norms import build_norm
from hybridnorm.nn.rope import rope_tables
from hybridnorm.nn.sampling import Sampling, check_sampling


class TransformerLM(nn.Module):
    def __init__(self, config, block_class: type[Block] = Block) -> None:
        # config: a hybridnorm.config.ModelConfig (nn does not import config). block_class: Block, or a subclass
        # that adds behaviour around the same computation (the HF classes' transformers checkpointing layer)
        super().__init__()
        config.validate()
        self.config = config
        self.placement = placement = config.resolved_placement()
        V, d = config.embedding_size, config.d_model

        def norm() -> nn.Module:
            return build_norm(config.norm, d, config.norm_eps, fast=config.fast_kernels)

        self.embed = nn.Embedding(V, d)
        self.embed_norm = norm() if placement.embed_norm else None
        self.blocks = nn.ModuleList(
            block_class(config, spec, layer) for layer, spec in enumerate(placement.blocks(config.n_layers)))
        self.dual_norm = norm() if placement.dual_stream else None  # ResiDual: N of the second stream
        self.final_norm = norm() if placement.final_norm else None
        self.lm_head = None if config.tie_embeddings else nn.Linear(d, V, bias=False)
        self.register_buffer("rope_cos", None, persistent=False)  # (max_seq_len, D/2), set by reset_rope
        self.register_buffer("rope_sin", None, persistent=False)
        # True: each block's activations are recomputed in backward instead of kept (set by the trainer's
        # --activation_checkpointing through hybridnorm.nn.regional); a plain attribute, so parameter names
        # and checkpoint files are the same either way
        self.activation_checkpointing = False
        # True: positions past max_seq_len get RoPE rows (rope_rows) instead of a ValueError; the HF classes set it
        self.rope_beyond_max_seq_len = False
        self.reset_rope()
        self.reset_parameters()

    def reset_rope(self, device: torch.device | None = None) -> None:
        """(Re)build the RoPE tables in fp32 on ``device`` (default: the embedding's); they are not saved with
        the weights, so a loader that builds the model on the meta device calls this after loading."""
        c = self.config
        device = self.embed.weight.device if device is None else device
        cos, sin = rope_tables(c.head_dim, c.max_seq_len, c.rope_theta, c.rope_scaling)
        self.rope_cos, self.rope_sin = cos.to(device), sin.to(device)

    def rope_rows(self, length: int, what: str) -> tuple[Tensor, Tensor]:
        """RoPE tables with a row for each position below ``length``. Past ``max_seq_len`` only where
        ``rope_beyond_max_seq_len`` is set (the HF classes: transformers' models take any position), else a
        ValueError naming ``what``: the tables grow (doubling), or for dynamic NTK scaling, whose frequencies
        are stretched for the longest position in this call, are computed for this call alone."""
        c = self.config
        if length <= c.max_seq_len:
            return self.rope_cos, self.rope_sin
        if not self.rope_beyond_max_seq_len:
            raise ValueError(f"{what} exceeds max_seq_len={c.max_seq_len}")
        dynamic = c.rope_scaling is not None and c.rope_scaling.type == "dynamic"
        if not dynamic and length <= self.rope_cos.shape[0]:
            return self.rope_cos, self.rope_sin
        rows = length if dynamic else max(length, 2 * self.rope_cos.shape[0])
        cos, sin = rope_tables(c.head_dim, rows, c.rope_theta, c.rope_scaling, context=c.max_seq_len, seq_len=length)
        cos, sin = cos.to(self.rope_cos.device), sin.to(self.rope_cos.device)
        if not dynamic:
            self.rope_cos, self.rope_sin = cos, sin
        return cos, sin

    def rope_at(self, position_ids: Tensor, check: bool = True) -> tuple[Tensor, Tensor]:
        """The RoPE rows (..., D/2) of ``position_ids``; with ``check`` (a host sync) positions past
        ``max_seq_len`` go through :meth:`rope_rows` first. Without it (a traced graph) the tables are indexed
        as they are."""
        cos, sin = self.rope_cos, self.rope_sin
        if check and position_ids.numel():
            first, last = torch.stack(torch.aminmax(position_ids)).tolist()  # one host sync for both
            if first < 0:  # an index from the end of the tables: another position's rotation, silently
                raise ValueError(f"position_ids must be >= 0, got {first}")
            if last >= self.config.max_seq_len:
                cos, sin = self.rope_rows(last + 1, f"position {last}")
        return cos[position_ids], sin[position_ids]

    def reset_parameters(self) -> None:
        init_weights(self, self.config.resolved_init(), self.config.std)

    @property
    def is_moe(self) -> bool:
        return self.config.moe is not None

    def forward(self, input_ids: Tensor, *, cache: KVCache | None = None, return_aux: bool = False,
                attention_mask: Tensor | None = None,
                position_ids: Tensor | None = None,
                targets: Tensor | None = None) -> Tensor | tuple[Tensor, dict[str, Tensor]]:
        """Logits (B, T, V) for token ids (B, T); with ``return_aux`` also the MoE losses (over the real tokens
        of a padded batch).

        With ``targets`` (B, T) (``-100``: not scored) it returns :func:`lm_loss` of the logits against
        them instead, a 0-d fp32 tensor; the fast kernels compute it without the logits, on every device
        (:func:`hybridnorm.nn.kernels.linear_cross_entropy`; ``fast_kernels=False``: the plain line).

        ``V`` is ``config.embedding_size`` (the vocab padded to ``pad_vocab_multiple``). ``cache`` is a
        :class:`KVCache` or anything with its ``pos``/``update`` (the HF wrapper adapts a transformers
        cache). Padded batches (HF convention): ``attention_mask`` (B, cached + T), 1 = real token, 0 =
        padding that no query may attend to; positions then count real tokens only (left padding shifts
        nothing) unless ``position_ids`` (B, T) gives them. An all-ones mask costs nothing.
        """
        _check_shapes(input_ids, targets, attention_mask, position_ids)
        B, T = input_ids.shape
        start = cache.pos if cache is not None else 0
        mask = None
        if attention_mask is not None and attention_mask.shape != (B, start + T):
            # checked before the all-ones shortcut, which would otherwise accept a mask of any shape
            raise ValueError(f"attention_mask has shape {tuple(attention_mask.shape)}; expected ({B}, {start + T}):"
                             f" batch, cached {start} + new {T} positions")
        if attention_mask is not None and not bool(attention_mask.all()):
            mask = _padding_mask(attention_mask, start, T)  # (B, 1, T, start + T)
            if position_ids is None:
                position_ids = (attention_mask.long().cumsum(-1) - 1).clamp(min=0)[:, start:]  # (B, T)
        if position_ids is None:
            cos, sin = self.rope_rows(start + T, f"sequence of {start + T} tokens")
            cos, sin = cos[start:start + T], sin[start:start + T]  # (T, D/2)
        else:
            cos, sin = self.rope_at(position_ids.expand(B, T))  # (B, T, D/2)
        # padded: the router losses count the real tokens only, from each layer's recorded logits (as the HF class)
        record = [] if return_aux and mask is not None and self.is_moe else None
        for b in self.blocks if record is not None else ():
            b.ffn.record = record
        try:
            x = self.trunk(self.embed(input_ids), cos, sin, cache, mask)  # (B, T, d)
        finally:
            for b in self.blocks if record is not None else ():
                b.ffn.record = None
        if cache is not None:
            cache.pos += T
        out = self.head(x) if targets is None else self._loss(x, targets)  # (B, T, V) logits, or the loss
        if record is not None:  # (B*T,) weights: the mask's columns of the new tokens
            return out, recorded_router_losses(record, self.config.moe, attention_mask[:, start:].reshape(-1))
        return (out, self.aux_losses()) if return_aux else out

    def trunk(self, x: Tensor, cos: Tensor, sin: Tensor, cache: KVCache | None = None, mask: Tensor | None = None,
              block_inputs: list[Tensor] | None = None) -> Tensor:
        """Token embeddings x (B, T, d) -> the final-normed hidden states (B, T, d) that the head reads:
        embedding norm, every block (ResiDual: with its second stream, added normed after the last block),
        final norm. ``cos``/``sin`` are the RoPE tables at the tokens' positions ((T, D/2) or (B, T, D/2));
        ``mask`` is passed to every attention unchanged. ``block_inputs``, a list,
        receives each block's input (the HF wrapper's ``output_hidden_states``). Does not advance ``cache.pos``:
        the caller does (a transformers cache counts its own tokens)."""
        if self.embed_norm is not None:
            x = self.embed_norm(x)
        # ResiDual's second stream starts at block 1's input; a copy, not the same tensor: a compiled block
        # given one tensor as both x and dual would be specialised to that aliasing and recompiled for block 2
        dual = x.clone() if self.dual_norm is not None else None
        for block in self.blocks:
            if block_inputs is not None:
                block_inputs.append(x)
            args = (x, cos, sin, cache, mask) if dual is None else (x, cos, sin, cache, mask, dual)
            if self.activation_checkpointing and torch.is_grad_enabled():
                # non-reentrant: gradients also reach what escapes the block besides x (MoE aux losses)
                out = checkpoint(block, *args, use_reentrant=False)
            else:
                out = block(*args)
            x, dual = out if dual is not None else (out, None)
        if dual is not None:
            x = x + self.dual_norm(dual)  # (B, T, d)
        return self.final_norm(x) if self.final_norm is not None else x

    def _head_weight(self, x: Tensor) -> Tensor:
        """The LM head's (V, d) weight, read outside any module's forward: the untied head's, or the
        embedding's when tied. Refused when it is on the meta device and ``x`` is not: offloaded by accelerate
        (a ``device_map`` with "cpu" or "disk", ``cpu_offload``), whose hooks load a weight only inside its own
        module's forward, so reading it here would compute with garbage (torch returns one for a meta weight)."""
        w = self.lm_head.weight if self.lm_head is not None else self.embed.weight
        if w.is_meta and not x.is_meta:
            name = "lm_head" if self.lm_head is not None else "embed"
            where = name if name == "lm_head" else f"{name} (the tied head reads its weight)"
            raise RuntimeError(f"the LM head's weight, {where}, is on the meta device: offloaded (an accelerate "
                               "device_map with 'cpu' or 'disk', or cpu_offload), it is loaded only inside its "
                               f"module's own forward; keep {name} on an execution device, e.g. "
                               f"device_map={{'model.{name}': 0, ...}} or max_memory that holds it")
        return w

    def head(self, x: Tensor) -> Tensor:
        """Logits (B, T, V) of final-normed hidden states x (B, T, d) (see :meth:`trunk`)."""
        # an untied head is called as a module, so that its hooks fire
        return self.lm_head(x) if self.lm_head is not None else F.linear(x, self._head_weight(x))  # (B, T, V)

    def _loss(self, x: Tensor, targets: Tensor) -> Tensor:
        """lm_loss(head(x), targets); x (B, T, d) after the final norm. The fused kernel reads the head's
        weight directly, so an untied head that is not a plain ``nn.Linear`` without hooks (a hook, PEFT's
        LoRA wrapper, a parametrized or quantized layer) goes through the module."""
        fast = self.config.fast_kernels
        if kernels.active(fast) and (self.lm_head is None
                                     or (type(self.lm_head) is nn.Linear and not has_hooks(self.lm_head))):
            return kernels.linear_cross_entropy(x.flatten(0, 1), self._head_weight(x), targets.flatten())
        return lm_loss(self.head(x), targets, fast=fast)

    def aux_losses(self) -> dict[str, Tensor]:
        """The MoE losses of the last forward, averaged over layers, and their weighted sum
        ``aux_loss`` (weights ``moe.lb_loss_weight``, ``moe.z_loss_weight``) to add to the LM loss."""
        if not self.is_moe:
            return {}
        return mean_router_losses([b.ffn.aux_losses for b in self.blocks], self.config.moe)

    def num_params(self, *, active: bool = False, exclude_embeddings: bool = False) -> int:
        """Parameter count; ``active`` counts only top_k/num_experts of the expert weights (MoE)."""
        total = 0
        for name, p in self.named_parameters():
            if exclude_embeddings and name.split(".")[0] in ("embed", "lm_head"):
                continue
            n = p.numel()
            if active and self.is_moe and name.endswith(("ffn.w_in", "ffn.w_out")):
                n = n * self.config.moe.top_k // self.config.moe.num_experts
            total += n
        return total

    def new_cache(self, batch: int, max_len: int | None = None) -> KVCache:
        c = self.config
        dtype = self.embed.weight.dtype
        return KVCache(c.n_layers, batch, c.kv_heads, max_len or c.max_seq_len, c.head_dim, dtype,
                       self.embed.weight.device)

    @torch.no_grad()
    def generate(self, input_ids: Tensor, max_new_tokens: int, *, temperature: float = 1.0,
                 top_k: int | None = None, top_p: float = 1.0, min_p: float = 0.0,
                 repetition_penalty: float = 1.0, generator: torch.Generator | None = None,
                 stop_ids: int | Sequence[int] | None = None, attention_mask: Tensor | None = None) -> Tensor:
        """Sample continuations with a KV cache; ``temperature=0`` is greedy, ``top_k`` None or 0 samples from
        the whole vocabulary; ``top_p``, ``min_p`` and ``repetition_penalty`` as transformers' ``generate``
        (:mod:`hybridnorm.nn.sampling`: the same order and rules, so the same seed draws the same tokens).
        Returns (B, T + new). ``stop_ids`` (end-of-text tokens, one or several): a row
        that emits one emits only the first of them from then on, and generation ends once every row has, so
        new may be < max_new_tokens (transformers' ``generate`` with those eos ids, whose finished rows get
        the pad token: our exported tokenizers' pad is their end-of-text token). Arguments out of range raise
        ConfigError up front (:func:`check_generate_args`), as does a prompt + continuation longer than
        ``max_seq_len``. Prompts of several lengths: left-padded, with ``attention_mask`` (B, T) 0 over the
        padding, 1 over the prompt, as transformers' ``generate`` takes them (the padding attended by nothing,
        positions counting a row's real tokens); the repetition penalty counts a row's real tokens only."""
        sampling = check_generate_args(max_new_tokens, temperature, top_k, top_p=top_p, min_p=min_p,
                                       repetition_penalty=repetition_penalty)
        stops = _stop_tensor(stop_ids, self.config.vocab_size, input_ids.device)
        B, T = input_ids.shape
        if T < 1 or T + max_new_tokens > self.config.max_seq_len:
            raise ConfigError(f"a prompt of {T} tokens + max_new_tokens={max_new_tokens} must be 1 to "
                              f"max_seq_len={self.config.max_seq_len} tokens")
        mask = _left_padding(attention_mask, input_ids, max_new_tokens)  # (B, T + new) or None: no padding
        cache = self.new_cache(B, min(self.config.max_seq_len, T + max_new_tokens))
        logits = self(input_ids, cache=cache, attention_mask=None if mask is None else mask[:, :T])[:, -1]
        out = [input_ids]
        V = self.config.vocab_size
        seen = None  # (B, embedding rows) bool: the tokens so far, prompt included, for the repetition penalty
        if repetition_penalty != 1.0:
            seen = torch.zeros(B, logits.shape[-1], dtype=torch.bool, device=input_ids.device)
            # a padding position marks its row's last token instead (real under left padding): scatter_ has
            # no defined order when two positions of a row write one token, so padding never writes False
            real_ids = input_ids if mask is None else torch.where(mask[:, :T].bool(), input_ids, input_ids[:, -1:])
            seen.scatter_(1, real_ids, True)
        done = torch.zeros(B, 1, dtype=torch.bool, device=input_ids.device)  # rows that emitted a stop id
        for i in range(max_new_tokens):
            logits = logits[:, :V].float()  # never sample padding rows
            nxt = sampling.next_token(logits, None if seen is None else seen[:, :V], generator)  # (B, 1)
            if stops is not None:
                nxt = nxt.masked_fill(done, stops[0])
                done = done | torch.isin(nxt, stops)
            if seen is not None:
                seen.scatter_(1, nxt, True)
            out.append(nxt)
            if i + 1 == max_new_tokens or (stops is not None and bool(done.all())):  # a host sync a token
                break
            logits = self(nxt, cache=cache, attention_mask=None if mask is None else mask[:, :T + i + 1])[:, -1]
        return torch.cat(out, dim=1)


def left_padded(rows: Sequence[Sequence[int]], pad_id: int, device: torch.device | str | None = None,
                ) -> tuple[Tensor, Tensor]:
    """Token rows of several lengths as :meth:`TransformerLM.generate` takes them: the (B, P) ids, each row
    left-padded with ``pad_id`` to the longest, and their (B, P) ``attention_mask``, 0 over the padding."""
    width = max(map(len, rows))
    ids = torch.tensor([[pad_id] * (width - len(r)) + list(r) for r in rows], device=device)
    mask = torch.tensor([[0] * (width - len(r)) + [1] * len(r) for r in rows], device=device)
    return ids, mask


def _left_padding(attention_mask: Tensor | None, input_ids: Tensor, max_new_tokens: int) -> Tensor | None:
    """:meth:`TransformerLM.generate`'s ``attention_mask`` checked as left padding and extended by the new
    tokens' ones: (B, T + max_new_tokens); None when there is none or it pads nothing."""
    if attention_mask is None:
        return None
    if attention_mask.shape != input_ids.shape:
        raise ConfigError(f"attention_mask has shape {tuple(attention_mask.shape)}; input_ids "
                          f"{tuple(input_ids.shape)}")
    m = attention_mask.long()
    if not bool(((m == 0) | (m == 1)).all()) or bool((m[:, 1:] < m[:, :-1]).any()) or not bool(m[:, -1].all()):
        raise ConfigError("attention_mask must be left padding: per row 0s (padding) then 1s (the prompt, at "
                          "least one token)")
    if bool(m.all()):
        return None
    return torch.cat([m, m.new_ones(m.shape[0], max_new_tokens)], dim=1)


def _stop_tensor(stop_ids: int | Sequence[int] | None, vocab_size: int, device: torch.device) -> Tensor | None:
    """``stop_ids`` as a 1-d tensor on ``device`` (None: none); ConfigError for an id outside the vocabulary."""
    if stop_ids is None:
        return None
    ids = [stop_ids] if isinstance(stop_ids, int) and not isinstance(stop_ids, bool) else stop_ids
    if isinstance(ids, (str, bytes)) or not isinstance(ids, Sequence) or not ids or not all(
            isinstance(i, int) and not isinstance(i, bool) and 0 <= i < vocab_size for i in ids):
        raise ConfigError(f"stop_ids={stop_ids!r} must be token ids from 0 to {vocab_size - 1} (one, or a "
                          "non-empty list)")
    return torch.tensor(list(ids), device=device)


def check_generate_args(max_new_tokens: int, temperature: float, top_k: int | None = None,
                        seed: int | None = None, *, top_p: float = 1.0, min_p: float = 0.0,
                        repetition_penalty: float = 1.0, as_options: bool = False) -> Sampling:
    """ConfigError naming the first argument of :meth:`TransformerLM.generate` (and the seed of its
    generator) that is out of range; NaN and infinities are out of every range. ``as_options``: name them
    as the command line spells them (``--max-new-tokens``). Returns the checked sampling settings."""
    def integer(x: object) -> bool:
        return isinstance(x, int) and not isinstance(x, bool)

    if not integer(max_new_tokens) or max_new_tokens < 0:
        name = "--max-new-tokens" if as_options else "max_new_tokens"
        raise ConfigError(f"{name}={max_new_tokens!r} must be an integer >= 0")
    sampling = Sampling(temperature, 0 if top_k is None else top_k, top_p, min_p, repetition_penalty)
    check_sampling(sampling, as_options=as_options)
    if seed is not None and (not integer(seed) or not 0 <= seed < 2**64):
        raise ConfigError(f"{'--seed' if as_options else 'seed'}={seed!r} must be an integer from 0 to 2**64 - 1")
    return sampling


def _check_shapes(input_ids: Tensor, targets: Tensor | None, attention_mask: Tensor | None,
                  position_ids: Tensor | None) -> None:
    """ValueError for inputs :meth:`TransformerLM.forward` would otherwise misread without a word: targets
    of another shape (the fused loss flattens both, so (T, B) targets paired the wrong tokens) or of a float
    dtype, ids that are not (B, T) integers, position ids that do not broadcast to (B, T). Shapes only: no sync."""
    if input_ids.dim() != 2 or input_ids.is_floating_point() or input_ids.is_complex():
        raise ValueError(f"input_ids must be (batch, seq) integer token ids, got shape {tuple(input_ids.shape)} "
                         f"{input_ids.dtype}")
    if targets is not None and (targets.shape != input_ids.shape or targets.is_floating_point()):
        raise ValueError(f"targets must be integer ids of the input_ids' shape {tuple(input_ids.shape)}, got "
                         f"{tuple(targets.shape)} {targets.dtype}")
    B, T = input_ids.shape
    if position_ids is not None and position_ids.shape not in ((T,), (1, T), (B, T)):
        raise ValueError(f"position_ids of shape {tuple(position_ids.shape)} do not fit input_ids "
                         f"{tuple(input_ids.shape)}: expected (batch or 1, seq) or (seq,)")


def _padding_mask(attention_mask: Tensor, start: int, T: int) -> Tensor:
    """(B, start + T) 0/1 padding mask -> (B, 1, T, start + T) bool: causal AND key is not padding. A
    padding query still sees itself, so no softmax row is empty (NaN); its output is never used."""
    S = attention_mask.shape[1]
    if S != start + T:
        raise ValueError(f"attention_mask covers {S} positions; expected cached {start} + new {T}")
    keys = torch.arange(S, device=attention_mask.device)
    queries = keys[start:, None]  # (T, 1) absolute index of each query
    allowed = (keys <= queries) & attention_mask.bool()[:, None, :]  # (B, T, S)
    return (allowed | (keys == queries))[:, None]


def lm_loss(logits: Tensor, targets: Tensor, ignore_index: int = -100, fast: bool = True) -> Tensor:
    """Mean next-token cross-entropy in fp32 (fp64 for fp64 logits); logits (B, T, V) aligned with targets (B, T).

    ``fast`` on CPU: ``kernels.cross_entropy`` (no full fp32 log-softmax; the same value). The plain
    line below is its definition and what the tests compare it with. On CUDA this function runs the plain line;
    a model computing its own loss (``targets=``) fuses the head with it instead (``TransformerLM._loss``)."""
    if targets.shape != logits.shape[:-1]:  # both are flattened below: (T, B) targets would pair other tokens
        raise ValueError(f"targets of shape {tuple(targets.shape)} do not fit logits {tuple(logits.shape)}: "
                         f"expected {tuple(logits.shape[:-1])}")
    if kernels.active(fast) and logits.device.type == "cpu":
        return kernels.cross_entropy(logits.flatten(0, 1), targets.flatten(), ignore_index)
    wide = logits.flatten(0, 1).to(torch.promote_types(logits.dtype, torch.float32))
    return F.cross_entropy(wide, targets.flatten(), ignore_index=ignore_index)
