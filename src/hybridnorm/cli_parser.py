"""The ``hybridnorm`` argument parser: every command's options and help, nothing that runs (``cli.py``)."""

from __future__ import annotations

import argparse
from collections.abc import Callable, Mapping

from hybridnorm.errors import OneLineArgumentParser

DEFAULT_PROMPT = "In the beginning"  # hybridnorm generate without --prompt


def build_parser(commands: Mapping[str, Callable[[argparse.Namespace, list[str]], int]]) -> argparse.ArgumentParser:
    """The parser of every command; ``commands`` maps a command name to the function that runs it."""
    ap = OneLineArgumentParser(prog="hybridnorm", description="Normalization placements for decoder-only LMs.")
    ap.add_argument("--debug", action="store_true", help="show tracebacks")
    # --debug is accepted after the command too (`hybridnorm train --debug`); SUPPRESS keeps the
    # subcommand from resetting a --debug given before it.
    common = argparse.ArgumentParser(add_help=False)
    common.add_argument("--debug", action="store_true", default=argparse.SUPPRESS, help="show tracebacks")
    sub = ap.add_subparsers(dest="command", required=True)

    t = sub.add_parser("train", parents=[common],
                       help="train a model (default: small HybridNorm* on the embedded KJV corpus)",
                       description="Extra --key=value options override any config field, e.g. --optim.lr=1e-3 "
                                   "--model.n_layers=8 --precision=fp32.")
    t.add_argument("config", nargs="?", help="YAML train config (optional)")
    t.add_argument("--size", help="model size preset (tiny, small, 151m, 550m, ...)")
    t.add_argument("--placement", help="placement preset or grammar name (see `hybridnorm placements`), or a spec "
                                       "of your own as a YAML mapping ('{name: mine, block: {qkv_norm: QK}}')")
    t.add_argument("--max-steps", type=int)
    t.add_argument("--out", help="run folder (default runs/default)")
    t.add_argument("--resume", action="store_true", help="continue from the newest good checkpoint in --out")
    t.set_defaults(func=commands["train"])

    for name, help_text in (("compare", "train several placements side by side and write a report folder"),
                           ("sweep", "train placements over a grid of knobs and report where each one stops training")):
        c = sub.add_parser(name, parents=[common], help=help_text,
                           description=f"{help_text}. Extra --key=value options override any config field. "
                                       "Re-running the same command skips finished runs and continues "
                                       "interrupted ones.")
        c.add_argument("config", nargs="?", help="YAML train config (optional)")
        c.add_argument("--placements", required=True, help="comma-separated presets or grammar names")
        c.add_argument("--size", help="model size preset (tiny, small, 151m, ...)")
        c.add_argument("--max-steps", type=int)
        c.add_argument("--out", help="report folder")
        c.add_argument("--seeds", default="0", help="comma-separated seeds (default 0)")
        c.add_argument("--init", help="comma-separated init axis: paper (each placement's paper default: "
                                      "confounds init with placement), normal, megatron, depth_scaled, deepnorm. "
                                      "Default: one init for all, megatron (or --model.init if given)")
        c.add_argument("--axis", action="append", metavar="KEY=V1,V2",
                       help="a grid axis over any config field (lr, depth, warmup, steps, clip aliases, or dotted "
                            "names like optim.lr); repeat for a grid over several knobs")
        if name == "sweep":
            c.add_argument("--knob", help="one axis (same as --axis KNOB=VALUES)")
            c.add_argument("--values", help="comma-separated values of --knob")
        c.add_argument("--warmup-frac", type=float, help="warmup steps as a fraction of max_steps at every point")
        c.add_argument("--baseline", help="placement the others are compared with (default: the first)")
        c.add_argument("--jobs", type=int, default=1, help="runs trained side by side, cores split between them")
        c.add_argument("--report-only", action="store_true",
                       help="train nothing: rewrite the report from the runs finished so far")
        c.set_defaults(func=commands[name])

    g = sub.add_parser("generate", parents=[common], help="sample text from a run folder or checkpoint")
    g.add_argument("checkpoint")
    g.add_argument("--prompt", action="append",
                   help=f"the text to continue (default {DEFAULT_PROMPT!r}); given several times, the prompts are "
                        "generated as one left-padded batch, as transformers' generate takes one, and the texts "
                        "printed in order, a blank line between (greedy: each as it is alone)")
    g.add_argument("--prompt-file", metavar="FILE",
                   help="prompts from a file instead (-: standard input): one per line, or a .jsonl file's "
                        "string field 'prompt' per line (a prompt with newlines); blank lines skipped")
    g.add_argument("--batch-size", type=int, default=16,
                   help="prompts generated together, one left-padded batch, in order (default 16; a sampled "
                        "text depends on it, greedy does not)")
    g.add_argument("--output", metavar="FILE.jsonl",
                   help="write one JSON record per prompt, in order, instead of printing the texts: prompt, "
                        "completion, finish_reason (stop | length), prompt_tokens, completion_tokens")
    g.add_argument("--max-new-tokens", type=int, default=100)
    # sampling: None = not given, so a folder's generation_config.json can set it (nn.sampling_defaults)
    g.add_argument("--temperature", type=float, help="0: greedy (default 0.8, or the folder's generation_config.json)")
    g.add_argument("--top-k", type=int, help="0: sample from the whole vocabulary (default 50, or the folder's)")
    g.add_argument("--top-p", type=float,
                   help="nucleus sampling: the fewest most likely tokens whose probability reaches P (1: off; the "
                        "default, or the folder's)")
    g.add_argument("--min-p", type=float,
                   help="drop tokens less likely than MIN_P x the most likely one (0: off; the default, or the "
                        "folder's)")
    g.add_argument("--repetition-penalty", type=float,
                   help="a token already in the prompt or the reply: its logit divided by this when positive, "
                        "multiplied when negative (1: off, the default, or the folder's; greedy too). All as "
                        "transformers' generate, and a folder's generation_config.json sets the defaults as there")
    g.add_argument("--seed", type=int, default=0)
    g.add_argument("--device", help="cpu, cuda, cuda:N (default: cuda when a GPU is visible, else the CPU; the "
                                    "same --seed draws other tokens on a GPU, from its own generator)")
    g.add_argument("--ignore-eos", action="store_true",
                   help="go on past the end-of-text token (default: stop after it, as transformers' generate)")
    g.add_argument("--chat", nargs="?", const="default", metavar="NAME",
                   help="--prompt is a user turn, formatted by the run's chat template (an imported instruct "
                        "folder's; NAME: a named one) with transformers' apply_chat_template; prints the reply")
    g.add_argument("--system", metavar="TEXT", help="with --chat: a system turn before the prompt")
    g.add_argument("--chat-template-args", metavar="JSON", help="with --chat: template variables, e.g. "
                                                                "'{\"enable_thinking\": false}'")
    g.set_defaults(func=commands["generate"])

    e = sub.add_parser("eval", parents=[common], help="evaluate a checkpoint: validation loss (default), "
                       "multiple choice, document perplexity, lm-eval tasks",
                       description="Without --mc/--text/--tasks: the validation loss and perplexity of the run's "
                                   "corpus (or --data). With them: those evaluations, printed as one table.")
    e.add_argument("checkpoint")
    e.add_argument("--data", help="corpus (default: the run's own validation split)")
    e.add_argument("--batches", type=int, help="validation loss: score N batches of --batch-size (default: the "
                   "windows the run's training validated on, eval_batches x global_batch, so the loss is its log's)")
    e.add_argument("--batch-size", metavar="N|auto|auto:N", help="default: the run's batch_size for the validation "
                   "loss, 8 for --mc/--text/--tasks; auto (those three): the largest that fits in memory, from "
                   "--max-batch-size down, as lm-eval's; auto:N finds it N times as the scored windows get shorter")
    e.add_argument("--max-batch-size", type=int, help="where --batch-size auto starts (default 64)")
    e.add_argument("--seq-len", type=int)
    e.add_argument("--mc", metavar="FILE.jsonl",
                   help="zero-shot multiple choice on HellaSwag-style JSONL (context, endings, label): acc, acc_norm")
    e.add_argument("--text", metavar="FILE",
                   help="perplexity, bits per byte and word perplexity of a .txt/.jsonl file, a folder, or 'kjv'")
    e.add_argument("--text-field", metavar="NAME",
                   help="the text's field in a .jsonl record / column of a .parquet file, for --text and --data "
                        "(default: text; for --data, the run's data.text_field)")
    e.add_argument("--tasks", help="comma-separated lm-eval tasks (the shipped kjv_mc is always found); "
                                   "needs pip install 'hybridnorm[eval]'")
    e.add_argument("--include-path", metavar="DIR", help="folder of extra lm-eval task YAML files")
    e.add_argument("--limit", metavar="N|FRACTION", help="the first N documents of each task / questions of --mc, "
                   "or a fraction of them between 0 and 1 (0.5: the first half, rounded up), as lm_eval --limit")
    e.add_argument("--num-fewshot", type=int, help="lm-eval few-shot examples (default: the task's, or 0)")
    e.add_argument("--apply-chat-template", nargs="?", const="default", metavar="NAME",
                   help="lm-eval prompts as chat turns, formatted by the run's chat template (an imported instruct "
                        "folder's; NAME: a named one) with transformers' apply_chat_template")
    e.add_argument("--fewshot-as-multiturn", action="store_true",
                   help="lm-eval few-shot examples as alternating user/assistant turns (needs --apply-chat-template)")
    e.add_argument("--system-instruction", metavar="TEXT", help="lm-eval system message before each prompt")
    e.add_argument("--chat-template-args", metavar="JSON", help="template variables, e.g. '{\"enable_thinking\": "
                                                                "false}' (with --apply-chat-template)")
    e.add_argument("--seed", type=int, help="lm-eval's seeds (Python, NumPy, torch: sampled generation; few-shot "
                                            "picks) all set to SEED, as lm_eval --seed SEED (default: lm-eval's "
                                            "0,1234,1234,1234)")
    e.add_argument("--gen-kwargs", metavar="K=V,...", help="lm-eval generation settings for every generation task, "
                   "over each task's own, as lm_eval --gen_kwargs (e.g. do_sample=true,temperature=0.7)")
    e.add_argument("--device", help="cpu, cuda, cuda:N (default: cuda when a GPU is visible, else the CPU)")
    e.add_argument("--dtype", default="auto", help="auto (default: the weights as the run stores them), float32, "
                   "bfloat16 or float16: the model cast to it for every evaluation, as lm-eval's HF backend's dtype "
                   "(norm statistics and scored log-probabilities stay float32)")
    e.add_argument("--output", metavar="FILE.json", help="also write all results (per item for --mc) as JSON")
    e.add_argument("--log-samples", action="store_true", help="with --tasks and --output: every document's prompt, "
                   "responses and metrics, one JSONL file per task beside FILE.json, as lm_eval --log_samples")
    e.set_defaults(func=commands["eval"])

    x = sub.add_parser("export", parents=[common], help="export a run or checkpoint as a Hugging Face model folder",
                       description="Placements that a stock transformers class computes exactly (pre -> Llama, "
                                   "qk_norm -> Qwen3, olmo2 -> OLMo-2, MoE -> Mixtral/Qwen3-MoE/OLMoE/FlexOlmo) "
                                   "export to it; every other one exports with hybridnorm's own class.")
    x.add_argument("checkpoint", help="run folder or checkpoints/step_* folder")
    x.add_argument("--to", nargs=2, metavar=("FORMAT", "DIR"), required=True, help="hf DIR")
    x.add_argument("--arch", default="auto", help="auto (default), hybridnorm (own class), or a stock "
                                                   "model_type: llama, qwen3, olmo2, mixtral, qwen3_moe, ...")
    x.add_argument("--dtype", default="float32", help="float32 (default), bfloat16 or float16")
    x.set_defaults(func=commands["export"])

    i = sub.add_parser("import", parents=[common], help="turn a local Hugging Face model folder into a run folder")
    i.add_argument("hf_dir", help="folder with config.json, weights and tokenizer.json (Llama, Qwen3, OLMo-2, "
                                  "Mixtral, Qwen3-MoE, OLMoE, FlexOlmo or hybridnorm's own)")
    i.add_argument("--out", required=True, help="new run folder")
    i.add_argument("--allow-pickle", action="store_true",
                   help="read pickle weights (pytorch_model.bin, *.pt) with torch.load(weights_only=True) when "
                        "the folder has no safetensors; refused by default: unpickling can run code")
    i.set_defaults(func=commands["import"])

    sub.add_parser("gradprofile", add_help=False,  # its options: python -m hybridnorm.experiments.gradprofile
                   help="per-block gradient norms at step 1 at the paper's sizes (Figure 2); --help for options")
    p = sub.add_parser("placements", parents=[common], help="list placement presets with their equations")
    p.add_argument("--all", action="store_true", help="also the paper's grammar names")
    p.set_defaults(func=commands["placements"])

    m = sub.add_parser("plan", parents=[common], help="memory per GPU (DDP, FSDP), largest micro-batch, grad_accum")
    m.add_argument("--size", default="1.2b", help="model size preset")
    m.add_argument("--gpus", type=int, default=8)
    m.add_argument("--gpu-mem", type=float, default=80.0, help="GiB per GPU")
    m.add_argument("--seq-len", type=int, default=4096)
    m.add_argument("--micro-batch", type=int, help="sequences per GPU (default: the largest that fits under FSDP)")
    m.add_argument("--global-batch-tokens", type=int, default=4 * 2**20, help="target tokens per step")
    m.add_argument("--precision", default="bf16", help="bf16 (autocast) or fp32")
    m.add_argument("--placement", default="hybridnorm_star",
                   help="placement preset or grammar name, or a spec of your own as a YAML mapping, as train takes it")
    m.add_argument("--loss", default="compiled",
                   help="LM head + loss: compiled (the trainer's on a GPU under --compile=true), fast (the fused "
                        "kernel, uncompiled) or plain (fast_kernels=false)")
    m.set_defaults(func=commands["plan"])
    # the options each config-taking command owns: any other --key is a config override
    ap.own_options = {name: set(sub.choices[name]._option_string_actions) for name in ("train", "compare", "sweep")}
    return ap
