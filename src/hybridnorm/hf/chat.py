"""A run's conversations formatted by its chat template (an imported instruct folder's), rendered by
transformers' own ``apply_chat_template`` in its Jinja sandbox: hybridnorm renders no template itself. The
run's tokenizer is handed to transformers as the export writes it (:func:`~hybridnorm.hf.export.hf_tokenizer`),
so ``bos_token`` and ``eos_token`` in a template are the ones the exported folder has."""

from __future__ import annotations

from typing import Any

from hybridnorm.data import chat_templates
from hybridnorm.hf.export import hf_tokenizer
from hybridnorm.train.run import Run


class ChatFormatter:
    """``formatter(messages, name, template_args)`` -> the prompt text of the run's template ``name`` (None:
    ``default``), rendered with ``template_args`` as extra template variables (``enable_thinking=False`` for
    Qwen3's); a run without that template is one ConfigError listing the names it has. The transformers
    tokenizer is built once, for every call."""

    def __init__(self, run: Run) -> None:
        self._templates, self._where = run.chat_templates, str(run.checkpoint)
        self._tokenizer = hf_tokenizer(run.tokenizer, run.model.config.max_seq_len)

    def __call__(self, messages: list[dict[str, Any]], name: str | None = None,
                 template_args: dict[str, Any] | None = None, add_generation_prompt: bool = True,
                 continue_final_message: bool = False) -> str:
        template = chat_templates.select(self._templates, name, self._where)
        return self._tokenizer.apply_chat_template(
            messages, chat_template=template, tokenize=False, add_generation_prompt=add_generation_prompt,
            continue_final_message=continue_final_message, **(template_args or {}))
