"""``hybridnorm generate``'s arguments are range-checked: any bad number is one ``error:`` line naming the
argument and exit 2, never a traceback; and any in-range setting samples (a subnormal temperature included,
which used to turn every logit into ±inf and the softmax into NaN; a top-p or min-p that leaves one token;
any positive repetition penalty)."""

from __future__ import annotations

import math
from pathlib import Path

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from hybridnorm.cli import main
from hybridnorm.config import ModelConfig
from hybridnorm.errors import ConfigError
from hybridnorm.nn.model import TransformerLM, check_generate_args

IN_PROCESS = settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])

bad_temperature = st.one_of(st.sampled_from([math.nan, math.inf, -math.inf, -0.5]),
                            st.floats(max_value=0, exclude_max=True))  # negatives, subnormal ones included
bad_int = st.integers(max_value=-1)
bad_seed = st.one_of(bad_int, st.integers(min_value=2**64, max_value=2**200))
non_finite = st.sampled_from([math.nan, math.inf, -math.inf])
bad_top_p = st.one_of(non_finite, st.floats(max_value=0), st.floats(min_value=1, exclude_min=True))
bad_min_p = st.one_of(non_finite, st.floats(max_value=0, exclude_max=True), st.floats(min_value=1, exclude_min=True))
bad_penalty = st.one_of(non_finite, st.floats(max_value=0))


def _refused(argv: list[str], capsys, needle: str) -> None:
    capsys.readouterr()
    assert main(argv) == 2
    err = capsys.readouterr().err
    lines = err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error:") and "Traceback" not in err, err
    assert needle in lines[0], lines[0]


@IN_PROCESS
@given(value=bad_temperature)
def test_bad_temperatures_are_one_error_line(tiny_run: Path, capsys, value: float) -> None:
    _refused(["generate", str(tiny_run), f"--temperature={value!r}"], capsys, "--temperature=")


@IN_PROCESS
@given(name=st.sampled_from(["--top-k", "--max-new-tokens"]), value=bad_int)
def test_negative_counts_are_one_error_line(tiny_run: Path, capsys, name: str, value: int) -> None:
    _refused(["generate", str(tiny_run), f"{name}={value}"], capsys, f"{name}={value}")


@IN_PROCESS
@given(case=st.one_of(st.tuples(st.just("--top-p"), bad_top_p), st.tuples(st.just("--min-p"), bad_min_p),
                      st.tuples(st.just("--repetition-penalty"), bad_penalty)))
def test_bad_filters_and_penalties_are_one_error_line(tiny_run: Path, capsys, case: tuple[str, float]) -> None:
    name, value = case
    _refused(["generate", str(tiny_run), f"{name}={value!r}"], capsys, f"{name}=")


@IN_PROCESS
@given(value=bad_seed)
def test_seeds_outside_the_generators_range_are_one_error_line(tiny_run: Path, capsys, value: int) -> None:
    _refused(["generate", str(tiny_run), f"--seed={value}"], capsys, f"--seed={value}")


@settings(max_examples=10, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(extra=st.integers(min_value=0, max_value=10**30))
def test_a_continuation_past_max_seq_len_is_refused_before_generating(tiny_run: Path, capsys, extra: int) -> None:
    # the tiny model's max_seq_len is 128; the prompt is 3 byte tokens
    _refused(["generate", str(tiny_run), "--prompt", "abc", f"--max-new-tokens={126 + extra}"], capsys,
             "max_seq_len=128")


@settings(max_examples=12, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(temperature=st.one_of(st.just(0.0), st.just(5e-324), st.floats(min_value=0, max_value=1e308)),
       top_k=st.integers(min_value=0, max_value=10**6), seed=st.integers(min_value=0, max_value=2**64 - 1),
       top_p=st.one_of(st.just(1.0), st.just(5e-324), st.floats(min_value=0, max_value=1, exclude_min=True)),
       min_p=st.one_of(st.just(0.0), st.just(1.0), st.floats(min_value=0, max_value=1)),
       penalty=st.one_of(st.just(1.0), st.just(5e-324), st.floats(min_value=0, max_value=1e308, exclude_min=True)))
def test_every_in_range_setting_generates(tiny_run: Path, capsys, temperature: float, top_k: int, seed: int,
                                          top_p: float, min_p: float, penalty: float) -> None:
    capsys.readouterr()
    assert main(["generate", str(tiny_run), "--prompt", "the", "--max-new-tokens=3", f"--temperature={temperature!r}",
                 f"--top-k={top_k}", f"--seed={seed}", f"--top-p={top_p!r}", f"--min-p={min_p!r}",
                 f"--repetition-penalty={penalty!r}"]) == 0, capsys.readouterr().err


@settings(max_examples=200, deadline=None)
@given(max_new_tokens=st.one_of(bad_int, st.booleans(), st.floats(allow_nan=True)),
       temperature=st.one_of(bad_temperature, st.none(), st.text(max_size=3)),
       top_k=st.one_of(bad_int, st.floats(allow_nan=True)), which=st.integers(0, 2))
def test_the_python_api_checks_the_same_ranges(max_new_tokens, temperature, top_k, which: int) -> None:
    """``TransformerLM.generate`` itself refuses what the CLI refuses (one bad argument at a time)."""
    args = [3, 1.0, 5]
    args[which] = (max_new_tokens, temperature, top_k)[which]
    with pytest.raises(ConfigError):
        check_generate_args(*args)


@settings(max_examples=100, deadline=None)
@given(case=st.one_of(st.tuples(st.just("top_p"), st.one_of(bad_top_p, st.none(), st.text(max_size=3))),
                      st.tuples(st.just("min_p"), st.one_of(bad_min_p, st.none(), st.booleans())),
                      st.tuples(st.just("repetition_penalty"), st.one_of(bad_penalty, st.none()))))
def test_the_python_api_checks_the_filters_too(case: tuple[str, object]) -> None:
    name, value = case
    with pytest.raises(ConfigError, match=f"^{name}="):
        check_generate_args(3, 1.0, 5, **{name: value})


def test_generate_itself_refuses_before_sampling() -> None:
    torch.manual_seed(0)
    model = TransformerLM(ModelConfig.from_preset("tiny", vocab_size=64)).eval()
    prompt = torch.randint(0, 64, (1, 4))
    with pytest.raises(ConfigError, match="temperature=nan"):
        model.generate(prompt, 2, temperature=math.nan)
    with pytest.raises(ConfigError, match="max_seq_len=128"):
        model.generate(prompt, 125)
    with pytest.raises(ConfigError, match="a prompt of 0 tokens"):
        model.generate(prompt[:, :0], 2)
    assert model.generate(prompt, 124, temperature=0).shape == (1, 128)  # exactly max_seq_len is fine
    assert torch.equal(model.generate(prompt, 5, temperature=1e-300, top_k=0), model.generate(prompt, 5, temperature=0))
