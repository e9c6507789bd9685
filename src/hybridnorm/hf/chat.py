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
    """``formatter(messages)`` -> the prompt text of the run's template ``name`` (None: ``default``), rendered
    with ``template_args`` as extra template variables (``enable_thinking=False`` for Qwen3's); a run without
    that template is one ConfigError listing the names it has."""

    def __init__(self, run: Run, name: str | None = None, template_args: dict[str, Any] | None = None) -> None:
        self.name = name or chat_templates.DEFAULT
        self.template = chat_templates.select(run.chat_templates, name, str(run.checkpoint))
        self.template_args = dict(template_args or {})
        self._tokenizer = hf_tokenizer(run.tokenizer, run.model.config.max_seq_len)

    def __call__(self, messages: list[dict[str, Any]], add_generation_prompt: bool = True,
                 continue_final_message: bool = False) -> str:
        return self._tokenizer.apply_chat_template(
            messages, chat_template=self.template, tokenize=False, add_generation_prompt=add_generation_prompt,
            continue_final_message=continue_final_message, **self.template_args)
