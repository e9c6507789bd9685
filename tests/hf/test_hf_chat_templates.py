"""An instruct model's chat templates travel: a folder's (each layout transformers reads) -> `hybridnorm import`
-> fine-tuning (`train --resume`) -> `hybridnorm export`, after which transformers' own `apply_chat_template`
formats every conversation exactly as it did from the original folder. Oracle: ``AutoTokenizer`` of the
original folder. Also: a folder without one gives a run and an export without one, and every bad or damaged
file is one error naming it."""

from __future__ import annotations

import json
import re
import shutil
from pathlib import Path

import pytest

pytest.importorskip("transformers", reason="the hf extra (transformers) is not installed")
from eos_helpers import BOS, EOS, deepseek_tokenizer, fine_tune, save_folder  # tests/hf/
from train_helpers import cli_in_process  # tests/

# a Llama 3 style template (special tokens, the BOS from the tokenizer, a generation prompt) and a second one
DEFAULT = ("{{ bos_token }}{% for m in messages %}<|start|>{{ m['role'] }}\n{{ m['content'] | trim }}{{ eos_token }}"
           "{% endfor %}{% if add_generation_prompt %}<|start|>assistant\n{% endif %}")
TOOLS = ("{% for m in messages %}[{{ m['role'] | upper }}] {{ m['content'] }}\n{% endfor %}"
         "{% if tools %}TOOLS: {{ tools | length }}{% endif %}")
CHAT = [{"role": "system", "content": "Thou art brief."}, {"role": "user", "content": "  Who said unto Moses? "},
        {"role": "assistant", "content": "The lord."}, {"role": "user", "content": "And then?"}]
LAYOUTS = {  # how the folder holds them -> what transformers' AutoTokenizer reads
    "jinja": (DEFAULT, "files"),
    "jinja-and-named": ({"default": DEFAULT, "tool_use": TOOLS}, "files"),
    "tokenizer_config-string": (DEFAULT, "config"),
    "tokenizer_config-list": ({"default": DEFAULT, "tool_use": TOOLS}, "config"),
}


cli = cli_in_process  # the command's own main, in this process


@pytest.fixture(scope="module")
def tokenizer(corpus: Path):
    return deepseek_tokenizer(corpus)


def chat_folder(hf, path: Path, layout: str) -> Path:
    """A DeepSeek-style folder (stock Llama, random weights) whose tokenizer carries the layout's templates."""
    import transformers

    save_folder(hf, path, model=True)
    templates, where = LAYOUTS[layout]
    fast = transformers.PreTrainedTokenizerFast(tokenizer_object=hf, bos_token=BOS, eos_token=EOS,
                                                chat_template=templates)
    fast.save_pretrained(path, save_jinja_files=where == "files")  # transformers' two ways of saving them
    assert ((path / "chat_template.jinja").is_file()) == (where == "files")
    return path


def formatted(folder: Path, **kw) -> list[list[int]]:
    """transformers' own formatting of the conversation (and of each prefix of it), as token ids."""
    import transformers

    tok = transformers.AutoTokenizer.from_pretrained(folder)
    return [tok.apply_chat_template(CHAT[:n], add_generation_prompt=True, tokenize=True, return_dict=False, **kw)
            for n in range(1, len(CHAT) + 1)]


@pytest.mark.parametrize("layout", LAYOUTS)
def test_import_and_export_keep_every_layouts_templates(tmp_path: Path, tokenizer, layout: str) -> None:
    import transformers

    from hybridnorm.data.chat_templates import FILE, read_hf_folder
    from hybridnorm.hf.export import export_run, import_hf

    folder = chat_folder(tokenizer, tmp_path / "instruct", layout)
    theirs = transformers.AutoTokenizer.from_pretrained(folder).chat_template
    assert theirs == LAYOUTS[layout][0]  # what transformers reads, and so what must survive
    named = {"default": theirs} if isinstance(theirs, str) else theirs
    assert read_hf_folder(folder) == named
    run, exported = tmp_path / "run", tmp_path / "exported"
    import_hf(folder, run)  # the commands' own functions, in this process (the CLI: the fine-tuning test)
    ckpt = run / "checkpoints" / "step_000000"
    assert FILE in json.loads((ckpt / "manifest.json").read_text())
    assert json.loads((ckpt / FILE).read_text(encoding="utf-8")) == named
    export_run(run, exported)
    assert transformers.AutoTokenizer.from_pretrained(exported).chat_template == theirs
    assert formatted(exported) == formatted(folder)
    if "tool_use" in named:
        tools = [{"type": "function", "function": {"name": "f", "description": "d", "parameters": {}}}]
        assert (formatted(exported, chat_template="tool_use", tools=tools)
                == formatted(folder, chat_template="tool_use", tools=tools))


def test_fine_tuning_keeps_them_and_a_folder_without_any_gives_none(tmp_path: Path, tokenizer, corpus: Path,
                                                                    no_peak_measure: None) -> None:
    """The README's fine-tune command (`train RUN/config.yaml --out RUN --resume`) copies the templates into
    the new checkpoint; an export of that checkpoint, copied out of its run, formats as the folder did."""
    import transformers

    from hybridnorm.data.chat_templates import FILE

    folder = chat_folder(tokenizer, tmp_path / "instruct", "jinja-and-named")
    run = tmp_path / "run"
    cli("import", str(folder), "--out", str(run))
    fine_tune(run, corpus, tmp_path / "cache", "--max_steps=2", "--ckpt_interval=1")
    for step in (1, 2):  # the first resumed checkpoint and the one after it (carried on, not re-imported)
        ckpt = run / "checkpoints" / f"step_{step:06d}"
        assert FILE in json.loads((ckpt / "manifest.json").read_text())
    shutil.copytree(run / "checkpoints" / "step_000002", tmp_path / "alone")
    cli("export", str(tmp_path / "alone"), "--to", "hf", str(tmp_path / "exported"))
    assert formatted(tmp_path / "exported") == formatted(folder)

    plain = save_folder(tokenizer, tmp_path / "base", model=True)
    cli("import", str(plain), "--out", str(tmp_path / "base-run"))
    assert not (tmp_path / "base-run" / FILE).exists()
    assert FILE not in json.loads((tmp_path / "base-run" / "checkpoints" / "step_000000" / "manifest.json").read_text())
    cli("export", str(tmp_path / "base-run"), "--to", "hf", str(tmp_path / "base-export"))
    assert transformers.AutoTokenizer.from_pretrained(tmp_path / "base-export").chat_template is None
    assert not (tmp_path / "base-export" / "chat_template.jinja").exists()


@pytest.mark.parametrize(("where", "content", "says"), [
    ("tokenizer_config.json", {"chat_template": 5}, "chat_template must be a Jinja string or a list"),
    ("tokenizer_config.json", {"chat_template": [{"name": "a"}]}, "chat_template must be a Jinja string or a list"),
    ("tokenizer_config.json", {"chat_template": [{"name": 3, "template": "x"}]}, "chat template 3 must be a name"),
    ("tokenizer_config.json", {"chat_template": [{"name": "a", "template": ["x"]}]}, "chat template 'a' must be"),
    ("chat_template.jinja", b"\xff\xfe{{ x }}", "is not UTF-8 text"),
    ("additional_chat_templates/tool_use.jinja", b"{{ \xc3 }}", "is not UTF-8 text"),
])
def test_a_bad_template_in_a_folder_is_one_error_naming_the_file(tmp_path: Path, tokenizer, where: str,
                                                                 content: object, says: str) -> None:
    folder = save_folder(tokenizer, tmp_path / "bad", model=True)
    file = folder / where
    file.parent.mkdir(exist_ok=True)
    if isinstance(content, dict):
        content = json.dumps({**json.loads((folder / "tokenizer_config.json").read_text()), **content}).encode()
    file.write_bytes(content)
    if where == "chat_template.jinja":  # as the command line says it
        err = cli("import", str(folder), "--out", str(tmp_path / "run"), ok=False).stderr.strip().splitlines()
        assert len(err) == 1 and str(file) in err[0] and says in err[0], err
    else:
        from hybridnorm.errors import ConfigError
        from hybridnorm.hf.export import import_hf

        with pytest.raises(ConfigError) as e:
            import_hf(folder, tmp_path / "run")
        assert str(file) in str(e.value) and says in str(e.value) and "\n" not in str(e.value), str(e.value)
    assert not (tmp_path / "run").exists()


def test_a_damaged_or_stray_copy_in_a_checkpoint_is_one_error(tmp_path: Path, tokenizer) -> None:
    from hybridnorm.data.chat_templates import FILE
    from hybridnorm.hf.export import export_run, import_hf
    from hybridnorm.train.checkpoint import CheckpointError

    run = tmp_path / "run"
    import_hf(chat_folder(tokenizer, tmp_path / "instruct", "jinja"), run)
    ckpt = run / "checkpoints" / "step_000000"
    good = (ckpt / FILE).read_bytes()
    (ckpt / FILE).write_bytes(good.replace(b"assistant", b"assistent"))  # same size: only the hash can tell
    err = cli("export", str(ckpt), "--to", "hf", str(tmp_path / "out"), ok=False).stderr.strip().splitlines()
    assert len(err) == 1 and f"checkpoint file {ckpt / FILE} is corrupt" in err[0], err
    (ckpt / FILE).write_bytes(good)

    base = tmp_path / "base-run"
    import_hf(save_folder(tokenizer, tmp_path / "base", model=True), base)
    stray = base / "checkpoints" / "step_000000" / FILE
    stray.write_bytes(good)  # dropped in by hand: the checkpoint was not written with it
    with pytest.raises(CheckpointError, match=f"{re.escape(str(stray))} is not recorded"):
        export_run(base, tmp_path / "out2")
    assert not (tmp_path / "out2").exists()


def test_generate_chat_replies_as_transformers_generate_of_the_folder(tmp_path: Path, tokenizer) -> None:
    """`hybridnorm generate RUN --chat [NAME] [--system S]` prints the greedy reply that transformers' own
    `generate` gives on the original folder for the conversation its `apply_chat_template` formats. The
    default template writes the BOS itself (no second one is added); the named one writes none, so the
    prompt starts from the tokenizer's BOS, as lm-eval's HF backend starts a chat prompt."""
    import transformers

    from hybridnorm.hf.export import import_hf

    folder = chat_folder(tokenizer, tmp_path / "instruct", "jinja-and-named")
    import_hf(folder, tmp_path / "run")
    tok = transformers.AutoTokenizer.from_pretrained(folder)
    model = transformers.AutoModelForCausalLM.from_pretrained(folder).eval()
    question = "Who said unto Moses?"
    for name, system in ((None, None), ("tool_use", "Thou art brief.")):
        turns = [{"role": "system", "content": system}] if system else []
        text = tok.apply_chat_template([*turns, {"role": "user", "content": question}], chat_template=name,
                                       add_generation_prompt=True, tokenize=False)
        ids = tok(text, add_special_tokens=not text.startswith(BOS), return_tensors="pt").input_ids
        assert ids[0].tolist().count(tok.bos_token_id) == 1 and ids[0, 0] == tok.bos_token_id
        new = model.generate(ids, attention_mask=ids.new_ones(ids.shape), max_new_tokens=12,
                             do_sample=False)[0, ids.shape[1]:].tolist()
        reply = tok.decode(new[:-1] if new[-1] == tok.eos_token_id else new)
        argv = ["generate", str(tmp_path / "run"), "--chat", *([name] if name else []), "--prompt", question,
                "--temperature", "0", "--max-new-tokens", "12", *(["--system", system] if system else [])]
        assert cli(*argv).stdout == reply + "\n"
    # several user turns (one conversation each) as one left-padded batch: each reply as it is alone (greedy)
    questions, flags = [question, "And the river?"], ["--temperature", "0", "--max-new-tokens", "12", "--chat"]
    alone = [cli("generate", str(tmp_path / "run"), "--prompt", q, *flags).stdout for q in questions]
    assert cli("generate", str(tmp_path / "run"), "--prompt", questions[0], "--prompt", questions[1],
               *flags).stdout == "\n".join(alone)
    for argv, says in [(["--chat", "nope"], "no chat template named 'nope'; valid: default, tool_use"),
                       (["--system", "x"], "--system is for a chat turn: it needs --chat")]:
        err = cli("generate", str(tmp_path / "run"), *argv, ok=False).stderr.strip().splitlines()
        assert len(err) == 1 and says in err[0], err
