"""Structured outputs against free text, per method and concurrency (docs/serving.md, "Structured outputs").

The structured-output workload (peagle/bench/structured.py: extraction prompts, each with its JSON schema) runs
through the engine in this process, greedy, twice per configuration: with each prompt's schema as the constraint,
then without any, each prompt given exactly as many output tokens as its constrained answer had (ignore_eos), so
both runs prefill the same prompts (prefix caching off) and emit the same number of tokens. For both it reports
output tokens per second (wall, and per CPU second of this process: the machine may be shared), the mean
acceptance length, and for the constrained run the forced tokens per answer, the grammar's cost per output token
(CPU time of this thread inside the matcher: masks, advancing, rolling back, proposing drafts) and how many answers
validate against their schema.

    python benchmarks/structured_outputs.py                      # none, eagle3, peagle (K=3), adaptive; c = 1, 4
    python benchmarks/structured_outputs.py --k 5 --concurrency 1 --max-tokens 64 --out /tmp/so
"""
from __future__ import annotations

import argparse
import functools
import json
import time
from pathlib import Path

METHODS = ("none", "eagle3", "peagle", "adaptive")


class GrammarClock:
    """CPU time of the calling thread inside GrammarMatcher's and GrammarWindow's public methods (llguidance
    computes masks in the calling thread), counting only the outermost call of a nest."""

    MATCHER = ("mask", "allowed", "forced_token", "mask_logits", "advance", "rollback", "commit", "masks_from")
    WINDOW = ("propose", "take", "forced_run", "masks", "settle")

    def __init__(self):
        from peagle.engine.grammar import GrammarMatcher, GrammarWindow

        self.seconds, self.depth = 0.0, 0
        for cls, names in ((GrammarMatcher, self.MATCHER), (GrammarWindow, self.WINDOW)):
            for name in names:
                setattr(cls, name, self._timed(getattr(cls, name)))

    def _timed(self, fn):
        @functools.wraps(fn)
        def wrapper(*args, **kwargs):
            self.depth += 1
            start = time.thread_time()
            try:
                return fn(*args, **kwargs)
            finally:
                self.depth -= 1
                if self.depth == 0:
                    self.seconds += time.thread_time() - start

        return wrapper


def make_engine(method: str, k: int, concurrency: int):
    """Prefix caching off: the second pass over the same prompts would otherwise skip the first one's prefill."""
    from peagle.engine import LLMEngine
    from peagle.model.heads import DEFAULT_HEADS

    if method == "none":
        return LLMEngine.from_pretrained(None, None, max_num_seqs=concurrency, max_model_len=512, device="cpu",
                                         enable_prefix_caching=False)
    head = "peagle" if method in ("peagle", "adaptive") else "eagle3"
    spec = {"model": DEFAULT_HEADS[head], "method": "eagle3", "num_speculative_tokens": k,
            "parallel_drafting": head == "peagle"}
    return LLMEngine.from_pretrained(None, spec, max_num_seqs=concurrency, max_model_len=512, device="cpu",
                                     speculation_policy="adaptive" if method == "adaptive" else "fixed",
                                     enable_prefix_caching=False)


def answers(engine, prompts, concurrency: int, params_for) -> tuple[dict[int, tuple[str, str, int]], float]:
    """Every prompt through the engine, `concurrency` at a time: (text, finish reason, output tokens) per prompt
    index, and the wall seconds."""
    pending, active, done = list(range(len(prompts))), {}, {}
    t0 = time.perf_counter()
    while pending or active:
        while pending and len(active) < concurrency:
            i = pending.pop(0)
            active[engine.add_request(prompts[i].chat_messages(), params_for(i), chat=True)] = i
        for out in engine.step():
            if out.finished:
                done[active.pop(out.request_id)] = (out.text, out.finish_reason, out.num_output_tokens)
    return done, time.perf_counter() - t0


def run(engine, prompts, concurrency: int, max_tokens: int | list[int], constrained: bool,
        clock: GrammarClock) -> dict:
    """One pass over the prompts; `max_tokens` per prompt when a list (then ignore_eos: exactly that many)."""
    import jsonschema

    from peagle.bench.structured import constraint_of
    from peagle.engine import SamplingParams

    def params_for(i: int) -> SamplingParams:
        exact = isinstance(max_tokens, list)
        params = SamplingParams(max_tokens=max_tokens[i] if exact else max_tokens, ignore_eos=exact)
        params.constraint = constraint_of(prompts[i].response_format) if constrained else None
        return params

    before, grammar_before, cpu = engine.stats.copy(), clock.seconds, time.process_time()
    texts, wall = answers(engine, prompts, concurrency, params_for)
    cpu = time.process_time() - cpu
    s = engine.stats
    drafts = s.num_drafts - before.num_drafts
    tokens = sum(n for _, _, n in texts.values())
    valid = 0
    for i, (text, _, _) in texts.items() if constrained else ():
        try:
            jsonschema.validate(json.loads(text), prompts[i].response_format["json_schema"]["schema"])
            valid += 1
        except (json.JSONDecodeError, jsonschema.ValidationError):
            pass
    return {"answers": len(texts), "output_tokens": tokens, "wall_s": round(wall, 3), "cpu_s": round(cpu, 3),
            "tokens_per_s": round(tokens / wall, 2), "tokens_per_cpu_s": round(tokens / cpu, 2),
            "mean_acceptance_length": round(1 + (s.num_accepted_tokens - before.num_accepted_tokens) / drafts, 3)
            if drafts else 1.0,
            "forced_per_answer": round((s.num_forced_tokens - before.num_forced_tokens) / len(texts), 2),
            "grammar_us_per_token": round((clock.seconds - grammar_before) * 1e6 / max(tokens, 1), 1),
            "valid_answers": valid if constrained else None,
            "finished_stop": sum(1 for _, r, _ in texts.values() if r == "stop"),
            "lengths": [texts[i][2] for i in range(len(prompts))]}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--methods", default=",".join(METHODS))
    ap.add_argument("--k", type=int, default=3, help="K for eagle3 and peagle; the most K for adaptive")
    ap.add_argument("--concurrency", default="1,4")
    ap.add_argument("--max-tokens", type=int, default=96)
    ap.add_argument("--num-prompts", type=int, default=None, help="the workload's first N prompts [all]")
    ap.add_argument("--out", default="bench-out/structured")
    args = ap.parse_args()
    import torch

    torch.set_num_threads(1)
    from peagle.bench.datasets import load_dataset

    prompts = load_dataset("structured", args.num_prompts)
    clock = GrammarClock()
    rows = []
    for c in [int(x) for x in args.concurrency.split(",")]:
        for method in args.methods.split(","):
            engine = make_engine(method, args.k, c)
            run(engine, prompts[:2], c, 16, True, clock)  # warm-up: compile the schemas, touch every path
            lengths: int | list[int] = args.max_tokens
            for constrained in (True, False):
                row = {"method": method, "k": 0 if method == "none" else args.k, "concurrency": c,
                       "constrained": constrained, **run(engine, prompts, c, lengths, constrained, clock)}
                lengths = row["lengths"]  # the free pass emits as many tokens per prompt
                rows.append(row)
                print(json.dumps(row), flush=True)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "structured_outputs.json").write_text(json.dumps(rows, indent=1))
    lines = ["| method | c | output | tok/s | tok/CPU-s | MAL | forced/answer | grammar us/token | valid |",
             "|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        lines.append(f"| {r['method']}{'' if r['method'] == 'none' else ' K=' + str(r['k'])} | {r['concurrency']} | "
                     f"{'schema' if r['constrained'] else 'free'} | {r['tokens_per_s']} | {r['tokens_per_cpu_s']} | "
                     f"{r['mean_acceptance_length']} | {r['forced_per_answer'] if r['constrained'] else '-'} | "
                     f"{r['grammar_us_per_token'] if r['constrained'] else '-'} | "
                     f"{str(r['valid_answers']) + '/' + str(r['answers']) if r['constrained'] else '-'} |")
    (out / "structured_outputs.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
