"""A folder in the style of DeepSeek-R1-Distill-Llama: a tokenizer whose end-of-text token is none of our
aliases (``<｜end▁of▁sentence｜>``, declared by its ``tokenizer_config.json``), its BOS put before every text,
and a stock ``LlamaForCausalLM`` with random weights."""

from __future__ import annotations

from pathlib import Path

import torch

BOS, EOS, PAD = "<｜begin▁of▁sentence｜>", "<｜end▁of▁sentence｜>", "<｜▁pad▁｜>"


def deepseek_tokenizer(corpus: Path, specials: tuple[str, ...] = (BOS, EOS, PAD)):  # -> tokenizers.Tokenizer
    """A byte-level BPE trained on ``corpus`` with DeepSeek's special tokens (ids 0, 1, 2) and its
    post-processor: the BOS before every text."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers

    texts = [p.read_text(encoding="utf-8") for p in sorted(corpus.glob("*.txt"))]
    hf = Tokenizer(models.BPE())
    hf.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    hf.decoder = decoders.ByteLevel()
    hf.train_from_iterator(texts, trainers.BpeTrainer(vocab_size=320, special_tokens=list(specials),
                                                      show_progress=False,
                                                      initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    if BOS in specials:
        hf.post_processor = processors.TemplateProcessing(single=f"{BOS} $A", pair=f"{BOS} $A $B:1",
                                                          special_tokens=[(BOS, hf.token_to_id(BOS))])
    return hf


def save_folder(hf, path: Path, eos: str = EOS, model: bool = False, seed: int = 0) -> Path:
    """``path`` as a DeepSeek-R1-Distill-Llama-style folder: tokenizer.json and tokenizer_config.json as
    transformers writes them (naming BOS and EOS); with ``model``, a stock Llama with random weights too."""
    import transformers

    fast = transformers.PreTrainedTokenizerFast(tokenizer_object=hf, bos_token=BOS, eos_token=eos)
    fast.save_pretrained(path)
    if model:
        cfg = transformers.LlamaConfig(
            vocab_size=hf.get_vocab_size(), hidden_size=64, intermediate_size=96, num_hidden_layers=2,
            num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256, tie_word_embeddings=False,
            bos_token_id=hf.token_to_id(BOS), eos_token_id=hf.token_to_id(eos), pad_token_id=None)
        torch.manual_seed(seed)
        transformers.LlamaForCausalLM(cfg).eval().save_pretrained(path)
    return path


def fine_tune(run: Path, corpus: Path, cache: Path, *steps: str) -> None:
    """The README's fine-tune command, `train RUN/config.yaml --out RUN --resume`, in this process: the run's
    own config, with the tiny test corpus, its small windows and batches, and ``steps`` (``--max_steps=N``, ...)."""
    from train_helpers import tiny_overrides  # tests/

    from hybridnorm.train.config import TrainConfig, apply_overrides
    from hybridnorm.train.trainer import train

    small = [a for a in tiny_overrides(corpus, cache, run) if a.startswith(
        ("--data.source", "--data.cache_dir", "--seq_len", "--batch_size", "--eval_", "--ckpt_", "--device"))]
    train(TrainConfig.from_dict(apply_overrides(TrainConfig.load(run / "config.yaml").to_dict(),
                                                [*small, "--optim.warmup_steps=1", *steps])),
          resume=True, quiet=True)
