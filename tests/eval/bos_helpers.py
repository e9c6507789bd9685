"""A tokenizer and a Hugging Face folder in the style of Llama 3: a byte-level BPE whose post-processor puts
``<|begin_of_text|>`` (a BOS other than its end-of-text token ``<|end_of_text|>``) before every text, and a
stock ``LlamaForCausalLM`` with random weights whose BOS embedding row is scaled up, so that a context
started from the BOS and one started from the end-of-text token score measurably apart."""

from __future__ import annotations

from pathlib import Path

from eval_helpers import corpus_text

BOS, EOS = "<|begin_of_text|>", "<|end_of_text|>"


def bos_tokenizer(template: str | None = f"{BOS} $A", vocab_size: int = 320):  # -> tokenizers.Tokenizer
    """The BPE with ids 0 = BOS, 1 = EOS and ``template`` as its single-text post-processor (None: none)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers

    hf = Tokenizer(models.BPE())
    hf.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    hf.decoder = decoders.ByteLevel()
    hf.train_from_iterator(corpus_text(200).splitlines(), trainers.BpeTrainer(
        vocab_size=vocab_size, special_tokens=[BOS, EOS, "<x>"], show_progress=False,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    if template is not None:
        special = [(t, hf.token_to_id(t)) for t in (BOS, EOS, "<x>") if t in template]
        hf.post_processor = processors.Sequence([
            processors.ByteLevel(trim_offsets=False),
            processors.TemplateProcessing(single=template, pair=f"{template} $B:1", special_tokens=special)])
    return hf


def bos_folder(path: Path, seed: int = 0) -> Path:
    """``path`` as the folder a Llama-3-style checkpoint comes in: config, safetensors weights, tokenizer
    files (``tokenizer_config.json`` naming the BOS and EOS, as the Hub's do)."""
    import torch
    import transformers

    hf = bos_tokenizer()
    fast = transformers.PreTrainedTokenizerFast(tokenizer_object=hf, bos_token=BOS, eos_token=EOS)
    cfg = transformers.LlamaConfig(
        vocab_size=hf.get_vocab_size(), hidden_size=64, intermediate_size=96, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256, tie_word_embeddings=False,
        bos_token_id=hf.token_to_id(BOS), eos_token_id=hf.token_to_id(EOS), pad_token_id=None)
    torch.manual_seed(seed)
    model = transformers.LlamaForCausalLM(cfg).eval()
    with torch.no_grad():
        model.model.embed_tokens.weight[hf.token_to_id(BOS)] *= 30
    model.save_pretrained(path)
    fast.save_pretrained(path)
    return path
