"""`peagle generate PROMPT`: one-shot generation streamed to the terminal, then one line of speed and acceptance."""
from __future__ import annotations

import argparse
import json
import os
import sys

from peagle import cli_args
from peagle.config import DEFAULT_SPECULATION_POLICY, SPECULATION_POLICIES, SPECULATION_POLICY_ENV

DEFAULT_PROMPT = "Write a Python function that checks whether a string is a palindrome, and explain it briefly."


def register(name: str, parser: argparse.ArgumentParser) -> None:
    parser.add_argument("prompt", nargs="?", default=DEFAULT_PROMPT, help="the prompt (default: a built-in one)")
    parser.add_argument("--model", default=None,
                        help="target model folder, .gguf file or cached hub id (default: the embedded SmolLM2)")
    parser.add_argument("--speculative-config", default=None,
                        help='vLLM-style JSON, e.g. \'{"model": HEAD, "method": "eagle3", "num_speculative_tokens": 7, '
                             '"parallel_drafting": true}\' (default: SM_VLLM_SPECULATIVE_CONFIG, else the hybrid with '
                             'the bundled head for the embedded weights in any format, suffix drafts for any other '
                             'model); "none" decodes without speculation')
    parser.add_argument("--no-speculation", action="store_true", help="plain decoding, no drafter")
    parser.add_argument("--speculation-policy", choices=SPECULATION_POLICIES,
                        default=os.environ.get(SPECULATION_POLICY_ENV, DEFAULT_SPECULATION_POLICY),
                        help=f"adaptive (default): K is picked every step from 0 up to num_speculative_tokens for the "
                             f"most tokens/s; fixed: always K, as vLLM does (default from {SPECULATION_POLICY_ENV})")
    parser.add_argument("--max-tokens", type=cli_args.positive_int, default=256)
    parser.add_argument("--max-model-len", type=cli_args.positive_int,
                        help="context length (prompt + output); default: the model's, at most 4096")
    parser.add_argument("--temperature", type=cli_args.temperature, default=0.0)
    parser.add_argument("--top-p", type=cli_args.top_p, default=1.0)
    parser.add_argument("--top-k", type=cli_args.top_k, default=-1)
    parser.add_argument("--seed", type=cli_args.seed, default=None)
    parser.add_argument("--chat", action=argparse.BooleanOptionalAction, default=None,
                        help="apply the chat template (default: on when the tokenizer has one)")
    parser.add_argument("--json", action="store_true", help="print one JSON object instead of streaming text")
    shape = parser.add_mutually_exclusive_group()
    shape.add_argument("--json-schema", metavar="FILE", default=None,
                       help="constrain the output to JSON matching the JSON schema in FILE (structured output)")
    shape.add_argument("--regex", default=None, help="constrain the output to match this regular expression")
    parser.add_argument("--device", default=None, help="cpu or cuda (default: cuda when available)")
    parser.add_argument("--dtype", default="auto", help="auto (bfloat16), bfloat16, float16 or float32")
    from peagle.model.quant import QUANTIZATION_HELP, QUANTIZATIONS

    parser.add_argument("--quantization", choices=QUANTIZATIONS, default=None, help=QUANTIZATION_HELP)
    from peagle.threads import add_threads_arg

    add_threads_arg(parser)
    parser.set_defaults(func=run)


def constraint_of(args: argparse.Namespace):
    """The output constraint of --json-schema FILE or --regex, if any (errors name the flag)."""
    from peagle.engine.grammar import Constraint

    if args.regex is not None:
        return Constraint.regex(args.regex, "--regex")
    if args.json_schema is None:
        return None
    try:
        text = open(args.json_schema, encoding="utf-8").read()
    except OSError as e:
        raise ValueError(f"--json-schema: cannot read {args.json_schema}: {e.strerror}") from None
    return Constraint.json_schema(text, "--json-schema")


def run(args: argparse.Namespace) -> int:
    from peagle.config import SpeculativeConfigError
    from peagle.engine import LLMEngine, RequestError, SamplingParams
    from peagle.engine.stats import by_proposer, describe_by_proposer
    from peagle.model.speculation import resolve_speculation
    from peagle.threads import apply_threads_arg

    apply_threads_arg(args)
    try:
        chosen = resolve_speculation(args.model, "none" if args.no_speculation else args.speculative_config,
                                     source="--no-speculation" if args.no_speculation else "--speculative-config",
                                     policy=args.speculation_policy)
        if chosen.note:
            print(f"peagle generate: note: {chosen.note}", file=sys.stderr)
        engine = LLMEngine.from_pretrained(chosen, max_num_seqs=1, max_model_len=args.max_model_len,
                                           device=args.device, dtype=args.dtype, quantization=args.quantization)
        params = SamplingParams(max_tokens=args.max_tokens, temperature=args.temperature, top_p=args.top_p,
                                top_k=args.top_k, seed=args.seed, constraint=constraint_of(args))
        chat = args.chat if args.chat is not None else bool(getattr(engine.tokenizer, "chat_template", None))
        final = None
        for out in engine.stream(args.prompt, params, chat=chat):
            if not args.json:
                print(out.delta_text, end="", flush=True)
            final = out
    except (SpeculativeConfigError, RequestError, OSError, ValueError) as e:
        print(f"peagle generate: error: {e}", file=sys.stderr)
        return 2
    result = {
        "text": final.text,
        "num_prompt_tokens": final.num_prompt_tokens,
        "num_output_tokens": final.num_output_tokens,
        "finish_reason": final.finish_reason,
        "time_to_first_token_s": round(final.time_to_first_token or 0.0, 4),
        "elapsed_s": round(final.elapsed, 4),
        "tokens_per_second": round(final.num_output_tokens / final.elapsed, 2) if final.elapsed else 0.0,
        "method": engine.method,
        "num_speculative_tokens": engine.k,
        "speculation_policy": engine.policy.name if engine.spec else None,
        "head": engine.spec.model if engine.spec else None,
        "speculation_origin": chosen.origin,
        "what_runs": chosen.describe(),
        **engine.kernels,
        **engine.step_threads.summary(),  # where the engine's thread count ended, if it chooses one
        **{k: v for k, v in final.spec_stats.as_dict().items()},
        "proposers": by_proposer(engine.proposer_stats),
    }
    if args.json:
        print(json.dumps(result))
    else:
        per_pos = " ".join(f"{x:.2f}" for x in final.spec_stats.acceptance_per_position)
        mean_k = f", mean K {result['mean_k']:.2f}" if result["speculation_policy"] == "adaptive" else ""
        print(f"\n\n[{result['what_runs']}{mean_k}] {result['num_output_tokens']} tokens in "
              f"{result['elapsed_s']:.2f} s: {result['tokens_per_second']:.1f} tok/s, TTFT "
              f"{result['time_to_first_token_s'] * 1000:.0f} ms, mean acceptance length "
              f"{result['mean_acceptance_length']:.2f}"
              + (f" over {result['mean_draft_tokens']:.1f} draft tokens a draft (a chain's K, a tree's nodes)"
                 if result.get("num_drafts") else "")
              + (f", per-position acceptance {per_pos}" if per_pos else "")
              + (f", {result['num_forced_tokens']} forced tokens" if result["num_forced_tokens"] else "")
              + (f"; {describe_by_proposer(engine.proposer_stats)}" if engine.proposer_stats else "")
              + f"; {result['weights']} weights"
              + (f" ({result['block_kernels']} integer kernels)" if result.get("block_kernels") else "")
              + f", {result['kernels']} kernels" + ("" if result["greedy_bit_exact"] else " (greedy not bit-exact)")
              + (f", {result['threads']} thread{'s' if result['threads'] != 1 else ''}" if "threads" in result else ""),
              file=sys.stderr)
    return 0
