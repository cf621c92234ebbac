"""Acceptance against the length of the history: do the heads still draft well when the conversation is long?

The heads were trained on conversations of at most 1,024 tokens; users send histories of thousands. For each
history length (tokens of the rendered chat template before the last question) the same final questions are asked
behind a history of that length, greedy, and the engine's own counters give the mean acceptance length per head:

    chat  SmolLM2's own answers to the bundled heads' 32 held-out ShareGPT conversations, turn after turn (the
          heads never trained on them), then an MT-Bench first turn
    code  the start of a Python standard-library module pasted by the user, then a HumanEval prompt

    python benchmarks/long_context_acceptance.py                          # 512, 2K, 4K, 7K; both heads, K=7
    python benchmarks/long_context_acceptance.py --lengths 512 2048 --num-questions 2 --out /tmp/lc
    python benchmarks/long_context_acceptance.py --methods peagle --peagle-head runs/campaign/rounds/R/peagle

A head other than the bundled one (a round's, a checkpoint folder) is named with --peagle-head / --eagle3-head;
keep each head's runs in their own --out.

The questions of one length share their history, so the prefix cache prefills it once. Both heads must produce the
same tokens for every prompt (speculation is lossless); the report checks it. Each run is kept in OUT/runs/ and
skipped when the script is run again; OUT/long_context.json and OUT/long_context.md report every run present.
"""
from __future__ import annotations

import argparse
import hashlib
import inspect
import json
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
HELDOUT_SOURCE = ROOT / "data" / "heads" / "smollm2-regenerated.jsonl.gz"
CODE_MODULES = ("argparse", "typing", "dataclasses", "pathlib")  # long, plain, stable standard-library sources
HEADS = {"peagle": "smollm2-135m-peagle", "eagle3": "smollm2-135m-eagle3"}
MAX_MODEL_LEN = 8192  # SmolLM2's context


def chat_history(tokenizer, length: int) -> list[dict]:
    """The longest run of whole held-out turn pairs whose rendered template stays within `length` tokens."""
    import importlib.util

    from peagle.train.data import iter_json_records

    spec = importlib.util.spec_from_file_location("split", ROOT / "scripts" / "split_head_data.py")
    split = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(split)
    heldout = split.bundled_heldout_ids(str(HELDOUT_SOURCE))
    turns: list[dict] = []
    for rec in iter_json_records(HELDOUT_SOURCE):
        if rec["id"] in heldout:
            msgs = [m for m in rec["messages"] if m["role"] in ("user", "assistant")]
            turns += msgs[:len(msgs) // 2 * 2]  # whole user/assistant pairs
    history: list[dict] = []
    for i in range(0, len(turns), 2):
        longer = history + [{"role": m["role"], "content": m["content"]} for m in turns[i:i + 2]]
        if _tokens(tokenizer, longer) > length:
            return history
        history = longer
    raise SystemExit(f"the held-out conversations hold only {_tokens(tokenizer, history)} tokens of history; "
                     f"ask for --lengths of at most that")


def code_history(tokenizer, length: int) -> list[dict]:
    """The longest start (in whole lines) of the standard-library modules that, pasted by the user and
    acknowledged, stays within `length` tokens."""
    import importlib

    lines = [ln for name in CODE_MODULES for ln in inspect.getsource(importlib.import_module(name)).splitlines()]

    def history(n: int) -> list[dict]:
        code = "\n".join(lines[:n])
        return [{"role": "user", "content": f"Here is a Python module I am reading:\n\n```python\n{code}\n```"},
                {"role": "assistant", "content": "I have read the module. What would you like me to do?"}]

    lo, hi = 0, len(lines)
    while lo < hi:  # the most lines that fit
        mid = (lo + hi + 1) // 2
        lo, hi = (mid, hi) if _tokens(tokenizer, history(mid)) <= length else (lo, mid - 1)
    if _tokens(tokenizer, history(lo)) < length * 0.9:
        raise SystemExit(f"the modules {CODE_MODULES} hold fewer than {length} tokens")
    return history(lo)


def _tokens(tokenizer, messages: list[dict]) -> int:
    if not messages:
        return 0
    text = tokenizer.apply_chat_template(messages, tokenize=False)
    return len(tokenizer(text, add_special_tokens=False)["input_ids"])


def prompts(source: str, length: int, num_questions: int, tokenizer) -> tuple[list[list[dict]], int]:
    from peagle.bench.datasets import load_dataset

    history = chat_history(tokenizer, length) if source == "chat" else code_history(tokenizer, length)
    questions = load_dataset("mtbench" if source == "chat" else "humaneval", num_questions)
    return [history + p.chat_messages() for p in questions], _tokens(tokenizer, history)


def run_one(method: str, head: str, k: int, source: str, length: int, num_questions: int, max_tokens: int) -> dict:
    from peagle.engine.engine import LLMEngine
    from peagle.engine.sampling import SamplingParams

    spec = {"model": head, "method": "eagle3", "num_speculative_tokens": k,
            "parallel_drafting": method == "peagle"}
    engine = LLMEngine.from_pretrained(None, spec, max_num_seqs=num_questions, max_model_len=MAX_MODEL_LEN,
                                       speculation_policy="fixed")
    batch, history_tokens = prompts(source, length, num_questions, engine.tokenizer)
    t0 = time.process_time()
    outs = engine.generate(batch, SamplingParams(max_tokens=max_tokens), chat=True)
    tokens = [o.token_ids for o in outs]
    return {"method": method, "head": head, "k": k, "source": source, "length": length, "history_tokens": history_tokens,
            "questions": len(batch), "max_tokens": max_tokens, "output_tokens": sum(map(len, tokens)),
            "cpu_seconds": round(time.process_time() - t0, 1),
            "outputs_sha256": hashlib.sha256(json.dumps(tokens).encode()).hexdigest()[:16], **engine.stats.as_dict()}


def report(results: list[dict]) -> str:
    from peagle.bench.plan import machine

    lines = [f"Measured by `python benchmarks/long_context_acceptance.py` on {machine()['summary']}; greedy, "
             f"K={results[0]['k']}, {results[0]['questions']} questions per length behind one shared history, up "
             f"to {results[0]['max_tokens']} new tokens each.", "",
             "| history | tokens | head | mean acceptance length | vs the shortest history | acceptance at positions "
             "1, 2, 3 | same tokens as the other head |", "|---|---:|---|---:|---:|---|---|"]
    by = {(r["source"], r["length"], r["method"]): r for r in results}
    for r in sorted(results, key=lambda r: (r["source"], r["method"], r["length"])):
        shortest = min(x["length"] for x in results if (x["source"], x["method"]) == (r["source"], r["method"]))
        base = by[(r["source"], shortest, r["method"])]["mean_acceptance_length"]
        other = by.get((r["source"], r["length"], "eagle3" if r["method"] == "peagle" else "peagle"))
        same = "-" if other is None else ("yes" if other["outputs_sha256"] == r["outputs_sha256"] else "**NO**")
        per_pos = ", ".join(f"{a:.3f}" for a in r["acceptance_per_position"][:3])
        lines.append(f"| {r['source']} | {r['history_tokens']:,} | {r['method']} | {r['mean_acceptance_length']:.3f} | "
                     f"{r['mean_acceptance_length'] / base:.2f}x | {per_pos} | {same} |")
    return "\n".join(lines) + "\n"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--lengths", type=int, nargs="+", default=[512, 2048, 4096, 7168],
                    help="history lengths in tokens (with the question and answer within 8,192)")
    ap.add_argument("--sources", nargs="+", choices=("chat", "code"), default=["chat", "code"])
    ap.add_argument("--methods", nargs="+", choices=tuple(HEADS), default=list(HEADS))
    ap.add_argument("--peagle-head", default=HEADS["peagle"], help="a bundled head's name or a head's folder")
    ap.add_argument("--eagle3-head", default=HEADS["eagle3"])
    ap.add_argument("--k", type=int, default=7)
    ap.add_argument("--num-questions", type=int, default=3)
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--out", default="runs/long-context")
    args = ap.parse_args()
    if max(args.lengths) + 512 + args.max_tokens > MAX_MODEL_LEN:
        ap.error(f"--lengths up to {MAX_MODEL_LEN - 512 - args.max_tokens} leave room for a question and its answer "
                 f"in SmolLM2's {MAX_MODEL_LEN}-token context")
    import torch

    torch.set_num_threads(args.threads)
    out = Path(args.out)
    (out / "runs").mkdir(parents=True, exist_ok=True)
    todo = [(s, n, m) for s in args.sources for n in args.lengths for m in args.methods]
    for i, (source, length, method) in enumerate(todo, 1):
        path = out / "runs" / f"{source}-{length}-{method}-k{args.k}.json"
        head = getattr(args, f"{method}_head")
        if path.exists() and json.loads(path.read_text()).get("head", HEADS[method]) != head:
            ap.error(f"{path} was measured with another {method} head; give this head its own --out")
        if not path.exists():
            r = run_one(method, head, args.k, source, length, args.num_questions, args.max_tokens)
            path.write_text(json.dumps(r, indent=1))
            print(f"[{i}/{len(todo)}] {source} {r['history_tokens']} tokens {method}: mean acceptance length "
                  f"{r['mean_acceptance_length']:.3f} ({r['cpu_seconds']} CPU s)", flush=True)
    results = [json.loads(p.read_text()) for p in sorted((out / "runs").glob("*.json"))]
    (out / "long_context.json").write_text(json.dumps(results, indent=1))
    (out / "long_context.md").write_text(report(results))
    print(report(results))


if __name__ == "__main__":
    main()
