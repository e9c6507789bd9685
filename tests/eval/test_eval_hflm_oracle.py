"""An independent oracle for the whole evaluation path: lm-eval's own Hugging Face backend (``HFLM``) on
the stock ``LlamaForCausalLM`` that ``hybridnorm export`` writes must give every multiple-choice request
the same log-likelihood as our adapter on our model — different model code, tokenizer code and scoring
code, same numbers."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

lm_eval = pytest.importorskip("lm_eval", reason="the eval extra (lm_eval) is not installed")
pytest.importorskip("transformers", reason="the hf extra (transformers) is not installed")
pytest.importorskip("accelerate", reason="lm-eval's HFLM needs accelerate (in the dev extra)")

from hybridnorm import ModelConfig, TransformerLM  # noqa: E402
from hybridnorm.data.tokenizer import ByteTokenizer  # noqa: E402
from hybridnorm.eval.lm_eval_adapter import run_lm_eval, task_manager  # noqa: E402
from hybridnorm.hf.export import export_model, import_hf  # noqa: E402


def _logliks(results: dict) -> list[list[float]]:
    return [[resp[0] for resp in s["filtered_resps"]] for s in results["samples"]["kjv_mc"]]


def test_hflm_on_the_exported_llama_scores_every_request_like_our_adapter(tmp_path: Path) -> None:
    from lm_eval.models.huggingface import HFLM

    torch.manual_seed(0)
    mc = ModelConfig(vocab_size=257, d_model=64, n_layers=2, n_heads=4, ffn_hidden_size=96, max_seq_len=256,
                     placement="pre")
    assert export_model(TransformerLM(mc), tmp_path / "hf", ByteTokenizer()).class_name == "LlamaForCausalLM"
    import_hf(tmp_path / "hf", tmp_path / "run")

    ours = run_lm_eval(tmp_path / "run", ["kjv_mc"], limit=8, log_samples=True)
    # add_bos_token: HFLM then prefixes the tokenizer's bos (<|endoftext|>), as our adapter always does
    hflm = HFLM(pretrained=str(tmp_path / "hf"), batch_size=4, add_bos_token=True, device="cpu")
    theirs = lm_eval.simple_evaluate(model=hflm, tasks=["kjv_mc"], limit=8, log_samples=True,
                                     task_manager=task_manager(["kjv_mc"]))
    a, b = _logliks(ours), _logliks(theirs)
    assert len(a) == len(b) == 8 and all(len(x) == 4 for x in a)
    for x, y in zip(a, b, strict=True):
        assert x == pytest.approx(y, rel=1e-6, abs=1e-4)  # sums of ~40-70 token log-probs in fp32
    for metric in ("acc,none", "acc_norm,none"):
        assert ours["results"]["kjv_mc"][metric] == theirs["results"]["kjv_mc"][metric]


def test_a_reply_longer_than_half_the_window_sees_the_context_hflm_sees(tmp_path: Path) -> None:
    """A window of 32 tokens, replies of 20: HFLM keeps the context's last 12 tokens. Before 2026-12-02 ours
    kept 16 (half the window) and the replies differed."""
    from eval_helpers import task_folder
    from lm_eval.models.huggingface import HFLM

    torch.manual_seed(0)
    mc = ModelConfig(vocab_size=257, d_model=64, n_layers=2, n_heads=4, ffn_hidden_size=96, max_seq_len=32,
                     placement="pre")
    export_model(TransformerLM(mc), tmp_path / "hf", ByteTokenizer())
    import_hf(tmp_path / "hf", tmp_path / "run")
    docs = [{"q": q} for q in ("in the beginning god created the heaven", "and the earth was without form, void",
                               "and darkness was upon the face of the deep")]
    tasks = task_folder(tmp_path, {"long_ctx": (docs, "output_type: generate_until\ndoc_to_text: '{{q}}'\n"
                                                      "doc_to_target: 'x'\ngeneration_kwargs:\n  until: ['QQQ']\n"
                                                      "  max_gen_toks: 20\n  do_sample: false\n"
                                                      "metric_list:\n  - metric: exact_match\n")})
    ours = run_lm_eval(tmp_path / "run", ["long_ctx"], include_path=tasks, include_defaults=False,
                       log_samples=True, batch_size=1)
    hflm = HFLM(pretrained=str(tmp_path / "hf"), batch_size=1, add_bos_token=True, device="cpu")
    theirs = lm_eval.simple_evaluate(model=hflm, tasks=["long_ctx"], log_samples=True,
                                     task_manager=task_manager(["long_ctx"], tasks))
    replies = [[s["filtered_resps"][0] for s in sorted(r["samples"]["long_ctx"], key=lambda s: s["doc_id"])]
               for r in (ours, theirs)]
    assert replies[0] == replies[1] and all(replies[0]), replies  # (random weights: the replies are noise)
