"""A model folder's own decoding defaults (``generation_config.json``'s sampling fields), resolved with the
options of ``hybridnorm generate`` as transformers' ``generate()`` resolves them with its arguments.

transformers takes each setting from an argument given to ``generate()``, else from the folder's
``generation_config.json``, else from its global defaults (greedy; temperature 1, top-k 50, top-p 1, no
min-p, no penalty). ``hybridnorm generate`` samples by default (temperature 0.8, top-k 50), so:

- the file says ``do_sample: true``: each setting it leaves out takes transformers' default, so the command
  draws what ``AutoModelForCausalLM.from_pretrained(DIR).generate(ids)`` draws after the same seed;
- ``do_sample: false``: greedy, with the file's repetition penalty (transformers applies it to greedy too);
- no ``do_sample`` (a run; hybridnorm's exports write none): the command's own defaults, with the file's
  sampling fields where it sets them (transformers would decode such a folder greedily and ignore them).

An option given on the command line overrides the file field by field: ``--temperature 0`` is greedy, and a
temperature above 0 samples even where the file says ``do_sample: false``. Fields that change what is drawn
but that the command does not apply (``typical_p``, beams, ...) are named in :attr:`GenerationDefaults.note`.

:meth:`GenerationDefaults.for_transformers` is transformers' own resolution, unchanged: what lm-eval's HF
backend decodes a ``generate_until`` request with (``hybridnorm.eval.lm_eval_adapter``). ``import`` keeps the
fields in the run (:data:`FILE`) and ``export`` writes them back, so they survive fine-tuning.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field, replace
from typing import Any

from hybridnorm.errors import ConfigError
from hybridnorm.nn.sampling import Sampling, check_sampling

FIELDS = ("temperature", "top_k", "top_p", "min_p", "repetition_penalty")
FILTERS = ("top_k", "top_p", "min_p")  # what greedy decoding ignores
COMMAND_DEFAULTS: dict[str, Any] = dict(temperature=0.8, top_k=50, top_p=1.0, min_p=0.0, repetition_penalty=1.0)
# GenerationConfig._get_default_generation_params (transformers 5): what generate() uses for a field left unset
TRANSFORMERS_DEFAULTS: dict[str, Any] = dict(temperature=1.0, top_k=50, top_p=1.0, min_p=0.0, repetition_penalty=1.0)
# fields of a generation_config.json that change which tokens transformers' generate() picks, with the value
# that leaves them off; the command applies none of them (it says so when a file turns one on)
NOT_APPLIED: dict[str, Any] = dict(typical_p=1.0, epsilon_cutoff=0.0, eta_cutoff=0.0, top_h=None, num_beams=1,
                                   num_beam_groups=1, diversity_penalty=0.0, penalty_alpha=None, dola_layers=None,
                                   no_repeat_ngram_size=0, bad_words_ids=None, sequence_bias=None,
                                   suppress_tokens=None, begin_suppress_tokens=None, min_length=0,
                                   min_new_tokens=None, forced_bos_token_id=None, forced_eos_token_id=None,
                                   exponential_decay_length_penalty=None, guidance_scale=None,
                                   watermarking_config=None)


# a run's copy of the fields (an imported folder's), carried from checkpoint to checkpoint and written back into
# generation_config.json by export: so an instruct model imported, fine-tuned and exported keeps its defaults
FILE = "generation_defaults.json"


@dataclass(frozen=True)
class GenerationDefaults:
    """The decoding defaults a model carries: a folder's ``generation_config.json`` fields that choose tokens
    (a run: those of the folder it was imported from, :data:`FILE`; else none)."""

    source: str = ""  # the file they were read from ("" : none)
    kept: dict[str, Any] = field(default_factory=dict)  # do_sample, FIELDS and NOT_APPLIED as the file sets them

    @classmethod
    def from_generation_config(cls, raw: object, source: str) -> GenerationDefaults:
        """From the parsed ``generation_config.json`` (or a run's :data:`FILE`) at ``source``: not an object, or
        a ``do_sample`` that is not a boolean, is a ConfigError naming the file (the sampling fields are checked
        when used: an option may override one). Fields set to null or to the value that turns them off are
        not kept."""
        if not isinstance(raw, dict):
            raise ConfigError(f"{source}: expected a JSON object of generation settings, got {type(raw).__name__}")
        do_sample = raw.get("do_sample")
        if do_sample is not None and not isinstance(do_sample, bool):
            raise ConfigError(f"{source}: do_sample={do_sample!r} must be true or false")
        off = {k: raw[k] for k, default in NOT_APPLIED.items() if k in raw and raw[k] not in (default, None)}
        return cls(source, {**({"do_sample": do_sample} if do_sample is not None else {}),
                            **{k: raw[k] for k in FIELDS if raw.get(k) is not None}, **off})

    @property
    def do_sample(self) -> bool | None:  # None: the file does not say
        return self.kept.get("do_sample")

    @property
    def fields(self) -> dict[str, Any]:  # the FIELDS the file sets
        return {k: v for k, v in self.kept.items() if k in FIELDS}

    @property
    def not_applied(self) -> tuple[str, ...]:  # "typical_p=0.95", ...: set in the file, not applied by the command
        return tuple(f"{k}={v!r}"[:80] for k, v in self.kept.items() if k in NOT_APPLIED)

    def resolve(self, given: dict[str, Any]) -> Sampling:
        """The settings ``hybridnorm generate`` uses: ``given`` (options the user wrote, by field name) over
        the file's over the defaults (module docstring). A file value that is used and out of range is a
        ConfigError naming the file and the option that overrides it."""
        base = COMMAND_DEFAULTS if self.do_sample is None else TRANSFORMERS_DEFAULTS
        from_file = {**self.fields, **({"temperature": 0.0} if self.do_sample is False else {})}
        return _sampling({**base, **self._checked(from_file, given, lambda k: "--" + k.replace("_", "-")), **given})

    def for_transformers(self, kwargs: dict[str, Any]) -> Sampling:
        """The settings transformers' ``generate(**kwargs)`` decodes with on the folder: each of ``do_sample``
        and the FIELDS from ``kwargs`` where not None, else the file's, else transformers' default (greedy).
        What lm-eval's HF backend gets for a request (its ``generation_kwargs``, ``do_sample`` always set)."""
        given = {k: kwargs[k] for k in FIELDS if kwargs.get(k) is not None}
        values = {**TRANSFORMERS_DEFAULTS, **self._checked(self.fields, given, lambda k: f"a {k} argument"), **given}
        do_sample = kwargs.get("do_sample")
        if not (self.do_sample if do_sample is None else do_sample):
            values["temperature"] = 0.0  # greedy
        return _sampling(values)

    def _checked(self, from_file: dict[str, Any], given: dict[str, Any],
                 overrides: Callable[[str], str]) -> dict[str, Any]:
        """``from_file``, each value not overridden by ``given`` checked: a ConfigError names the file and what
        ``overrides`` says overrides the field."""
        for name, value in from_file.items():
            if name not in given:
                try:
                    check_sampling(replace(Sampling(), **{name: value}))
                except ConfigError as e:
                    raise ConfigError(f"{self.source}: {e}; {overrides(name)} overrides it") from None
        return from_file

    def note(self, given: dict[str, Any]) -> str:
        """One line for stderr on what the file decided (``""`` when it decided nothing)."""
        used = {k: v for k, v in self.fields.items() if k not in given}
        if self.do_sample is None and not used and not self.not_applied:
            return ""
        said = ([f"do_sample={str(self.do_sample).lower()}"] if self.do_sample is not None else []) + [
            f"{k}={v!r}" for k, v in used.items()]
        line = f"decoding defaults from {self.source}: {', '.join(said) or 'none used'} (options override them)"
        if self.do_sample is False and "temperature" not in given and (moot := [k for k in given if k in FILTERS]):
            line += f"; greedy, so {', '.join('--' + k.replace('_', '-') for k in moot)} has no effect without " \
                    "--temperature T > 0"
        if self.not_applied:
            line += f"; not applied by this command: {', '.join(self.not_applied)}"
        return line


def _sampling(values: dict[str, Any]) -> Sampling:
    return Sampling(values["temperature"], values["top_k"], values["top_p"], values["min_p"],
                    values["repetition_penalty"])
