"""Acceptance of the heads, measured by the engine itself (docs/heads.md): greedy, the chat template, a fixed K
every step, continuously batched by LLMEngine with real speculative decoding; the engine's own counters give the
mean acceptance length (1 + accepted / verification steps, vLLM's definition) and the acceptance per position.
Speculation is lossless, so every configuration must produce the same tokens for a prompt set; the report checks
that too (a free large-scale losslessness test).

    python3 benchmarks/acceptance.py                     # MT-Bench 80 + HumanEval 164, K = 3,5,7, both heads
    python3 benchmarks/acceptance.py --num-prompts 8 --out /tmp/acc                 # a quick look
    python3 benchmarks/acceptance.py --peagle-head runs/peagle --methods peagle --out runs/acceptance   # a new head
    python3 benchmarks/acceptance.py --long-context      # behind histories of 512, 2K, 4K and 7K tokens, K = 7
    python3 benchmarks/acceptance.py --long-context --lengths 512 2048 --num-prompts 2 --out /tmp/lc

--long-context asks the same final questions behind a history of each --lengths tokens (of the rendered chat
template before the last question): do the heads still draft well when the conversation is long? Sources: chat
(SmolLM2's own answers to the bundled heads' 32 held-out ShareGPT conversations, turn after turn, then an MT-Bench
first turn) and code (the start of Python standard-library modules pasted by the user, then a HumanEval prompt).
The questions of one length share their history, so the prefix cache prefills it once.

Runs are spread over --jobs processes of --threads torch threads each (one per core works best on a shared
machine). Each run is kept in OUT/runs/ as it finishes and skipped when the script is run again (a sweep can be
stopped, resumed or split: `--methods peagle` now, `--methods eagle3` later; give a head other than the bundled one
its own --out); OUT/acceptance.json and .md (or long_context.json and .md) report every run present.
"""
from __future__ import annotations

import argparse
import hashlib
import inspect
import json
import sys
import time
from concurrent.futures import ProcessPoolExecutor, as_completed
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
# The mean acceptance lengths the bundled P-EAGLE head aims for at K=7, and at least EAGLE-3's (docs/heads.md).
TARGETS = {"humaneval": 2.0, "mtbench": 1.8}
DATASET_TITLES = {"mtbench": "MT-Bench first turns", "humaneval": "HumanEval"}
CODE_MODULES = ("argparse", "typing", "dataclasses", "pathlib")  # long, plain, stable standard-library sources
MAX_MODEL_LEN = 8192  # SmolLM2's context


def head_name(method: str) -> str:
    return "P-EAGLE" if method == "peagle" else "EAGLE-3"


def measured(engine, prompts: list, max_tokens: int) -> dict:
    """Generate every prompt; the outputs' digest and the engine's counters."""
    from peagle.engine.sampling import SamplingParams

    t0 = time.process_time()
    outs = engine.generate(prompts, SamplingParams(max_tokens=max_tokens), chat=True)
    tokens = [o.token_ids for o in outs]
    return {"max_tokens": max_tokens, "output_tokens": sum(map(len, tokens)),
            "cpu_seconds": round(time.process_time() - t0, 1),
            "outputs_sha256": hashlib.sha256(json.dumps(tokens).encode()).hexdigest()[:16],
            # each prompt's verify steps that carried drafts and the drafts they accepted, in the set's order: what
            # the re-bundling gate resamples (scripts/bundle_head.py)
            "per_prompt": [[o.spec_stats.num_drafts, o.spec_stats.num_accepted_tokens] for o in outs], **engine.stats.as_dict()}


def engine_for(method: str, k: int, head: str, max_num_seqs: int, max_model_len: int, threads: int):
    """A fixed-K engine: the adaptive default would choose K from this machine's timings, and a head's acceptance at
    K is what is measured here."""
    import torch

    from peagle.engine.engine import LLMEngine

    torch.set_num_threads(threads)
    spec = {"model": head, "method": "eagle3", "num_speculative_tokens": k}
    if method == "peagle":
        spec["parallel_drafting"] = True
    return LLMEngine.from_pretrained(None, spec, max_num_seqs=max_num_seqs, max_model_len=max_model_len,
                                     speculation_policy="fixed")


def run_one(method: str, k: int, dataset: str, head: str, num_prompts: int | None, max_tokens: int,
            max_num_seqs: int, threads: int) -> dict:
    """One head at one K on one benchmark set."""
    from peagle.bench.datasets import load_dataset
    from peagle.bench.plan import machine

    engine = engine_for(method, k, head, max_num_seqs, 2048, threads)
    prompts = load_dataset(dataset, num_prompts)
    return {"method": method, "k": k, "dataset": dataset, "head": head, "machine": machine()["summary"],
            "prompts": len(prompts), "max_num_seqs": max_num_seqs,
            **measured(engine, [p.chat_messages() for p in prompts], max_tokens)}


def report(results: list[dict]) -> str:
    """The benchmark sets' report: a table per set, its losslessness check and the targets."""
    from peagle.bench.plan import machine

    machines = sorted({r.get("machine") or machine()["summary"] for r in results})
    lines = [f"Measured by `python3 benchmarks/acceptance.py` on {' and '.join(machines)}; greedy, chat template, up "
             f"to {', '.join(sorted({str(r['max_tokens']) for r in results}))} new tokens per prompt.", ""]
    for ds in dict.fromkeys(r["dataset"] for r in results):
        rows = sorted((r for r in results if r["dataset"] == ds), key=lambda r: (r["method"] != "peagle", r["k"]))
        kmax = max(r["k"] for r in rows)
        lines += [f"### {DATASET_TITLES.get(ds, ds)} ({rows[0]['prompts']} prompts)", "",
                  "| method | K | mean acceptance length | " + " | ".join(f"pos {i + 1}" for i in range(kmax))
                  + " | steps | output tokens |", "|---|---:|---:|" + "---:|" * kmax + "---:|---:|"]
        for r in rows:
            acc = r["acceptance_per_position"] + [None] * (kmax - r["k"])
            lines.append(f"| {head_name(r['method'])} | {r['k']} | {r['mean_acceptance_length']:.2f} | "
                         + " | ".join("" if a is None else f"{a:.3f}" for a in acc)
                         + f" | {r['num_drafts']} | {r['output_tokens']} |")
        same = len({r["outputs_sha256"] for r in rows}) == 1
        lines += ["", f"Every configuration produced the same tokens: {'yes' if same else 'NO (a losslessness bug)'}."]
        by = {(r["method"], r["k"]): r["mean_acceptance_length"] for r in rows}
        if ("peagle", 7) in by and ds in TARGETS:
            p7 = by[("peagle", 7)]
            lines.append(f"Target: P-EAGLE at K=7 >= {TARGETS[ds]}: {p7:.2f}, "
                         f"{'met' if p7 >= TARGETS[ds] else 'missed'}.")
            if ("eagle3", 7) in by:
                ratio = p7 / by[("eagle3", 7)]
                lines.append(f"Target: P-EAGLE at K=7 at least EAGLE-3's at K=7: {ratio:.2f}x, "
                             f"{'met' if ratio >= 1.0 else 'missed'}.")
        lines.append("")
    return "\n".join(lines)


# ---- --long-context

def rendered_tokens(tokenizer, messages: list[dict]) -> int:
    if not messages:
        return 0
    text = tokenizer.apply_chat_template(messages, tokenize=False)
    return len(tokenizer(text, add_special_tokens=False)["input_ids"])


def chat_history(tokenizer, length: int) -> list[dict]:
    """The longest run of whole held-out turn pairs whose rendered template stays within `length` tokens."""
    sys.path.insert(0, str(ROOT / "scripts"))
    from head_data import BUNDLED_DATA, bundled_heldout_ids

    from peagle.train.data import iter_json_records

    heldout, turns = bundled_heldout_ids(str(ROOT / BUNDLED_DATA)), []
    for rec in iter_json_records(ROOT / BUNDLED_DATA):
        if rec["id"] in heldout:
            msgs = [{"role": m["role"], "content": m["content"]} for m in rec["messages"]
                    if m["role"] in ("user", "assistant")]
            turns += msgs[:len(msgs) // 2 * 2]  # whole user/assistant pairs
    history: list[dict] = []
    for i in range(0, len(turns), 2):
        if rendered_tokens(tokenizer, history + turns[i:i + 2]) > length:
            return history
        history = history + turns[i:i + 2]
    raise SystemExit(f"the held-out conversations hold only {rendered_tokens(tokenizer, history)} tokens of history; "
                     "ask for --lengths of at most that")


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
        lo, hi = (mid, hi) if rendered_tokens(tokenizer, history(mid)) <= length else (lo, mid - 1)
    if rendered_tokens(tokenizer, history(lo)) < length * 0.9:
        raise SystemExit(f"the modules {CODE_MODULES} hold fewer than {length} tokens")
    return history(lo)


def run_history(method: str, k: int, source: str, head: str, length: int, num_questions: int, max_tokens: int,
                threads: int) -> dict:
    """One head at one K behind a `length`-token history of `source` (chat or code)."""
    from peagle.bench.datasets import load_dataset
    from peagle.bench.plan import machine

    engine = engine_for(method, k, head, num_questions, MAX_MODEL_LEN, threads)
    history = (chat_history if source == "chat" else code_history)(engine.tokenizer, length)
    questions = load_dataset("mtbench" if source == "chat" else "humaneval", num_questions)
    return {"method": method, "head": head, "k": k, "source": source, "length": length,
            "history_tokens": rendered_tokens(engine.tokenizer, history), "questions": len(questions),
            "machine": machine()["summary"],
            **measured(engine, [history + p.chat_messages() for p in questions], max_tokens)}


def history_report(results: list[dict]) -> str:
    from peagle.bench.plan import machine

    first = results[0]
    lines = [f"Measured by `python3 benchmarks/acceptance.py --long-context` on "
             f"{first.get('machine') or machine()['summary']}; greedy, "
             f"K={first['k']}, {first['questions']} questions per length behind one shared history, up to "
             f"{first['max_tokens']} new tokens each.", "",
             "| history | tokens | head | mean acceptance length | vs the shortest history | acceptance at positions "
             "1, 2, 3 | same tokens as the other head |", "|---|---:|---|---:|---:|---|---|"]
    by = {(r["source"], r["length"], r["method"]): r for r in results}
    for r in sorted(results, key=lambda r: (r["source"], r["method"], r["length"])):
        shortest = min(x["length"] for x in results if (x["source"], x["method"]) == (r["source"], r["method"]))
        base = by[(r["source"], shortest, r["method"])]["mean_acceptance_length"]
        other = by.get((r["source"], r["length"], "eagle3" if r["method"] == "peagle" else "peagle"))
        same = "-" if other is None else ("yes" if other["outputs_sha256"] == r["outputs_sha256"] else "**NO**")
        per_pos = ", ".join(f"{a:.3f}" for a in r["acceptance_per_position"][:3])
        lines.append(f"| {r['source']} | {r['history_tokens']:,} | {r['method']} | {r['mean_acceptance_length']:.3f} "
                     f"| {r['mean_acceptance_length'] / base:.2f}x | {per_pos} | {same} |")
    return "\n".join(lines) + "\n"


# ---- the sweep

def planned(args, heads: dict) -> dict[str, tuple]:
    """Run file name -> (function, arguments) of every run the flags ask for."""
    methods, ks = args.methods.split(","), [int(k) for k in args.k.split(",")]
    if args.long_context:
        return {f"{src}-{n}-{m}-k{k}.json": (run_history, (m, k, src, heads[m], n, args.num_prompts or 3,
                                                           args.max_tokens, args.threads))
                for src in args.sources for n in args.lengths for m in methods for k in ks}
    return {f"{ds}-{m}-k{k}.json": (run_one, (m, k, ds, heads[m], args.num_prompts, args.max_tokens,
                                              args.max_num_seqs, args.threads))
            for ds in args.datasets.split(",") for m in methods for k in ks}


def parser() -> argparse.ArgumentParser:
    from peagle.model.heads import DEFAULT_HEADS

    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--datasets", default="mtbench,humaneval")
    ap.add_argument("--methods", default="peagle,eagle3")
    ap.add_argument("--k", default=None, help="comma-separated [3,5,7; --long-context: 7]")
    ap.add_argument("--peagle-head", default=DEFAULT_HEADS["peagle"], help="a bundled head's name or a head's folder")
    ap.add_argument("--eagle3-head", default=DEFAULT_HEADS["eagle3"])
    ap.add_argument("--num-prompts", type=int, default=None,
                    help="first N prompts of each set [all; --long-context: 3 questions per length]")
    ap.add_argument("--max-tokens", type=int, default=None, help="[256; --long-context: 64]")
    ap.add_argument("--max-num-seqs", type=int, default=32, help="requests the engine decodes at once")
    ap.add_argument("--jobs", type=int, default=2, help="runs in parallel, one process each")
    ap.add_argument("--threads", type=int, default=1, help="torch threads per process")
    ap.add_argument("--long-context", action="store_true", help="behind long histories instead of the sets")
    ap.add_argument("--lengths", type=int, nargs="+", default=[512, 2048, 4096, 7168],
                    help="--long-context: history lengths in tokens (with the question and answer within 8,192)")
    ap.add_argument("--sources", nargs="+", choices=("chat", "code"), default=["chat", "code"])
    ap.add_argument("--out", default=None, help="[docs/heads; --long-context: runs/long-context]")
    return ap


def main(argv: list[str] | None = None) -> None:
    ap = parser()
    args = ap.parse_args(argv)
    lc = args.long_context
    args.k = args.k or ("7" if lc else "3,5,7")
    args.max_tokens = args.max_tokens or (64 if lc else 256)
    if lc and max(args.lengths) + 512 + args.max_tokens > MAX_MODEL_LEN:
        ap.error(f"--lengths up to {MAX_MODEL_LEN - 512 - args.max_tokens} leave room for a question and its answer "
                 f"in SmolLM2's {MAX_MODEL_LEN}-token context")
    out = Path(args.out or ("runs/long-context" if lc else "docs/heads"))
    (out / "runs").mkdir(parents=True, exist_ok=True)
    runs = planned(args, {"peagle": args.peagle_head, "eagle3": args.eagle3_head})
    for name, (_, run_args) in runs.items():
        done = out / "runs" / name
        if done.exists() and json.loads(done.read_text()).get("head", run_args[3]) != run_args[3]:
            ap.error(f"{out / 'runs' / name} was measured with another head; give this head its own --out")
    todo = {name: run for name, run in runs.items() if not (out / "runs" / name).exists()}
    print(f"{len(runs) - len(todo)} of {len(runs)} runs already in {out / 'runs'}; running {len(todo)}", flush=True)
    t0 = time.perf_counter()
    with ProcessPoolExecutor(max_workers=args.jobs) as pool:
        futures = {pool.submit(fn, *fn_args): name for name, (fn, fn_args) in todo.items()}
        for n, fut in enumerate(as_completed(futures), 1):
            r = fut.result()
            (out / "runs" / futures[fut]).write_text(json.dumps(r, indent=1) + "\n")
            print(f"[{n}/{len(todo)} {time.perf_counter() - t0:.0f}s] {futures[fut]}: mean acceptance length "
                  f"{r['mean_acceptance_length']:.3f}, per position "
                  f"{[round(a, 2) for a in r['acceptance_per_position']]} ({r['output_tokens']} tokens, "
                  f"{r['cpu_seconds']} CPU s)", flush=True)
    results = [json.loads(f.read_text()) for f in sorted((out / "runs").glob("*.json"))]
    stem, text = ("long_context", history_report(results)) if lc else ("acceptance", report(results))
    (out / f"{stem}.json").write_text(json.dumps(results, indent=1) + "\n")
    (out / f"{stem}.md").write_text(text)
    print(text)


if __name__ == "__main__":
    main()
