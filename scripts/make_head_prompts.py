"""Pick the prompts the bundled SmolLM2 heads are trained on: first user turns of ShareGPT, half of them about
code, none from HumanEval or MT-Bench (`peagle data prepare` refuses those anyway). Writes JSONL conversations with
an empty assistant turn for `peagle data prepare --regenerate` to fill with the target's own answers.

    python scripts/make_head_prompts.py --num 1200 --out data/head-prompts.jsonl
    python scripts/make_head_prompts.py --num 2400 --first-id 1600 --exclude data/heads/prompts.jsonl.gz \
        --out more-prompts.jsonl.gz

With --multi-turn it keeps the first --max-turns user turns of conversations that have at least two, each followed
by an empty assistant turn: regenerated turn by turn, every later question sees SmolLM2's own earlier answers, so
the histories the heads learn from reach thousands of tokens, as a chat's do.

ShareGPT repeats some conversations; each first turn is picked once (since 2026-12-02: prompts.jsonl.gz, -2 and -3 in
data/heads were made before and repeat 27, 37 and 104 first turns; `git show 9997126:scripts/make_head_prompts.py`
is the script that made them).
"""
from __future__ import annotations

import argparse
import json
import random
import re

from peagle.train.data import PLACEHOLDER_ANSWER, iter_conversations, iter_json_records, open_text

CODE = re.compile(r"\b(python|javascript|typescript|java|c\+\+|sql|function|code|script|class|regex|bash|html|css|"
                  r"algorithm|api|json|def |import |bug|compile|error)\b", re.I)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--num", type=int, default=1200)
    ap.add_argument("--code-fraction", type=float, default=0.5)
    ap.add_argument("--max-chars", type=int, default=1500)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--first-id", type=int, default=0, help="number the prompts sharegpt-N from here (ids must "
                    "stay unique across the files a head is trained on)")
    ap.add_argument("--exclude", action="append", default=[],
                    help="a JSONL (or .jsonl.gz) of conversations whose first user turns must not be picked again "
                    "(repeatable)")
    ap.add_argument("--multi-turn", action="store_true", help="conversations of 2 or more user turns, all of them kept")
    ap.add_argument("--max-turns", type=int, default=4, help="--multi-turn: user turns kept per conversation")
    ap.add_argument("--out", required=True)
    args = ap.parse_args()
    taken = {_first_user(rec["messages"]) for path in args.exclude for rec in iter_json_records(path)}
    code, other = [], []
    want_code = int(args.num * args.code_fraction)
    for _, msgs in iter_conversations("sharegpt"):
        users = [m["content"] for m in msgs if m["role"] == "user"]
        users = users[:args.max_turns] if args.multi_turn else users[:1]
        if (not users or users[0] in taken or (args.multi_turn and len(users) < 2)
                or not all(20 <= len(u) <= args.max_chars and u.isascii() for u in users)):
            continue
        taken.add(users[0])  # ShareGPT repeats conversations: each first turn once
        (code if CODE.search(users[0]) else other).append(users)
        if len(code) >= 4 * want_code and len(other) >= 4 * (args.num - want_code):
            break
    rng = random.Random(args.seed)
    picked = rng.sample(code, min(want_code, len(code))) + rng.sample(other, min(args.num - want_code, len(other)))
    rng.shuffle(picked)
    with open_text(args.out, "w") as f:  # (a .gz name writes it compressed)
        for i, users in enumerate(picked):
            messages = [m for u in users for m in ({"role": "user", "content": u},
                                                   {"role": "assistant", "content": PLACEHOLDER_ANSWER})]
            f.write(json.dumps({"id": f"sharegpt-{args.first_id + i}", "messages": messages}) + "\n")
    print(f"wrote {len(picked)} conversations ({sum(bool(CODE.search(p[0])) for p in picked)} about code, "
          f"{sum(map(len, picked))} user turns) to {args.out}")


def _first_user(messages: list[dict]) -> str:
    return next((m["content"] for m in messages if m["role"] == "user"), "")


if __name__ == "__main__":
    main()
