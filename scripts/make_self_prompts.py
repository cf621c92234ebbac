"""Chat prompts the target writes itself, for when ShareGPT runs out: the target's chat template up to the start of
a user turn, sampled until the turn ends, gives a question in the style its instruction tuning saw (the approach of
Magpie, Xu et al. 2024; SmolLM2 was tuned on such data). `peagle data prepare --regenerate` then answers each
greedily, as with every other prompt file, so the heads learn the target's answers to an unlimited supply of
general chat questions: the kind MT-Bench asks and the code sources do not.

    python3 scripts/make_self_prompts.py --num 5000 --first-id 30000 --exclude data/heads/prompts-4.jsonl.gz \
        --out data/heads/prompts-self.jsonl.gz

Each attempt samples with its own seed (temperature 1, top-p 0.95, up to 192 tokens). A question is kept when the
target ended the turn itself, it is 20-1,500 ASCII characters, no earlier kept question or --exclude file's user turn
has the same words, and it holds no HumanEval or MT-Bench prompt. Kept questions are appended as they come with the
attempt that made them; rerunning the command resumes after the last attempt (a kill loses at most a batch). A
`.gz` --out is written gzip-compressed, each run appending a gzip member (flushed after every batch).
"""
from __future__ import annotations

import argparse
import json
import re
import sys
from pathlib import Path

from tqdm import tqdm

from peagle.train.data import PLACEHOLDER_ANSWER, iter_json_records, open_text


def normalized(text: str) -> str:
    """The question's words, lower-cased: two questions differing only in case, spacing or punctuation are one."""
    return " ".join(re.findall(r"[a-z0-9]+", text.lower()))


def user_turn_prefix(tokenizer) -> str:
    """The rendered chat template up to where a user's words begin (with the template's default system prompt)."""
    marker = "\x00QUESTION\x00"
    text = tokenizer.apply_chat_template([{"role": "user", "content": marker}], tokenize=False)
    return text[:text.index(marker)]


def keep(question: str, finished: bool, seen: set[str], guard) -> bool:
    q = question.strip()
    if not finished or not 20 <= len(q) <= 1500 or not q.isascii():
        return False
    key = normalized(q)
    if not key or key in seen or guard.check([{"role": "user", "content": q}]):
        return False
    seen.add(key)
    return True


def read_kept(out: Path) -> str:
    """The whole lines of the questions kept so far in `out`, rewritten without what a kill cut off (part of a line,
    or, in a .gz, the end of the last gzip member, whose text up to the last flush still reads back)."""
    if not out.exists():
        return ""
    parts: list[str] = []
    cut = False
    try:
        with open_text(out) as f:
            for line in f:
                parts.append(line)
    except EOFError:  # a .gz whose last member a kill cut off
        cut = True
    text = "".join(parts)
    if text and not text.endswith("\n"):  # killed mid-line: that question is asked again
        text, cut = text[:text.rfind("\n") + 1], True
    if cut:
        with open_text(out, "w") as f:
            f.write(text)
    return text


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--num", type=int, required=True, help="questions to keep")
    ap.add_argument("--first-id", type=int, required=True, help="number the prompts self-N from here")
    ap.add_argument("--seed", type=int, default=0, help="attempt i samples with seed SEED * 10**9 + i")
    ap.add_argument("--exclude", action="append", default=[],
                    help="a JSONL (or .jsonl.gz) of prompts whose user turns count as seen")
    ap.add_argument("--batch", type=int, default=16, help="questions sampled at once")
    ap.add_argument("--out", required=True)
    args = ap.parse_args()

    out = Path(args.out)
    text = read_kept(out)
    kept = [json.loads(line) for line in text.splitlines() if line.strip()]
    if len(kept) >= args.num:
        print(f"make_self_prompts: {out} already holds {len(kept)} questions", file=sys.stderr)
        return
    import torch

    from peagle.engine.engine import LLMEngine
    from peagle.engine.sampling import SamplingParams
    from peagle.train.data import HeldOutGuard

    torch.set_num_threads(1)
    seen: set[str] = set()
    for path in args.exclude:
        for rec in iter_json_records(path):
            seen.update(normalized(m["content"]) for m in rec["messages"] if m["role"] == "user")
    seen.update(normalized(r["messages"][0]["content"]) for r in kept)
    attempt = max((r["attempt"] for r in kept), default=-1) + 1
    engine = LLMEngine.from_pretrained(None, None, max_num_seqs=args.batch, device="cpu")
    prefix, guard = user_turn_prefix(engine.tokenizer), HeldOutGuard()
    bar = tqdm(total=args.num, initial=len(kept), unit="question", desc="self-prompts")
    with open_text(out, "a") as f:
        while len(kept) < args.num:
            seeds = range(attempt, attempt + args.batch)
            params = [SamplingParams(max_tokens=192, temperature=1.0, top_p=0.95, seed=args.seed * 10**9 + s,
                                     stop=["<|im_end|>"]) for s in seeds]
            outs = engine.generate([prefix] * args.batch, params, chat=False)
            for s, o in zip(seeds, outs):
                if len(kept) < args.num and keep(o.text, o.finish_reason == "stop", seen, guard):
                    rec = {"id": f"self-{args.first_id + len(kept)}", "attempt": s,
                           "messages": [{"role": "user", "content": o.text.strip()},
                                        {"role": "assistant", "content": PLACEHOLDER_ANSWER}]}
                    f.write(json.dumps(rec) + "\n")
                    kept.append(rec)
                    bar.update(1)
            f.flush()
            attempt += args.batch
            bar.set_postfix(kept_of_attempts=f"{len(kept)}/{attempt}")
    bar.close()
    print(f"make_self_prompts: {len(kept)} questions in {out} after {attempt} attempts", file=sys.stderr)


if __name__ == "__main__":
    main()
