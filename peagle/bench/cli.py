"""`peagle bench`: output tokens/s against concurrency for no speculation, EAGLE-3 and P-EAGLE at several K (and
with the adaptive speculation policy), plus transformers' own generate() on the same model and prompts, in one run
and one table (docs/design.md, "Benchmark definitions").

Modes:
  default    every configuration (method x K) gets its own `peagle serve` subprocess on a free 127.0.0.1 port, and
             the load generator talks to it over HTTP with streaming, as a real client would;
  --url U    one running server (peagle's or vLLM's): its configuration is read from /v1/models where it says;
  --offline  the engine in this process, no HTTP (the same clients, stepping the engine directly).
transformers methods always run in this process.

A progress bar counts requests (with the time left at the rate so far). Results go to --out: results.md (the
table), results.json, PNG plots, and the servers' logs. plan.py decides what runs, run.py runs it, report.py
writes it up.
"""
from __future__ import annotations

import argparse
import sys

from peagle import cli_args
from peagle.bench.plan import DEFAULT_METHODS, METHODS, BenchError
from peagle.bench.run import sweep


def register(name: str, parser: argparse.ArgumentParser) -> None:
    from peagle.bench.datasets import dataset_names

    parser.formatter_class = argparse.RawDescriptionHelpFormatter
    parser.description = __doc__
    g = parser.add_argument_group("workload")
    g.add_argument("--dataset", default="humaneval", help=f"prompt set: {dataset_names()} (default humaneval)")
    g.add_argument("--num-prompts", type=cli_args.positive_int, default=16, help="requests per run (default 16)")
    g.add_argument("--max-tokens", type=cli_args.positive_int, default=128,
                   help="output tokens per request at most (default 128)")
    g.add_argument("--ignore-eos", action="store_true", help="generate exactly --max-tokens per request")
    g.add_argument("--concurrency", default="1,4,8", help="comma-separated client counts (default 1,4,8)")
    g.add_argument("--temperature", type=cli_args.temperature, default=0.0,
                   help="sampling temperature (default 0: greedy)")
    g.add_argument("--seed", type=cli_args.seed, default=0, help="request i uses seed+i when sampling (default 0)")
    g.add_argument("--chat", action=argparse.BooleanOptionalAction, default=None,
                   help="send prompts through the chat template (default: when the model has one)")
    g = parser.add_argument_group("what to compare")
    g.add_argument("--methods", default=DEFAULT_METHODS,
                   help=f"comma-separated, from {', '.join(METHODS)} (default: {DEFAULT_METHODS}); ngram, suffix "
                        "and hybrid run at their config's defaults under the adaptive policy; default: what `peagle "
                        "serve` runs for the model without a config")
    g.add_argument("--k", default="3,7,11",
                   help="speculative tokens K for eagle3 and peagle (default 3,7,11); `adaptive` adds the adaptive "
                        "speculation policy, which picks K from 0 up to the largest K listed (7 if none) every step")
    g.add_argument("--model", help="target model folder or cached id (default: the embedded SmolLM2-135M-Instruct)")
    g.add_argument("--peagle-head", help="P-EAGLE head folder or bundled name (default: the bundled head)")
    g.add_argument("--eagle3-head", help="EAGLE-3 head folder or bundled name (default: the bundled head)")
    g.add_argument("--random-heads", action="store_true",
                   help="where a method has no head, create an UNTRAINED random one (measures the mechanics only: "
                        "its drafts are hardly ever accepted); the report says so")
    g.add_argument("--prompt-lookup-tokens", type=cli_args.positive_int, default=10,
                   help="transformers-pld: prompt_lookup_num_tokens (default 10)")
    g = parser.add_argument_group("how to run")
    mode = g.add_mutually_exclusive_group()
    mode.add_argument("--url", help="benchmark a running OpenAI-compatible server (one configuration)")
    mode.add_argument("--offline", action="store_true", help="drive the engine in this process, without HTTP")
    g.add_argument("--api-key", help="bearer key for --url")
    g.add_argument("--max-model-len", type=cli_args.positive_int,
                   help="context per request (default: longest prompt + max tokens)")
    g.add_argument("--dtype", default="auto", help="auto (bfloat16), bfloat16, float16 or float32")
    from peagle.model.quant import QUANTIZATION_HELP, QUANTIZATIONS

    g.add_argument("--quantization", choices=QUANTIZATIONS, default=None, help=QUANTIZATION_HELP)
    g.add_argument("--enable-prefix-caching", action=argparse.BooleanOptionalAction, default=True,
                   help="the engine's prefix cache (default: on, as in `peagle serve`); compare both on the "
                        "shared-system and sharegpt-multiturn sets")
    g.add_argument("--device", help="cpu or cuda (default: cuda when available)")
    g.add_argument("--threads", type=cli_args.threads,
                   help="CPU threads, here and in the servers (default: peagle's, the cores this process may use; "
                        "docs/engine.md, \"Threads\")")
    g.add_argument("--warmup", type=cli_args.nonnegative_int, default=1,
                   help="warm-up requests per configuration (default 1)")
    g.add_argument("--out", default="bench-out", help="output folder (default bench-out)")
    g.add_argument("--note", action="append", default=[], help="a note to print in the report (repeatable)")
    g.add_argument("--no-progress", action="store_true", help="no progress bar")
    parser.set_defaults(func=run)


def run(args) -> int:
    try:
        return sweep(args)
    except BenchError as e:
        print(f"peagle bench: error: {e}", file=sys.stderr, flush=True)
        return 2
