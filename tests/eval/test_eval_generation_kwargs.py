"""lm-eval ``generate_until`` requests decode as lm-eval's HF backend decodes them: the task's
``generation_kwargs`` (greedy, or sampled with its own settings) over the model's decoding defaults (a folder's
``generation_config.json``, kept by ``import``), then transformers' defaults. Oracle: ``HFLM`` at the same
``batch_size`` on the original folder (stock ``LlamaForCausalLM``) under the same ``simple_evaluate`` seeds:
the same text for every request, greedy with the folder's repetition penalty and sampled alike."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

lm_eval = pytest.importorskip("lm_eval", reason="the eval extra (lm_eval) is not installed")
pytest.importorskip("transformers", reason="the hf extra (transformers) is not installed")
pytest.importorskip("accelerate", reason="lm-eval's HFLM needs accelerate (in the dev extra)")
from bos_helpers import bos_folder  # noqa: E402  (tests/eval/: a Llama-3-style folder)
from eval_helpers import write_jsonl  # noqa: E402

from hybridnorm.errors import ConfigError  # noqa: E402
from hybridnorm.eval.lm_eval_adapter import run_lm_eval, task_manager  # noqa: E402
from hybridnorm.hf.export import import_hf  # noqa: E402

DOCS = [{"q": q, "a": "x"} for q in ("The lord said", "Behold", "And the river", "Milk and honey where the",
                                     "Go forth into a land")]
# a Qwen-style card: sampling settings, and a repetition penalty that transformers applies to greedy decoding too
CARD = dict(do_sample=True, temperature=0.7, top_k=20, top_p=0.9, repetition_penalty=1.3)
TASKS = {  # name: generation_kwargs
    "gen_greedy": "  do_sample: false\n",
    "gen_sampled": "  do_sample: true\n  temperature: 1.2\n",
    "gen_hot": "  temperature: 1.5\n  top_k: 0\n",  # no do_sample: lm-eval samples because temperature > 0
    # rows of a batch end at other steps, by other stop strings: a sampled batch must end where HFLM's does
    "gen_stops": "  do_sample: true\n  temperature: 1.0\n  until: ['a', 'o', 'i']\n  max_gen_toks: 24\n",
}


DEFAULT_STOP = "  until: ['.']\n  max_gen_toks: 12\n"


def task_folder(root: Path, tasks: dict[str, str]) -> Path:
    folder = root / "tasks"
    folder.mkdir()
    data = write_jsonl(root / "gen.jsonl", DOCS)
    for name, kwargs in tasks.items():
        (folder / f"{name}.yaml").write_text(
            f"task: {name}\ndataset_path: json\ndataset_kwargs:\n  data_files:\n    test: {data}\n"
            f"  cache_dir: {root / 'hf-cache'}\ntest_split: test\noutput_type: generate_until\n"
            "doc_to_text: '{{q}}'\ndoc_to_target: '{{a}}'\ngeneration_kwargs:\n"
            f"{'' if '  until:' in kwargs else DEFAULT_STOP}{kwargs}"
            "metric_list:\n  - metric: exact_match\nmetadata:\n  version: 1.0\n",
            encoding="utf-8")
    return folder


@pytest.fixture(scope="module")
def setup(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path, Path, Path]:
    """(the folder with CARD, its imported run, the same folder without CARD imported, the task folder)."""
    root = tmp_path_factory.mktemp("genkw")
    plain = bos_folder(root / "plain")
    import_hf(plain, root / "plain-run")
    folder = bos_folder(root / "card")
    file = folder / "generation_config.json"
    file.write_text(json.dumps({**json.loads(file.read_text()), **CARD}))
    import_hf(folder, root / "run")
    return folder, root / "run", root / "plain-run", task_folder(root, TASKS)


def texts(res: dict, task: str) -> list[str]:
    return [s["filtered_resps"][0] for s in sorted(res["samples"][task], key=lambda s: s["doc_id"])]


@pytest.mark.parametrize("batch_size", [1, 3])
def test_every_request_decodes_as_lm_evals_hf_backend_decodes_it(setup, batch_size: int) -> None:
    """At the same ``batch_size`` (5 requests: batches of 3 and 2, left-padded), ours == HFLM's for every reply:
    a sampled batch draws as transformers' ``generate`` draws a batch, and ends where HFLM's batch ends."""
    from lm_eval.models.huggingface import HFLM

    folder, run, plain_run, tasks = setup
    names = list(TASKS)
    ours = run_lm_eval(run, names, include_path=tasks, include_defaults=False, log_samples=True,
                       batch_size=batch_size)
    hflm = HFLM(pretrained=str(folder), batch_size=batch_size, device="cpu")
    theirs = lm_eval.simple_evaluate(model=hflm, tasks=names, task_manager=task_manager(names, tasks),
                                     log_samples=True)
    for task in names:
        assert texts(ours, task) == texts(theirs, task), task
    if batch_size == 1:
        return
    # the batch decides the draw (so one request at a time would fail the comparison above), not the greedy text
    alone = run_lm_eval(run, names, include_path=tasks, include_defaults=False, log_samples=True, batch_size=1)
    assert texts(alone, "gen_greedy") == texts(ours, "gen_greedy")
    assert texts(alone, "gen_sampled") != texts(ours, "gen_sampled")
    # each setting mattered: the card's penalty changes the greedy text, sampling changes it again
    plain = run_lm_eval(plain_run, names, include_path=tasks, include_defaults=False, log_samples=True)
    assert texts(plain, "gen_greedy") != texts(ours, "gen_greedy")
    assert texts(ours, "gen_sampled") != texts(ours, "gen_greedy") != texts(ours, "gen_hot")
    # and lm-eval's seed is the one drawn from: the same seed, the same samples
    again = run_lm_eval(run, ["gen_sampled"], include_path=tasks, include_defaults=False, log_samples=True,
                        batch_size=batch_size)
    assert texts(again, "gen_sampled") == texts(ours, "gen_sampled")


@pytest.mark.parametrize(("kwargs", "says"), [
    ("  do_sample: true\n  temperature: 1.0\n  top_p: 1.5\n", "top_p=1.5 must be a number in (0, 1]"),
    ("  temperature: -1\n", "temperature=-1.0 must be a finite number >= 0"),
    ("  do_sample: 'yes'\n", "do_sample='yes' must be true or false"),
    ("  until: 5\n", "until=5 must be a string or a list of strings"),  # was a TypeError traceback
    ("  until: ['.', 3]\n", "until=['.', 3] must be a string or a list of strings"),
])
def test_a_bad_generation_kwarg_is_one_error_naming_it(setup, tmp_path: Path, kwargs: str, says: str) -> None:
    _, run, _, _ = setup
    tasks = task_folder(tmp_path, {"gen_bad": kwargs})
    with pytest.raises(ConfigError) as e:
        run_lm_eval(run, ["gen_bad"], include_path=tasks, include_defaults=False)
    assert str(e.value).startswith("lm-eval generation_kwargs {") and says in str(e.value)
    assert "\n" not in str(e.value)


def test_what_is_not_applied_is_said_once(setup, tmp_path: Path) -> None:
    _, run, _, _ = setup
    tasks = task_folder(tmp_path, {"gen_beams": "  do_sample: false\n  num_beams: 4\n"})
    with pytest.warns(UserWarning, match="does not apply generation_kwargs num_beams") as caught:
        run_lm_eval(run, ["gen_beams"], include_path=tasks, include_defaults=False)
    assert sum("num_beams" in str(w.message) for w in caught) == 1  # five requests, one warning


def test_the_seed_is_lm_evals_and_the_command_passes_it(setup, tmp_path: Path) -> None:
    """`--seed N` sets lm-eval's four seeds as `lm_eval --seed N` does: the sampled replies are HFLM's under
    those seeds, and another seed draws others."""
    from lm_eval.models.huggingface import HFLM
    from train_helpers import cli_in_process  # tests/

    folder, run, _, tasks = setup
    seeds = dict(random_seed=7, numpy_random_seed=7, torch_random_seed=7, fewshot_random_seed=7)
    ours = run_lm_eval(run, ["gen_sampled"], include_path=tasks, include_defaults=False, log_samples=True, seed=7)
    theirs = lm_eval.simple_evaluate(model=HFLM(pretrained=str(folder), batch_size=8, device="cpu"),
                                     tasks=["gen_sampled"], task_manager=task_manager(["gen_sampled"], tasks),
                                     log_samples=True, **seeds)
    assert texts(ours, "gen_sampled") == texts(theirs, "gen_sampled")
    default = run_lm_eval(run, ["gen_sampled"], include_path=tasks, include_defaults=False, log_samples=True)
    assert texts(ours, "gen_sampled") != texts(default, "gen_sampled")
    out = tmp_path / "res.json"
    cli_in_process("eval", str(run), "--tasks", "gen_sampled", "--include-path", str(tasks), "--seed", "7",
                   "--output", str(out))
    config = json.loads(out.read_text())["lm_eval"]["config"]
    assert [config[k] for k in ("random_seed", "numpy_seed", "torch_seed", "fewshot_seed")] == [7, 7, 7, 7]
    bad = cli_in_process("eval", str(run), "--seed", "7", ok=False).stderr.strip().splitlines()
    assert bad == ["error: --seed: only for lm-eval tasks (--tasks a,b)"], bad
    big = cli_in_process("eval", str(run), "--tasks", "gen_sampled", "--include-path", str(tasks),
                         f"--seed={2**32}", ok=False).stderr.strip().splitlines()  # NumPy's seeds end at 2**32 - 1
    assert big == [f"error: --seed={2**32} must be >= 0 and <= {2**32 - 1}"], big
    with pytest.raises(ConfigError, match=r"seed=-1 must be an integer from 0 to 2\*\*32 - 1"):
        run_lm_eval(run, ["gen_sampled"], include_path=tasks, include_defaults=False, seed=-1)
