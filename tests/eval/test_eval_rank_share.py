"""``hybridnorm eval``'s own evaluations over torchrun's ranks: ``--mc``, ``--text`` and the validation loss,
each rank scoring a strided share (``hybridnorm.train.rank_share``). Oracles: the same command in one process
(the real ``torchrun``, 2 gloo processes), and in a real 2-rank group the one-process function in the same
process, with which share each rank scored counted."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
import torch
from eval_helpers import corpus_text, write_jsonl
from train_helpers import TORCHRUN, cli_in_process, run_bounded, spawn_ranks

# 5 questions over 2 ranks (3 and 2), 2 to 4 endings each: rows of different lengths, uneven shares
MC = [{"context": c, "endings": e, "label": lab} for c, e, lab in (
    ("The lord said unto", ["moses", "the river", "a hill"], 0),
    ("Go forth into a land of", ["milk and honey", "night"], 0),
    ("Behold the river ran", ["dry", "up the hill", "people", "law"], 0),
    ("By day and by", ["night", "river"], 0),
    ("The city was built upon a", ["hill", "law", "moses"], 0))]


def _docs(tmp_path: Path) -> Path:
    lines = corpus_text(40, seed=3).splitlines()  # 7 documents, some longer than the 48-token window
    return write_jsonl(tmp_path / "docs.jsonl", [{"text": " ".join(lines[i::7])} for i in range(7)])


def _torchrun_eval(tmp_path: Path, *args: str) -> str:
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    proc = run_bounded([*TORCHRUN, "--nproc_per_node", "2", "-m", "hybridnorm.cli", "eval", *args], 300, env=env,
                       cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return proc.stdout


def test_two_ranks_score_mc_and_text_as_one_process(run_dir: Path, tmp_path: Path) -> None:
    mc = write_jsonl(tmp_path / "mc.jsonl", MC)
    args = [str(run_dir), "--mc", str(mc), "--text", str(_docs(tmp_path)), "--batch-size", "2"]
    one, two = tmp_path / "one.json", tmp_path / "two.json"
    cli_in_process("eval", *args, "--output", str(one))
    out = _torchrun_eval(tmp_path, *args, "--output", str(two))
    assert out.count("results: ") == 1 and out.count("mc:mc.jsonl") == 2  # rank 0 alone prints: acc, acc_norm
    a, b = (json.loads(p.read_text()) for p in (one, two))
    assert [i["index"] for i in b["mc"]["items"]] == list(range(5))
    for x, y in zip(a["mc"]["items"], b["mc"]["items"], strict=True):
        assert len(y["loglikelihoods"]) == len(x["loglikelihoods"])
        assert y["loglikelihoods"] == pytest.approx(x["loglikelihoods"], rel=1e-6)
        assert (y["pred"], y["pred_norm"], y["label"]) == (x["pred"], x["pred_norm"], x["label"])
    assert (b["mc"]["acc"], b["mc"]["acc_norm"]) == (a["mc"]["acc"], a["mc"]["acc_norm"])
    for k in ("n_docs", "n_tokens", "n_bytes", "n_words"):
        assert b["text"][k] == a["text"][k], k
    assert b["text"]["loglikelihood"] == pytest.approx(a["text"]["loglikelihood"], rel=1e-6)
    assert a["text"]["n_tokens"] > 3 * 48  # documents over several windows, so the rolling scorer is exercised


@pytest.mark.parametrize("batches", [None, "3"])
def test_two_ranks_give_the_one_process_validation_loss(run_dir: Path, tmp_path: Path, batches: str | None) -> None:
    """As the README writes it (the windows training validated on), and over 3 batches (2 and 1 per rank)."""
    args = [str(run_dir), *(["--batches", batches] if batches else [])]
    one, two = tmp_path / "one.json", tmp_path / "two.json"
    cli_in_process("eval", *args, "--output", str(one))
    out = _torchrun_eval(tmp_path, *args, "--output", str(two))
    assert out.count("val loss") == 1, out
    a, b = (json.loads(p.read_text())["val"] for p in (one, two))
    assert b["tokens"] == a["tokens"] and b["loss"] == pytest.approx(a["loss"], rel=1e-6)
    assert (b["unigram_entropy"], b["bigram_entropy"]) == (a["unigram_entropy"], a["bigram_entropy"])


def _share_worker(rank: int, world: int, port: int, run: str, mc: str, docs: str, out: str) -> None:
    from train_helpers import rank_env

    rank_env(rank, world, port)
    from hybridnorm.eval import evaluate_mc, perplexity_of_run
    from hybridnorm.loading import evaluate_run, load_run
    from hybridnorm.train.distributed import Dist, init_distributed, leave
    from hybridnorm.train.rank_share import gather_rows, scored_on_ranks

    d = init_distributed(torch.device("cpu"), 60)
    loaded = load_run(run)
    rows = []  # (batch rows, longest row) of every forward
    loaded.model.register_forward_pre_hook(lambda _m, a: rows.append(tuple(a[0].shape)))
    got: dict = {}
    for name, alone, shared in (
            ("mc", lambda: evaluate_mc(loaded.model, loaded.tokenizer, mc, batch_size=2).to_dict(True),
             lambda: evaluate_mc(loaded.model, loaded.tokenizer, mc, batch_size=2, ranks=d).to_dict(True)),
            ("text", lambda: perplexity_of_run(loaded, docs, batch_size=2).to_dict(),
             lambda: perplexity_of_run(loaded, docs, batch_size=2, ranks=d).to_dict()),
            ("val", lambda: evaluate_run(loaded, batch_size=2, max_batches=3),
             lambda: evaluate_run(loaded, batch_size=2, max_batches=3, ranks=d))):
        rows.clear()
        got[name] = {"alone": alone(), "alone_rows": sum(r[0] for r in rows)}
        rows.clear()
        got[name] |= {"shared": shared(), "shared_rows": sum(r[0] for r in rows)}
    seen: list = []
    got["share"] = scored_on_ranks(lambda items: seen.extend(items) or [(float(i),) * (i % 3) for i in items],
                                   list(range(5)), d)
    got["seen"] = seen
    got["one_item"] = gather_rows([(7.0, 8.0)] if rank == 0 else [], 1, d)  # rank 1 has no item
    got["no_items"] = gather_rows([], 0, d)
    got["single"] = gather_rows([(1.0,), (2.0,)], 2, Dist())
    leave()
    Path(out, f"{rank}.json").write_text(json.dumps(got))


def test_each_rank_scores_its_share_and_gets_every_result(run_dir: Path, tmp_path: Path) -> None:
    mc = write_jsonl(tmp_path / "mc.jsonl", MC)
    spawn_ranks(_share_worker, 2, (str(run_dir), str(mc), str(_docs(tmp_path)), str(tmp_path)), 180,
                "two ranks sharing the scoring")
    r0, r1 = (json.loads((tmp_path / f"{r}.json").read_text()) for r in (0, 1))
    for name in ("mc", "text", "val"):
        assert r0[name]["shared"] == r1[name]["shared"], name  # every rank gets every result
        # a validation batch is the same batch shared or not: the same loss bit for bit; a question's or a
        # document's batch holds other rows when shared (another padded length), so its last bits may move
        assert r0[name]["alone"] == r1[name]["alone"]
        assert _close(r0[name]["shared"], r0[name]["alone"], 0.0 if name == "val" else 1e-6), name
        total = r0[name]["alone_rows"]  # each rank ran part of the rows
        assert r0[name]["shared_rows"] < total and r1[name]["shared_rows"] < total, name
    assert r0["val"]["shared_rows"] + r1["val"]["shared_rows"] == r0["val"]["alone_rows"] == 6  # batches 0, 2 | 1
    assert (r0["val"]["shared_rows"], r1["val"]["shared_rows"]) == (4, 2)
    assert r0["seen"] == [0, 2, 4] and r1["seen"] == [1, 3]
    want = [[float(i)] * (i % 3) for i in range(5)]
    assert r0["share"] == r1["share"] == want
    assert r0["one_item"] == r1["one_item"] == [[7.0, 8.0]]
    assert r0["no_items"] == r1["no_items"] == []
    assert r0["single"] == [[1.0], [2.0]]


def _close(a: object, b: object, rel: float) -> bool:
    """``a`` and ``b`` equal, numbers within ``rel`` (nested lists and dicts)."""
    if isinstance(a, dict) and isinstance(b, dict):
        return a.keys() == b.keys() and all(_close(a[k], b[k], rel) for k in a)
    if isinstance(a, list) and isinstance(b, list):
        return len(a) == len(b) and all(_close(x, y, rel) for x, y in zip(a, b, strict=True))
    if isinstance(a, float) and isinstance(b, float):
        return a == b if rel == 0.0 else a == pytest.approx(b, rel=rel, nan_ok=True)
    return a == b


def test_rows_that_are_not_the_ranks_share_are_refused() -> None:
    from hybridnorm.train.distributed import Dist
    from hybridnorm.train.rank_share import gather_rows, share

    assert list(share(5, Dist(1, 2))) == [1, 3] and list(share(1, Dist(1, 2))) == []
    with pytest.raises(ValueError, match="rank 0 of 1 has 1 rows for 2 items"):
        gather_rows([(1.0,)], 2, Dist())
