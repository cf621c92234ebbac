"""Prefix caching and chunked prefill on the embedded model, measured in one process, side by side:

  1. multi-turn: a conversation's second turn resends the first turn's prompt and answer; its time to first token
     with the prefix cache against without it, at --history tokens of history, with P-EAGLE and without speculation
     (and the hit rate of each: speculation must not lose hits);
  2. shared system prompt: requests that share a --system-tokens-long system prompt, hit rate and TTFT;
  3. head-of-line blocking: the longest gap between two tokens of a running stream while a --long-prompt-token
     prompt is admitted beside it and decodes its first LONG_ANSWER_TOKENS tokens, with chunked prefill (--max-num-batched-tokens per step, each step's work sized
     to the engine's step time budget, --max-step-time-ms) and without, and the long prompt's time to first token
     beside the stream against the same prompt alone.

Every pair of runs produces the same tokens (checked). Times are CPU seconds of the engine's thread where one
thread runs (a shared machine's wall clock measures the scheduler), stated as such.

    OMP_NUM_THREADS=1 python benchmarks/prefix_cache.py --out docs/prefix_cache.json
"""
from __future__ import annotations

import argparse
import json
import random
import time

import torch

from peagle.engine import LLMEngine, SamplingParams
from peagle.engine.engine import DEFAULT_MAX_NUM_BATCHED_TOKENS
from peagle.model.heads import embedded_speculative_config

WORDS = ("the a model token cache prefix stream prompt answer context system request block chunk engine head draft "
         "verify accept python function value list string number table file line word").split()


def text(n_words: int, seed: int) -> str:
    rng = random.Random(seed)
    return " ".join(rng.choice(WORDS) for _ in range(n_words))


def clock():
    return time.thread_time if torch.get_num_threads() == 1 else time.perf_counter


def ttft(engine: LLMEngine, prompt: list[int], params: SamplingParams) -> tuple[float, list[int], int]:
    """Seconds to the first token of one request run alone, its tokens, and its cached prompt tokens."""
    tick = clock()
    t0 = tick()
    rid = engine.add_request(prompt, params)
    first, out = None, None
    while engine.has_work():
        for o in engine.step():
            if o.request_id == rid:
                if first is None and o.token_ids:
                    first = tick() - t0
                out = o
    return first, out.token_ids, out.num_cached_tokens


def make_engine(spec: bool, caching: bool, chunked: bool = True, budget: int = DEFAULT_MAX_NUM_BATCHED_TOKENS,
                max_num_seqs: int = 2, step_ms: float | None = None) -> LLMEngine:
    # the step time option only when given: the script also measures engines from before it existed
    timing = {"max_step_time_ms": step_ms} if step_ms is not None else {}
    return LLMEngine.from_pretrained(None, embedded_speculative_config() if spec else None, max_num_seqs=max_num_seqs,
                                     max_model_len=8192, device="cpu", enable_prefix_caching=caching,
                                     enable_chunked_prefill=chunked, max_num_batched_tokens=budget, **timing)


def multi_turn(history: int, answer_tokens: int) -> list[dict]:
    rows = []
    for spec in (False, True):
        engines = {caching: make_engine(spec, caching) for caching in (False, True)}
        tok = engines[False].tokenizer
        first_user = text(int(history * 0.85), seed=1)
        params = SamplingParams(max_tokens=answer_tokens, ignore_eos=True)
        result = {}
        for caching, eng in engines.items():
            messages = [{"role": "user", "content": first_user}]
            p1 = eng.encode_prompt(messages)
            _, answer, _ = ttft(eng, p1, params)
            messages += [{"role": "assistant", "content": tok.decode(answer, skip_special_tokens=True)},
                         {"role": "user", "content": "And what comes next? " + text(20, seed=2)}]
            p2 = eng.encode_prompt(messages)
            seconds, out, cached = ttft(eng, p2, SamplingParams(max_tokens=8))
            result[caching] = (seconds, out, cached, len(p2), eng.prefix_cache)
        assert result[True][1] == result[False][1], "the cache changed the second turn's tokens"
        pc = result[True][4]
        rows.append({"workload": "multi-turn", "speculation": "peagle" if spec else "none",
                     "history_tokens": result[True][3], "ttft_no_cache_s": round(result[False][0], 3),
                     "ttft_cache_s": round(result[True][0], 3),
                     "ttft_ratio": round(result[True][0] / result[False][0], 3),
                     "cached_tokens": result[True][2], "hit_rate": round(pc.hits / pc.queries, 3)})
        print(rows[-1], flush=True)
    return rows


def shared_system(system_tokens: int, n: int) -> list[dict]:
    rows = []
    system = text(int(system_tokens * 0.75), seed=3)
    for spec in (False, True):
        outs, times = {}, {}
        for caching in (False, True):
            eng = make_engine(spec, caching)
            got = [ttft(eng, eng.encode_prompt([{"role": "system", "content": system},
                                                {"role": "user", "content": text(12, seed=10 + i)}]),
                        SamplingParams(max_tokens=8)) for i in range(n)]
            outs[caching], times[caching] = [g[1] for g in got], [g[0] for g in got]
            if caching:
                pc = eng.prefix_cache
        assert outs[True] == outs[False], "the cache changed an answer"
        rows.append({"workload": "shared-system-prompt", "speculation": "peagle" if spec else "none",
                     "requests": n, "ttft_no_cache_mean_s": round(sum(times[False]) / n, 3),
                     "ttft_cache_mean_s": round(sum(times[True]) / n, 3),
                     "ttft_cache_after_first_mean_s": round(sum(times[True][1:]) / (n - 1), 3),
                     "hit_rate": round(pc.hits / pc.queries, 3)})
        print(rows[-1], flush=True)
    return rows


# Tokens the long prompt's request decodes while the stream's gaps are measured: its first decode steps start what
# its drafters need (suffix trees, the head's catch-up), work that must not land on one step either.
LONG_ANSWER_TOKENS = 16


def head_of_line(long_prompt: int, budget: int, step_ms: float | None, one_pass: bool) -> list[dict]:
    """Gaps between a stream's tokens while a long prompt is admitted and starts decoding, in the engine thread's
    CPU seconds: what its client waits on a core of its own (a shared machine's wall clock adds whatever else ran);
    then the same prompt alone on the same engine."""
    rows, tokens = [], {}
    for chunked in (False, True) if one_pass else (True,):
        eng = make_engine(True, False, chunked=chunked, budget=budget if chunked else 1 << 20, step_ms=step_ms)
        stream = eng.add_request(eng.encode_prompt("Count from one to one hundred."),
                                 SamplingParams(max_tokens=4096, ignore_eos=True))
        eng.step()
        long = eng.encode_prompt(text(long_prompt, seed=4), chat=False)[:long_prompt]
        lid = eng.add_request(long, SamplingParams(max_tokens=LONG_ANSWER_TOKENS, ignore_eos=True))
        tick = clock()
        last, gaps, long_first, long_done = tick(), [], None, False
        t0 = last
        while not long_done:
            for o in eng.step():
                now = tick()
                if o.request_id == stream and o.delta_token_ids:
                    gaps.append(now - last)
                    last = now
                if o.request_id == lid:
                    if o.token_ids and long_first is None:
                        long_first = now - t0
                    long_done = o.finished
        eng.abort(stream)
        while eng.has_work():
            eng.step()
        alone, tokens[chunked], _ = ttft(eng, long, SamplingParams(max_tokens=8))
        budget_s = getattr(getattr(eng, "step_budget", None), "target_s", None)
        rows.append({"workload": "long-prompt-admitted", "chunked_prefill": chunked,
                     "max_num_batched_tokens": budget if chunked else None, "long_prompt_tokens": len(long),
                     "step_time_target_s": round(budget_s, 4) if chunked and budget_s else None,
                     "max_gap_s": round(max(gaps), 3), "stream_tokens_meanwhile": len(gaps),
                     "long_ttft_s": round(long_first, 3), "long_alone_ttft_s": round(alone, 3),
                     "ttft_ratio": round(long_first / alone, 3)})
        print(rows[-1], flush=True)
    assert len(set(map(tuple, tokens.values()))) == 1, "chunking changed the long prompt's answer"
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--history", type=int, default=2048, help="tokens of history at the second turn")
    ap.add_argument("--answer-tokens", type=int, default=128)
    ap.add_argument("--system-tokens", type=int, default=1500)
    ap.add_argument("--requests", type=int, default=4)
    ap.add_argument("--long-prompt", type=int, default=4096)
    ap.add_argument("--max-num-batched-tokens", type=int, default=DEFAULT_MAX_NUM_BATCHED_TOKENS)
    ap.add_argument("--max-step-time-ms", type=float, help="the engine's step time target (default: its own)")
    ap.add_argument("--no-one-pass", dest="one_pass", action="store_false",
                    help="head-of-line: skip the one-pass prefill run")
    ap.add_argument("--only", choices=("multi-turn", "shared", "head-of-line"))
    ap.add_argument("--out", help="write the rows as JSON here")
    args = ap.parse_args()
    rows = []
    if args.only in (None, "multi-turn"):
        rows += multi_turn(args.history, args.answer_tokens)
    if args.only in (None, "shared"):
        rows += shared_system(args.system_tokens, args.requests)
    if args.only in (None, "head-of-line"):
        rows += head_of_line(args.long_prompt, args.max_num_batched_tokens, args.max_step_time_ms, args.one_pass)
    if args.out:
        meta = {"command": "OMP_NUM_THREADS=%s python benchmarks/prefix_cache.py" % torch.get_num_threads(),
                "threads": torch.get_num_threads(), "clock": "thread CPU time" if torch.get_num_threads() == 1
                else "wall", "args": vars(args)}
        with open(args.out, "w") as f:
            json.dump({"meta": meta, "rows": rows}, f, indent=1)


if __name__ == "__main__":
    main()
