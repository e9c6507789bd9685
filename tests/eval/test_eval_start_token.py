"""A folder whose tokenizer puts its own BOS before every text (Llama's, Mistral's): prompts and scored texts
start from that BOS, as transformers' tokenizer and lm-eval's HF backend start them, not from the
end-of-text token our own tokenizers start from. Oracles: stock ``LlamaForCausalLM`` driven by a greedy
loop of full forwards on ``AutoTokenizer``'s ids, and lm-eval's ``HFLM`` with its defaults on the same
folder. Before the start token, every one of these started from ``<|end_of_text|>`` and differed."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch

pytest.importorskip("transformers", reason="the hf extra (transformers) is not installed")
from bos_helpers import BOS, EOS, bos_folder, bos_tokenizer  # tests/eval/: a Llama-3-style folder
from eval_helpers import corpus_text
from train_helpers import cli_in_process  # tests/

from hybridnorm.data.tokenizer import BPETokenizer, ByteTokenizer, train_bpe
from hybridnorm.data.tokens import open_tokens, tokenize_to_memmap
from hybridnorm.loading import load_run

PROMPT = "The lord said unto"


@pytest.fixture(scope="module")
def folder(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return bos_folder(tmp_path_factory.mktemp("bos") / "llama3_style")


@pytest.mark.parametrize(("template", "start"), [
    (f"{BOS} $A", BOS),            # Llama 3, Llama 2 / Mistral (<s>): the BOS
    (f"$A {EOS}", EOS),            # a token after the text only: none before, the end-of-text token
    (f"{BOS} <x> $A", EOS),        # two before: not one start token
    (None, EOS),                   # no post-processor (ours, GPT-2's, Qwen's)
])
def test_the_start_token_is_the_one_token_the_post_processor_puts_before_a_text(template, start) -> None:
    hf = bos_tokenizer(template)
    tok = BPETokenizer(hf)
    assert tok.eot_id == hf.token_to_id(EOS)
    assert tok.start_id == hf.token_to_id(start)
    assert tok.encode("a b") == hf.encode("a b", add_special_tokens=False).ids  # encoding itself adds nothing


def test_our_tokenizers_start_from_their_end_of_text_token() -> None:
    from hybridnorm.hf.export import hf_tokenizer

    bpe = train_bpe(corpus_text(200).splitlines(), vocab_size=300)
    assert ByteTokenizer().start_id == ByteTokenizer().eot_id == 256
    assert bpe.start_id == bpe.eot_id
    exported = BPETokenizer(hf_tokenizer(bpe).backend_tokenizer)  # prepends <|endoftext|>: the same start
    assert exported.start_id == exported.eot_id == bpe.eot_id


def test_generate_gives_a_greedy_loop_of_the_stock_model_on_transformers_tokens(folder: Path) -> None:
    import transformers

    tok = transformers.AutoTokenizer.from_pretrained(folder)
    model = transformers.LlamaForCausalLM.from_pretrained(folder).eval()
    ids = tok(PROMPT).input_ids
    assert ids[0] == tok.bos_token_id != tok.eos_token_id
    with torch.no_grad():
        for _ in range(12):
            ids.append(int(model(torch.tensor([ids])).logits[0, -1].argmax()))
    want = tok.decode(ids[1:])  # as `hybridnorm generate` prints: everything after the start token
    done = cli_in_process("generate", str(folder), "--prompt", PROMPT, "--temperature", "0", "--max-new-tokens", "12")
    assert done.stdout.rstrip("\n") == want


def test_multiple_choice_and_document_scores_equal_lm_eval_hflm(folder: Path) -> None:
    """Multiple choice (``loglikelihood``) requests scored by HFLM with its defaults (``add_bos_token`` None:
    the tokenizer's own, so each context starts with the BOS) and by our adapter on the folder's model; whole
    documents (``loglikelihood_rolling``, perplexity) by HFLM with ``add_bos_token=False`` and ours. With its
    defaults HFLM's rolling requests (lm-eval 0.4.13, measured) start from its prefix token *and* the BOS its
    tokenizer adds, ``[BOS, BOS, doc...]``, and score log p(BOS | BOS) as part of the document; with
    ``add_bos_token=False`` it conditions the document on one BOS, as ours does (docs/evaluation.md)."""
    lm_eval = pytest.importorskip("lm_eval", reason="the eval extra (lm_eval) is not installed")
    pytest.importorskip("accelerate", reason="lm-eval's HFLM needs accelerate (in the dev extra)")
    from lm_eval.api.instance import Instance
    from lm_eval.models.huggingface import HFLM

    from hybridnorm.eval.lm_eval_adapter import run_lm_eval, task_manager
    from hybridnorm.eval.scoring import loglikelihood_rolling_text

    hflm = HFLM(pretrained=str(folder), batch_size=4, device="cpu")
    theirs = lm_eval.simple_evaluate(model=hflm, tasks=["kjv_mc"], limit=6, log_samples=True,
                                     task_manager=task_manager(["kjv_mc"]))
    ours = run_lm_eval(folder, ["kjv_mc"], limit=6, log_samples=True)
    a, b = ([[r[0] for r in s["filtered_resps"]] for s in res["samples"]["kjv_mc"]] for res in (ours, theirs))
    assert len(a) == len(b) == 6
    for x, y in zip(a, b, strict=True):
        assert x == pytest.approx(y, rel=1e-5, abs=1e-4)

    docs = corpus_text(5, seed=1).splitlines()
    one_bos = HFLM(pretrained=str(folder), batch_size=4, device="cpu", add_bos_token=False)
    their_rolling = one_bos.loglikelihood_rolling([Instance("loglikelihood_rolling", {}, (d,), i)
                                                for i, d in enumerate(docs)])
    run = load_run(folder)
    with torch.no_grad():
        our_rolling = loglikelihood_rolling_text(run.model, run.tokenizer, docs)
    assert our_rolling == pytest.approx(their_rolling, rel=1e-5, abs=1e-4)
    run.tokenizer.start_id = run.tokenizer.eot_id  # control: started from the end-of-text token instead
    with torch.no_grad():
        assert loglikelihood_rolling_text(run.model, run.tokenizer, docs)[0] != pytest.approx(their_rolling[0],
                                                                                              abs=1e-2)


def test_an_imported_folder_exports_with_its_own_bos(folder: Path, tmp_path: Path) -> None:
    import transformers

    from hybridnorm.hf.export import export_run, import_hf

    export_run(import_hf(folder, tmp_path / "run"), tmp_path / "again")
    src = transformers.AutoTokenizer.from_pretrained(folder)
    out = transformers.AutoTokenizer.from_pretrained(tmp_path / "again")
    cfg = transformers.AutoConfig.from_pretrained(tmp_path / "again")
    assert out(PROMPT).input_ids == src(PROMPT).input_ids  # the BOS first, as before
    assert (out.bos_token, out.eos_token) == (BOS, EOS)
    assert (cfg.bos_token_id, cfg.eos_token_id) == (src.bos_token_id, src.eos_token_id)


def test_training_documents_begin_with_the_bos_where_the_tokenizer_has_one(tmp_path: Path) -> None:
    tok = BPETokenizer(bos_tokenizer())
    docs = corpus_text(20, seed=2).splitlines()
    meta = tokenize_to_memmap(docs, tok, tmp_path / "t.bin", chunk_docs=7)
    arr = open_tokens(tmp_path / "t.bin", vocab_size=tok.vocab_size, tokenizer_fingerprint=tok.fingerprint)
    want = [i for d in docs for i in (tok.start_id, *tok.encode(d), tok.eot_id)]
    assert np.asarray(arr).tolist() == want and meta["count"] == len(want)


def test_an_exported_runs_documents_score_as_lm_eval_scores_them_with_one_bos(tmp_path: Path) -> None:
    """Our own tokenizer exported (it prepends ``<|endoftext|>``): the same rule as for a Llama's BOS. Documents
    of up to ~5 windows (48 tokens), so the rolling windows are compared too; no padding rows in the
    embedding (HFLM's softmax would include them, ours leaves them out: docs/evaluation.md)."""
    from eval_helpers import tiny_model

    pytest.importorskip("lm_eval", reason="the eval extra (lm_eval) is not installed")
    pytest.importorskip("accelerate", reason="lm-eval's HFLM needs accelerate (in the dev extra)")
    from lm_eval.api.instance import Instance
    from lm_eval.models.huggingface import HFLM

    from hybridnorm.eval.scoring import loglikelihood_rolling_text
    from hybridnorm.hf.export import export_model

    model = tiny_model(train_steps=20, pad_vocab_multiple=1)
    export_model(model, tmp_path / "hf", ByteTokenizer())
    docs = [corpus_text(k, seed=3).replace("\n", " ") for k in (1, 2, 5)]
    hflm = HFLM(pretrained=str(tmp_path / "hf"), batch_size=4, device="cpu", add_bos_token=False)
    theirs = hflm.loglikelihood_rolling([Instance("loglikelihood_rolling", {}, (d,), i) for i, d in enumerate(docs)])
    with torch.no_grad():
        ours = loglikelihood_rolling_text(model, ByteTokenizer(), docs)
    assert ours == pytest.approx(theirs, rel=1e-5, abs=1e-4)


def test_the_trainers_data_from_such_a_tokenizer_starts_each_document_with_its_bos(tmp_path: Path) -> None:
    """What ``train`` reads for an imported run (``data.tokenizer`` = the run's tokenizer.json): a prepared
    cache of its own, not one written before documents began with the BOS."""
    import json

    from hybridnorm.data.prepare import prepare_data

    tok = BPETokenizer(bos_tokenizer())
    tok_file = tok.save(tmp_path)
    docs = corpus_text(60, seed=4).splitlines()
    corpus = tmp_path / "docs.jsonl"
    corpus.write_text("".join(json.dumps({"text": d}) + "\n" for d in docs), encoding="utf-8")
    data = prepare_data(str(corpus), tokenizer=str(tok_file), cache_dir=tmp_path / "cache")
    assert data.dir.name.endswith("-bos")
    stream = np.asarray(data.train_tokens()).tolist() + np.asarray(data.val_tokens()).tolist()
    assert stream[0] == tok.start_id != tok.eot_id
    assert stream.count(tok.start_id) == stream.count(tok.eot_id) == len(docs)
    ends = [i for i, t in enumerate(stream) if t == tok.eot_id]
    assert all(stream[i + 1] == tok.start_id for i in ends[:-1])  # every document: BOS ... EOT


def test_a_post_processor_naming_an_id_outside_the_vocabulary_is_one_error_naming_the_file(
        folder: Path, tmp_path: Path, capsys) -> None:
    """A template's special token carries its own id; one that is no token of the vocabulary would index
    past the embedding (found: an IndexError traceback from ``generate``)."""
    import json
    import shutil

    from hybridnorm.cli import main

    bad = tmp_path / "bad"
    shutil.copytree(folder, bad)
    tok = json.loads((bad / "tokenizer.json").read_text())
    template = next(p for p in tok["post_processor"]["processors"] if p["type"] == "TemplateProcessing")
    template["special_tokens"][BOS]["ids"] = [99_999]
    (bad / "tokenizer.json").write_text(json.dumps(tok))
    assert main(["generate", str(bad), "--prompt", PROMPT, "--max-new-tokens", "2"]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("error:") and len(err.splitlines()) == 1
    assert str(bad / "tokenizer.json") in err and "id 99999" in err
