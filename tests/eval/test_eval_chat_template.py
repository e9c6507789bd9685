"""lm-eval's chat formatting (``apply_chat_template``, ``fewshot_as_multiturn``, ``system_instruction``) on a
run imported from an instruct folder. Oracle: lm-eval's own HF backend (``HFLM``) on the original folder
(stock ``LlamaForCausalLM``, ``AutoTokenizer`` with the folder's chat template): the same prompts, the same
log-likelihood for every multiple-choice request and the same greedy text for every generation request.
The folder's BOS embedding is scaled up, so a prompt that started from two BOS tokens (the template's and
a prefix) would score measurably apart. Also: every bad request is one error naming what to change."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

lm_eval = pytest.importorskip("lm_eval", reason="the eval extra (lm_eval) is not installed")
pytest.importorskip("transformers", reason="the hf extra (transformers) is not installed")
pytest.importorskip("accelerate", reason="lm-eval's HFLM needs accelerate (in the dev extra)")
from bos_helpers import BOS, bos_folder  # noqa: E402  (tests/eval/: a Llama-3-style folder)
from eval_helpers import task_folder  # noqa: E402
from train_helpers import cli_in_process  # noqa: E402  (tests/)

from hybridnorm import cli  # noqa: E402
from hybridnorm.errors import ConfigError  # noqa: E402
from hybridnorm.eval.lm_eval_adapter import HybridNormLM, run_lm_eval, task_manager  # noqa: E402
from hybridnorm.eval.scoring import encode_pair  # noqa: E402

# Llama 3's shape: the BOS from the template, a header token before each role, the end-of-text token ending
# each turn; the second template renders the roles differently, so choosing it changes every prompt
DEFAULT = ("{{ bos_token }}{% for m in messages %}<x>{{ m['role'] }}\n{{ m['content'] | trim }}{{ eos_token }}"
           "{% endfor %}{% if add_generation_prompt %}<x>assistant\n{% endif %}")
TERSE = ("{{ bos_token }}{% for m in messages %}[{{ m['role'] | upper }}] {{ m['content'] }}\n{% endfor %}"
         "{% if add_generation_prompt %}[ASSISTANT]{% endif %}")
# Qwen3's switch: with enable_thinking false the generation prompt holds an empty reasoning block
THINK = ("{{ bos_token }}{% for m in messages %}<x>{{ m['role'] }}\n{{ m['content'] }}{{ eos_token }}{% endfor %}"
         "{% if add_generation_prompt %}<x>assistant\n{% if enable_thinking is defined and not enable_thinking %}"
         "<think>\n\n</think>\n\n{% endif %}{% endif %}")
TEMPLATES = {"default": DEFAULT, "terse": TERSE, "think": THINK}
MC = [{"q": "The lord said", "endings": ["unto moses", "go", "by day and by night"], "label": 1},
      {"q": "And the river", "endings": ["ran dry", "x", "was built upon a hill"], "label": 2},
      {"q": "Milk and", "endings": ["honey", "qz", "the people"], "label": 0},
      {"q": "Behold the city", "endings": ["was built", "of brass", "upon a hill"], "label": 0}]
GEN = [{"q": "The lord said", "a": "unto"}, {"q": "Behold", "a": "the"}, {"q": "And the river", "a": "ran"}]
TASKS = {
    "chat_mc": (MC, "output_type: multiple_choice\ndoc_to_text: '{{q}}'\ndoc_to_choice: '{{endings}}'\n"
                    "doc_to_target: '{{label}}'\nmetric_list:\n  - metric: acc\n"),
    "chat_gen": (GEN, "output_type: generate_until\ndoc_to_text: '{{q}}'\ndoc_to_target: '{{a}}'\n"
                      "generation_kwargs:\n  until: ['.']\n  max_gen_toks: 5\n  do_sample: false\n"
                      "metric_list:\n  - metric: exact_match\n"),
}
SYSTEM = "Answer as the scripture does."


@pytest.fixture(scope="module")
def folders(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path, Path]:
    """(the instruct folder, its imported run, a task folder)."""
    import transformers

    from hybridnorm.hf.export import import_hf

    root = tmp_path_factory.mktemp("chat")
    folder = bos_folder(root / "instruct")
    tok = transformers.AutoTokenizer.from_pretrained(folder)
    tok.chat_template = TEMPLATES
    tok.save_pretrained(folder)
    import_hf(folder, root / "run")
    return folder, root / "run", task_folder(root, TASKS, extra="fewshot_split: test\n")


def _samples(res: dict, task: str) -> list[dict]:
    return sorted(res["samples"][task], key=lambda s: s["doc_id"])


def _prompt(sample: dict) -> str:
    return sample["arguments"][0][0]  # (context, continuation or gen_kwargs) of the first request


@pytest.mark.parametrize("template", [None, "terse", "think"])
def test_chat_formatted_tasks_equal_lm_evals_hf_backend_on_the_original_folder(folders, template) -> None:
    """``think``: Qwen3's ``enable_thinking=False``, HFLM's model argument, our ``chat_template_args``."""
    from lm_eval.models.huggingface import HFLM

    folder, run, tasks = folders
    names = list(TASKS)
    kw = dict(num_fewshot=2, fewshot_as_multiturn=True, system_instruction=SYSTEM, log_samples=True)
    args = {"enable_thinking": False} if template == "think" else None
    ours = run_lm_eval(run, names, include_path=tasks, include_defaults=False,
                       apply_chat_template=template or True, chat_template_args=args, **kw)
    # HFLM renders the tokenizer's default template whatever name it is given, so it gets the chosen one
    # as its tokenizer's only template
    hflm = HFLM(pretrained=str(folder), batch_size=4, device="cpu",
                **({"enable_thinking": False} if template == "think" else {}))
    hflm.tokenizer.chat_template = TEMPLATES[template or "default"]
    theirs = lm_eval.simple_evaluate(model=hflm, tasks=names, task_manager=task_manager(names, tasks),
                                     apply_chat_template=True, **kw)
    assert {k: ours["config"][k] for k in ("chat_template", "fewshot_as_multiturn", "system_instruction")} == \
        {"chat_template": template or "default", "fewshot_as_multiturn": True, "system_instruction": SYSTEM}
    assert ours["config"]["chat_template_args"] == (args or {})
    for task in names:
        a, b = _samples(ours, task), _samples(theirs, task)
        assert len(a) == len(b) == len(TASKS[task][0])
        for x, y in zip(a, b, strict=True):
            assert x["arguments"] == y["arguments"]  # the same prompts, rendered from the same template
            prompt = _prompt(x)
            assert prompt.startswith(BOS) and prompt.count(BOS) == 1 and SYSTEM in prompt
            assert prompt.count("[USER]" if template == "terse" else "<x>user") == 3  # two shots as turns, then it
            assert prompt.endswith("<think>\n\n</think>\n\n") == (template == "think")
            if task == "chat_mc":
                assert [r[0] for r in x["filtered_resps"]] == pytest.approx([r[0] for r in y["filtered_resps"]],
                                                                             rel=1e-5, abs=1e-4)
            else:
                assert x["filtered_resps"] == y["filtered_resps"]


def test_a_template_that_starts_with_the_bos_gets_no_second_one(folders) -> None:
    from hybridnorm.loading import load_run

    run = load_run(folders[1])
    tok = run.tokenizer
    bos = tok.token_to_id(BOS)
    assert tok.start_id == bos
    ctx, cont = encode_pair(tok, f"{BOS}<x>user\nThe lord said", " unto")
    assert ctx[0] == bos and ctx.count(bos) == 1 and cont
    assert encode_pair(tok, "The lord said", " unto")[0][:2] == [bos, *tok.encode("The")[:1]]


def test_every_bad_chat_request_is_one_error_naming_what_to_change(folders, run_dir, tmp_path, capsys) -> None:
    _, run, tasks = folders
    with pytest.raises(ConfigError, match="no chat template named 'tool_use'; valid: default, terse, think"):
        run_lm_eval(run, ["chat_mc"], include_path=tasks, include_defaults=False, apply_chat_template="tool_use")
    with pytest.raises(ConfigError, match=r"has no chat template \(no chat_templates.json\)"):
        run_lm_eval(run_dir, ["kjv_mc"], limit=1, apply_chat_template=True)  # a byte-level run of our own
    with pytest.raises(ConfigError, match="fewshot_as_multiturn needs apply_chat_template"):
        run_lm_eval(run, ["chat_mc"], include_path=tasks, fewshot_as_multiturn=True)
    for args, says in [('{"enable_thinking": 0', "not valid JSON"), ("[1]", "must be a JSON object"),
                       ('{"tokenize": true}', "tokenize is set by the caller")]:
        with pytest.raises(ConfigError, match=re.escape(says)):
            run_lm_eval(run, ["chat_mc"], include_path=tasks, apply_chat_template=True, chat_template_args=args)
    with pytest.raises(ConfigError, match="chat_template_args needs apply_chat_template"):
        run_lm_eval(run, ["chat_mc"], include_path=tasks, chat_template_args={"enable_thinking": False})
    with pytest.raises(ConfigError, match="enable_thinking=True: only False is supported"):
        HybridNormLM(run, enable_thinking=True)
    assert HybridNormLM(run, enable_thinking="False").chat_template_args == {"enable_thinking": False}
    for argv, needle in [
        (["eval", str(run), "--tasks", "kjv_mc", "--chat-template-args", "{}"], "needs --apply-chat-template"),
        (["eval", str(run), "--tasks", "kjv_mc", "--apply-chat-template", "--chat-template-args", "[]"],
         "--chat-template-args must be a JSON object"),
        (["generate", str(run), "--chat-template-args", "{}"], "--chat-template-args is for a chat turn"),
        (["generate", str(run), "--chat", "--chat-template-args", "{x"], "--chat-template-args: not valid JSON"),
        (["eval", str(run), "--apply-chat-template"], "--apply-chat-template: only for lm-eval tasks"),
        (["eval", str(run), "--tasks", "kjv_mc", "--fewshot-as-multiturn"], "needs --apply-chat-template"),
        (["eval", str(run), "--tasks", "kjv_mc", "--apply-chat-template", "nope"], "valid: default, terse, think"),
    ]:
        assert cli.main(argv) == 2
        err = capsys.readouterr().err.strip().splitlines()
        assert len(err) == 1 and err[0].startswith("error: ") and needle in err[0], err


def test_the_eval_command_says_how_its_prompts_were_built(folders, tmp_path) -> None:
    """`hybridnorm eval --tasks ... --apply-chat-template NAME --fewshot-as-multiturn`: the table's note and
    the JSON's lm-eval config name the template (lm-eval's own results record it only through its tracker):
    a chat-formatted score is not comparable with a plain one."""
    import json

    _, run, tasks = folders
    out = tmp_path / "res.json"
    done = cli_in_process("eval", str(run), "--tasks", "chat_mc", "--include-path", str(tasks), "--limit", "2",
                          "--num-fewshot", "1", "--apply-chat-template", "terse", "--fewshot-as-multiturn",
                          "--output", str(out))
    assert "lm-eval prompts: chat template 'terse', few-shot as turns" in " ".join(done.stdout.split())
    config = json.loads(out.read_text())["lm_eval"]["config"]
    assert (config["chat_template"], config["fewshot_as_multiturn"], config["system_instruction"]) == \
        ("terse", True, None)
    plain = cli_in_process("eval", str(run), "--tasks", "chat_mc", "--include-path", str(tasks), "--limit", "2")
    assert "chat template" not in plain.stdout


def test_generate_chat_with_template_variables_replies_as_transformers(folders) -> None:
    """`generate --chat think --chat-template-args '{"enable_thinking": false}'` == transformers' greedy
    `generate` of the folder on `apply_chat_template(..., enable_thinking=False)`."""
    import torch
    import transformers

    folder, run, _ = folders
    tok = transformers.AutoTokenizer.from_pretrained(folder)
    model = transformers.AutoModelForCausalLM.from_pretrained(folder).eval()
    turns = [{"role": "user", "content": "Who said unto Moses?"}]
    text = tok.apply_chat_template(turns, chat_template="think", add_generation_prompt=True, tokenize=False,
                                   enable_thinking=False)
    assert text.endswith("<think>\n\n</think>\n\n")
    ids = tok(text, add_special_tokens=False, return_tensors="pt").input_ids
    with torch.no_grad():
        new = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=8,
                             do_sample=False)[0, ids.shape[1]:].tolist()
    reply = tok.decode(new[:-1] if new[-1] == tok.eos_token_id else new)
    done = cli_in_process("generate", str(run), "--chat", "think", "--chat-template-args", '{"enable_thinking": false}',
                          "--prompt", turns[0]["content"], "--temperature", "0", "--max-new-tokens", "8")
    assert done.stdout == reply + "\n"
