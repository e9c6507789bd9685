"""The issue's acceptance case on the real corpus: at 6 layers, d=64, lr 1e-2 with 10 warmup steps and 100
steps, HybridNorm stops learning near the unigram loss (its upper blocks' tokens collapse to one vector)
while Pre-Norm trains. The old rule (final loss < 0.95 × first logged loss) called both "trained"."""

import json

from hybridnorm import cli


def test_sweep_marks_hybridnorm_not_trained_and_pre_trained(tmp_path, no_peak_measure, capsys):
    out = tmp_path / "sweep"
    rc = cli.main(["sweep", "--placements", "pre,hybridnorm", "--knob", "lr", "--values", "1e-2", "--max-steps", "100",
                   "--out", str(out), f"--data.cache_dir={tmp_path / 'cache'}", "--precision=fp32",
                   "--model.n_layers=6", "--model.d_model=64", "--model.n_heads=4", "--model.n_kv_heads=2",
                   "--model.ffn_hidden_size=344", "--model.max_seq_len=128", "--seq_len=128", "--batch_size=8",
                   "--optim.warmup_steps=10", "--eval_interval=50", "--eval_batches=8", "--ckpt_interval=1000"])
    assert rc == 0, capsys.readouterr().err
    runs = {r["placement"]: r for r in json.loads((out / "runs.json").read_text())["runs"]}
    assert runs["pre"]["verdict"] == "trained"
    assert runs["hybridnorm"]["verdict"] in ("stalled", "collapsed")
    for r in runs.values():
        assert r["init"] == "megatron" and r["knobs"] == {"optim.lr": 0.01} and r["seed"] == 0
        assert r["tokens_seen"] == 100 * 8 * 128
    # what the old rule looked at: HybridNorm's train loss did fall by more than 5% from its first log
    hyb = json.loads((out / "runs" / "hybridnorm-init=megatron-optim.lr=0.01-seed0" / "point.json").read_text())
    assert hyb["point"]["placement"] == "hybridnorm"
    text = (out / "summary.md").read_text()
    assert "| `pre init=megatron` | 0.01 |" in text and "| `hybridnorm init=megatron` | none |" in text
