"""``batch_size="auto"`` / ``"auto:N"`` (lm-eval's, and ``hybridnorm eval --batch-size auto``): the batch found
is the largest that fits, halving from ``max_batch_size`` on out-of-memory; the scores and replies are those of
one row at a time.

Memory is made scarce by a forward pre-hook on the model that raises torch's own ``OutOfMemoryError`` for a
forward of more than ``budget`` tokens (B·T), as a device of that size would: the same hook stays on while the
requests are scored, so a batch bigger than the probe found would fail the test."""

from __future__ import annotations

import pytest
import torch
from eval_helpers import task_folder

from hybridnorm.errors import ConfigError
from hybridnorm.eval import auto_batch
from hybridnorm.eval.auto_batch import AutoBatch, BatchSize, available_bytes, largest_batch
from hybridnorm.eval.scoring import loglikelihood_text

# 40 distinct (context, continuation) pairs from 1 to 40 characters of context: windows of many lengths
_TEXT = "The lord said unto moses and aaron go forth into a land of milk and honey where the people shall keep"
PAIRS = [(_TEXT[:n], _TEXT[n:n + 1 + n % 5]) for n in range(1, 41)]


class Scarce:
    """A forward pre-hook: forwards of more than ``budget`` tokens run out of memory; ``seen`` records every
    forward's (B, T)."""

    def __init__(self, model: torch.nn.Module, budget: int) -> None:
        self.budget, self.seen = budget, []
        self.handle = model.register_forward_pre_hook(self)

    def __call__(self, module: torch.nn.Module, args: tuple) -> None:
        B, T = args[0].shape
        self.seen.append((B, T))
        if B * T > self.budget:
            raise torch.OutOfMemoryError(f"simulated: {B}x{T} tokens over a budget of {self.budget}")


@pytest.fixture
def scarce(model):
    hooks = []

    def make(budget: int) -> Scarce:
        hooks.append(Scarce(model, budget))
        return hooks[-1]
    yield make
    for h in hooks:
        h.handle.remove()


@pytest.mark.parametrize(("value", "rows", "schedule"), [(8, 8, 1), ("8", 8, 1), (8.0, 8, 1), ("auto", None, 1),
                                                         ("auto:4", None, 4), (" auto:1 ", None, 1)])
def test_batch_size_values_lm_eval_passes(value, rows, schedule):
    assert BatchSize.parse(value) == BatchSize(rows, schedule)


@pytest.mark.parametrize("value", [0, "0", -2, 2.5, "x", "", "auto:", "auto:0", "auto:-1", "auto:2.5", "auto8",
                                   True, None, float("nan"), float("inf")])
def test_bad_batch_sizes_are_one_config_error_naming_the_option(value):
    with pytest.raises(ConfigError, match="batch_size"):
        BatchSize.parse(value)


def test_the_probe_halves_from_max_batch_size_to_the_largest_that_fits(model, scarce):
    hook = scarce(budget=10 * 48)
    assert largest_batch(model, 48, max_batch=64) == 8  # 64, 32, 16 fail; 8 x 48 fits
    assert [b for b, _ in hook.seen] == [64, 32, 16, 8]
    assert largest_batch(model, 48, max_batch=5) == 5
    assert largest_batch(model, 24, max_batch=64) == 16  # shorter rows: more of them
    with pytest.raises(ConfigError, match="not even one row of 48 tokens"):
        scarce(budget=47)
        largest_batch(model, 48)


def test_a_generation_probe_holds_a_cache_and_a_padding_mask_as_a_generation_batch_does(model, scarce):
    calls = []
    handle = model.register_forward_pre_hook(lambda m, a, kw: calls.append(kw), with_kwargs=True)
    try:
        largest_batch(model, 48, max_batch=2, with_cache=True)
    finally:
        handle.remove()
    (kw,) = calls
    assert kw["cache"].max_len == 48 and kw["cache"].k[0].shape[0] == 2
    assert kw["attention_mask"].shape == (2, 48) and not bool(kw["attention_mask"].all())


def test_errors_that_are_not_out_of_memory_are_not_swallowed(model):
    def broken(module, args):
        raise RuntimeError("mat1 and mat2 shapes cannot be multiplied")
    handle = model.register_forward_pre_hook(broken)
    try:
        with pytest.raises(RuntimeError, match="shapes cannot be multiplied"):
            largest_batch(model, 48)
    finally:
        handle.remove()


@pytest.mark.parametrize("spec", ["auto", "auto:3"])
def test_auto_scores_equal_one_row_at_a_time_and_never_exceed_the_probe(model, tok, scarce, spec):
    alone = loglikelihood_text(model, tok, PAIRS, batch_size=1)
    hook = scarce(budget=5 * 48)
    sizer = AutoBatch(model, BatchSize.parse(spec), max_batch=64)
    got = loglikelihood_text(model, tok, PAIRS, batch_size=sizer.scoring())
    assert [ll for ll, _ in got] == pytest.approx([ll for ll, _ in alone], rel=1e-5, abs=1e-5)
    assert [g for _, g in got] == [g for _, g in alone]
    scored = [(b, t) for b, t in hook.seen if b * t <= hook.budget]
    assert max(b for b, _ in scored) > 1  # batched, within the budget (a bigger forward would have raised)
    if spec == "auto":
        assert len(sizer.sizes) == 1
    else:  # three detections, the later ones at shorter windows: bigger batches
        assert len(sizer.sizes) == 3 and sizer.sizes[-1] > sizer.sizes[0], sizer.sizes


def test_on_the_cpu_the_probe_starts_at_what_half_the_available_memory_holds(model, monkeypatch):
    monkeypatch.setattr(auto_batch, "available_bytes", lambda: 10 << 30)
    assert largest_batch(model, 48, max_batch=64) == 64
    cfg, item = model.config, model.embed.weight.element_size()
    per_row = 48 * item * (model.embed.weight.shape[0] + 16 * cfg.d_model)
    memory = 2 * (48 * model.embed.weight.shape[0] * 4 + 3 * per_row)  # half of it: the fp32 row and 3 rows
    monkeypatch.setattr(auto_batch, "available_bytes", lambda: memory)
    assert largest_batch(model, 48, max_batch=64) == 3  # not a halving of 64: the cap is where it starts


def test_available_memory_is_read_from_meminfo(tmp_path):
    meminfo = tmp_path / "meminfo"
    meminfo.write_text("MemTotal:       24000000 kB\nMemFree:  100 kB\nMemAvailable:   12345678 kB\n")
    assert available_bytes(meminfo) == 12345678 * 1024
    assert available_bytes(tmp_path / "missing") == 8 << 30
    assert available_bytes() > 0  # this machine's


MC = [{"context": "The lord said", "endings": ["unto moses and aaron", "go", "by day and by night"], "label": 1},
      {"context": "And the river", "endings": ["ran dry", "x", "was built upon a hill"], "label": 2},
      {"context": "Milk and", "endings": ["honey", "qz", "the people shall keep my law"], "label": 0}] * 4
ROLL = [{"text": "the lord said unto moses and aaron " * 3}, {"text": "behold the river ran dry"}] * 3
GEN = [{"context": "The lord said", "answer": "unto"}, {"context": "Behold the city was", "answer": "the"}] * 3
TASKS = {
    "auto_mc": (MC, "output_type: multiple_choice\ndoc_to_text: '{{context}}'\ndoc_to_choice: '{{endings}}'\n"
                    "doc_to_target: '{{label}}'\nmetric_list:\n  - metric: acc\n"),
    "auto_roll": (ROLL, "output_type: loglikelihood_rolling\ndoc_to_text: ''\ndoc_to_target: '{{text}}'\n"
                        "metric_list:\n  - metric: word_perplexity\n"),
    "auto_gen": (GEN, "output_type: generate_until\ndoc_to_text: '{{context}}'\ndoc_to_target: '{{answer}}'\n"
                      "generation_kwargs:\n  until: ['.']\n  max_gen_toks: 8\n  do_sample: false\n"
                      "metric_list:\n  - metric: exact_match\n"),
}


def test_lm_eval_with_auto_batches_gives_the_numbers_of_batch_size_one(run_dir, tmp_path):
    """Through lm-eval's own ``simple_evaluate`` (the adapter as lm-eval builds it from model_args, and as an
    instance with scarce memory): every request kind, every per-document response equal to batch size 1; the
    sizes found are recorded in lm-eval's results config."""
    lm_eval = pytest.importorskip("lm_eval", reason="lm_eval is not installed (pip install 'hybridnorm[eval]')")
    from hybridnorm.eval.lm_eval_adapter import HybridNormLM, task_manager, use_offline_defaults

    use_offline_defaults()
    folder = task_folder(tmp_path, TASKS)
    tm = task_manager(list(TASKS), folder, False)

    def evaluate(model, model_args=None, **sizes):  # sizes: as lm-eval's command line passes them
        res = lm_eval.simple_evaluate(model=model, model_args=model_args, tasks=list(TASKS), task_manager=tm,
                                      log_samples=True, bootstrap_iters=0, **sizes)
        resps = {t: [s["resps"] for s in sorted(res["samples"][t], key=lambda s: s["doc_id"])] for t in TASKS}
        return res, resps

    _, alone = evaluate("hybridnorm", f"pretrained={run_dir},batch_size=1")
    res, auto = evaluate("hybridnorm", f"pretrained={run_dir}", batch_size="auto:2", max_batch_size=16)
    assert res["config"]["batch_size"] == "auto:2" and res["config"]["batch_sizes"]
    assert max(res["config"]["batch_sizes"]) == 16  # plenty of memory on this machine for the tiny model
    lm = HybridNormLM(str(run_dir), batch_size="auto", max_batch_size=64)
    Scarce(lm.model, budget=2 * 48 + 10)  # the run loaded anew: its own model. 6 contexts of 14-20 tokens
    # in one generation batch would not fit (the probe at the 48-token window finds 2)
    res, scarce_auto = evaluate(lm)
    assert 1 < min(res["config"]["batch_sizes"]) and max(res["config"]["batch_sizes"]) < 64
    for got in (auto, scarce_auto):
        for task in ("auto_mc", "auto_roll"):  # every choice's (log-likelihood, greedy), every document's
            assert _numbers(got[task]) == pytest.approx(_numbers(alone[task]), rel=1e-5, abs=1e-5), task
        assert got["auto_gen"] == alone["auto_gen"]


def _numbers(resps: object) -> list[float]:
    """Every number in lm-eval's nested ``resps`` (lists of (log-likelihood, is-greedy) tuples, or floats)."""
    if isinstance(resps, (list, tuple)):
        return [x for r in resps for x in _numbers(r)]
    return [float(resps)]


@pytest.mark.cuda
def test_on_a_gpu_the_probe_finds_the_largest_halving_that_fits_a_real_memory_limit():
    """A real CUDA out-of-memory error: the process capped at ~3 GiB more than it holds now, a model whose
    logits cost 128 MiB a row of 1024 tokens: the batch found runs, twice it does not (under the same cap)."""
    from hybridnorm import ModelConfig, TransformerLM

    torch.manual_seed(0)
    model = TransformerLM(ModelConfig(vocab_size=32768, d_model=256, n_layers=2, n_heads=4, ffn_hidden_size=512,
                                      max_seq_len=1024)).cuda().eval()
    torch.cuda.empty_cache()
    total = torch.cuda.get_device_properties(0).total_memory
    torch.cuda.set_per_process_memory_fraction(min(1.0, (torch.cuda.memory_reserved() + (3 << 30)) / total))
    try:
        rows = largest_batch(model, 1024, max_batch=64)
        assert 1 < rows < 64 and rows & (rows - 1) == 0  # a halving of 64
        auto_batch._probe(model, rows, 1024, with_cache=False)
        with pytest.raises(torch.OutOfMemoryError):
            auto_batch._probe(model, 2 * rows, 1024, with_cache=False)
        assert 1 <= largest_batch(model, 1024, max_batch=64, with_cache=True) <= rows
    finally:
        torch.cuda.set_per_process_memory_fraction(1.0)
        torch.cuda.empty_cache()
