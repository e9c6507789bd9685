"""A tokenizer's chat templates: the Jinja text ``transformers``' ``apply_chat_template`` renders (in its own
sandbox; hybridnorm never renders or runs one), kept so that an instruct model imported, fine-tuned and
exported again still formats conversations as it was trained to.

A Hugging Face folder holds them as transformers reads them (:func:`read_hf_folder`); a run folder, and each
of its checkpoints, as one JSON object ``{name: template}`` (:data:`FILE`; ``"default"`` is the one
``apply_chat_template`` uses unless asked for another), hashed in the checkpoint's manifest like the other
run files. They are not part of the tokenizer's fingerprint: they change no token of the training data.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from hybridnorm import plain_data
from hybridnorm.errors import ConfigError

FILE = "chat_templates.json"
DEFAULT = "default"
# transformers' own names (transformers.utils.CHAT_TEMPLATE_FILE / CHAT_TEMPLATE_DIR)
HF_FILE, HF_DIR, HF_CONFIG = "chat_template.jinja", "additional_chat_templates", "tokenizer_config.json"
# arguments of transformers' apply_chat_template that hybridnorm or lm-eval set, not template variables
RESERVED = frozenset({"conversation", "messages", "chat_template", "tokenize", "add_generation_prompt",
                      "continue_final_message", "return_dict", "return_tensors", "tokenizer_kwargs", "padding",
                      "truncation", "max_length", "return_assistant_tokens_mask"})
MAX_BYTES = 4 << 20  # the longest published templates are tens of KB; a tokenizer_config.json also holds vocab


def _read_bytes(file: Path) -> bytes:
    try:
        if file.stat().st_size > MAX_BYTES:
            raise ConfigError(f"{file} is {file.stat().st_size:,} bytes; a chat template file is at most "
                              f"{MAX_BYTES:,}")
        return file.read_bytes()
    except OSError as e:
        raise ConfigError(f"cannot read {file}: {e.strerror or e}") from None


def _read_text(file: Path) -> str:
    try:
        return _read_bytes(file).decode("utf-8")
    except UnicodeDecodeError as e:
        raise ConfigError(f"{file} is not UTF-8 text (byte {e.start})") from None


def _read_json(file: Path) -> Any:
    try:
        return plain_data.loads(_read_bytes(file))
    except ValueError as e:  # not UTF-8, not JSON, nested too deep
        raise ConfigError(f"cannot read {file}: {plain_data.describe_error(e)}") from None


def checked(templates: Any, where: str) -> dict[str, str]:
    """``templates`` as ``{name: template}``: names non-empty strings, templates strings; one ConfigError
    naming ``where`` otherwise."""
    if not isinstance(templates, dict):
        raise ConfigError(f"{where}: expected an object of named chat templates, got {type(templates).__name__}")
    for name, text in templates.items():
        if not (isinstance(name, str) and name.strip()) or not isinstance(text, str):
            raise ConfigError(f"{where}: chat template {name!r} must be a name with a Jinja string, got "
                              f"{type(text).__name__}"[:300])
    return dict(templates)


def read_hf_folder(folder: Path) -> dict[str, str]:
    """The chat templates ``transformers.AutoTokenizer.from_pretrained(folder)`` loads: ``chat_template.jinja``
    (the default) and ``additional_chat_templates/<name>.jinja`` where the folder has any of them (they then
    replace what ``tokenizer_config.json`` holds, as in transformers), else ``tokenizer_config.json``'s
    ``chat_template``: a string (the default) or a list of ``{"name": ..., "template": ...}``. ``{}`` for
    none. A file that cannot be read, or a value of another shape, is one ConfigError naming the file."""
    templates = {DEFAULT: _read_text(folder / HF_FILE)} if (folder / HF_FILE).is_file() else {}
    if (folder / HF_DIR).is_dir():  # a named one called "default" replaces the file's, as in transformers
        templates |= {f.name.removesuffix(".jinja"): _read_text(f) for f in sorted((folder / HF_DIR).glob("*.jinja"))}
    if templates:
        return templates
    config = folder / HF_CONFIG
    if not config.is_file():
        return {}
    data = _read_json(config)
    value = data.get("chat_template") if isinstance(data, dict) else None
    if value is None:
        return {}
    if isinstance(value, str):
        return {DEFAULT: value}
    if isinstance(value, list) and all(isinstance(t, dict) and set(t) >= {"name", "template"} for t in value):
        return checked({t["name"]: t["template"] for t in value}, f"{config}: chat_template")
    raise ConfigError(f"{config}: chat_template must be a Jinja string or a list of {{\"name\": ..., "
                      f"\"template\": ...}}, got {json.dumps(value)[:80]}")


def read(file: Path) -> dict[str, str]:
    """A run's :data:`FILE`."""
    return checked(_read_json(file), str(file))


def dumps(templates: dict[str, str]) -> str:
    return json.dumps(templates, ensure_ascii=False, indent=1, sort_keys=True)


def for_transformers(templates: dict[str, str]) -> str | dict[str, str] | None:
    """What a transformers tokenizer's ``chat_template`` holds for them (and what ``save_pretrained`` writes
    back as ``chat_template.jinja`` and ``additional_chat_templates/``): the one default alone as a string."""
    if not templates:
        return None
    return templates[DEFAULT] if set(templates) == {DEFAULT} else dict(templates)


def select(templates: dict[str, str], name: str | None, where: str) -> str:
    """The template called ``name`` (None: the default, as transformers' ``apply_chat_template`` picks it
    when given no name and no tools); one ConfigError naming ``where`` and the valid names otherwise."""
    if not templates:
        raise ConfigError(f"{where} has no chat template (no {FILE}): only a run imported from a folder with "
                          f"one has them")
    name = DEFAULT if name is None else name
    if name not in templates:
        raise ConfigError(f"{where} has no chat template named {name!r}; valid: {', '.join(sorted(templates))}")
    return templates[name]


def template_args(text: str | dict[str, Any] | None, where: str) -> dict[str, Any]:
    """Extra variables for a chat template (``{"enable_thinking": false}`` for Qwen3's), given as a JSON object
    (a command-line option) or a dict; one ConfigError naming ``where`` otherwise. Parsed as JSON data only."""
    if text is None:
        return {}
    try:
        value = plain_data.loads(text) if isinstance(text, str) else text
    except ValueError as e:
        raise ConfigError(f"{where}: {plain_data.describe_error(e)}") from None
    if not isinstance(value, dict) or not all(isinstance(k, str) and k.isidentifier() for k in value):
        raise ConfigError(f"{where} must be a JSON object of template variables such as "
                          f"'{{\"enable_thinking\": false}}', got {json.dumps(value)[:80]}")
    if taken := sorted(RESERVED & set(value)):
        raise ConfigError(f"{where}: {', '.join(taken)} {'is' if len(taken) == 1 else 'are'} set by the caller "
                          f"of the template, not a template variable")
    return value
