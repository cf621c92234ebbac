"""The heads' training prompts: where each prompt file under data/heads comes from, and how they join into training
and held-out sets. Every prompt file is JSONL conversations whose assistant turns are empty (PLACEHOLDER_ANSWER) for
`peagle data prepare --regenerate` to fill with the target's own answers; `.gz` names are read and written
gzip-compressed; no HumanEval or MT-Bench prompt is ever written (`peagle data prepare` refuses them anyway).

    python3 scripts/head_data.py sharegpt --num 1200 --out data/head-prompts.jsonl       # ShareGPT first turns
    python3 scripts/head_data.py sharegpt --multi-turn --num 1500 --first-id 20000 --exclude data/heads/prompts.jsonl.gz \
        --out data/heads/prompts-multi.jsonl.gz                                           # 2-4 user turns each
    python3 scripts/head_data.py code --num 4000 --out data/heads/prompts-code.jsonl.gz  # functions' signatures
    python3 scripts/head_data.py self --num 5000 --first-id 30000 --out data/heads/prompts-self.jsonl.gz
    python3 scripts/head_data.py mix --inputs chat.jsonl code.jsonl --out data/heads/prompts-4.jsonl.gz
    python3 scripts/head_data.py split --inputs data/heads/smollm2-regenerated.jsonl.gz more.jsonl \
        --train train.jsonl --heldout heldout.jsonl

sharegpt: first user turns of ShareGPT, --code-fraction of them about code, each first turn once (ShareGPT repeats
conversations; the files prompts.jsonl.gz, -2 and -3 were made before that rule and repeat 27, 37 and 104 first
turns); with --multi-turn the first --max-turns user turns of conversations that have at least two, so that the
regenerated histories reach thousands of tokens, as a chat's do.
code: documented public functions of the standard library and installed packages (--packages; --list-wide prints
the second code file's list), each as its signature and docstring (HumanEval's shape, not its items), read with
`ast` (nothing imported), deduplicated, drawn with a fixed seed from the sorted list; commit the file, since another
machine's packages differ.
self: questions the target writes itself from its chat template cut where a user's words begin (Magpie's way, Xu et
al. 2024), for when ShareGPT runs out: sampled at temperature 1, top-p 0.95, kept when the target ended the turn,
20-1,500 ASCII characters, new in their words; rerunning resumes after the last attempt (a kill loses a batch).
mix: shuffle prompt files into one with a fixed seed, so answers made in its order mix the files' kinds.
split: join regenerated files into a training file and the fixed held-out set (the bundled heads' 32 held-out
conversations: `peagle train`'s split of BUNDLED_DATA), so a head trained on more data is measured on the same rows.
"""
from __future__ import annotations

import argparse
import ast
import json
import random
import re
import sys
import sysconfig
from collections.abc import Iterable
from pathlib import Path

from peagle.train.data import PLACEHOLDER_ANSWER, iter_conversations, iter_json_records, open_text

BUNDLED_DATA = "data/heads/smollm2-regenerated.jsonl.gz"


def conversation(conv_id: str, questions: Iterable[str], **extra) -> str:
    """One prompt line: each question followed by an empty assistant turn for the target to answer."""
    messages = [m for q in questions for m in ({"role": "user", "content": q},
                                               {"role": "assistant", "content": PLACEHOLDER_ANSWER})]
    return json.dumps({"id": conv_id, **extra, "messages": messages}, ensure_ascii=False) + "\n"


def user_turns(paths: list[str]) -> Iterable[str]:
    """Every user turn of the --exclude files."""
    for path in paths:
        for rec in iter_json_records(path):
            yield from (m["content"] for m in rec["messages"] if m["role"] == "user")


# ---- sharegpt

CODE = re.compile(r"\b(python|javascript|typescript|java|c\+\+|sql|function|code|script|class|regex|bash|html|css|"
                  r"algorithm|api|json|def |import |bug|compile|error)\b", re.I)


def sharegpt(args) -> None:
    taken = {next((m["content"] for m in rec["messages"] if m["role"] == "user"), "")
             for path in args.exclude for rec in iter_json_records(path)}
    code, other = [], []
    want_code = int(args.num * args.code_fraction)
    for _, msgs in iter_conversations("sharegpt"):
        users = [m["content"] for m in msgs if m["role"] == "user"][:args.max_turns if args.multi_turn else 1]
        if (not users or users[0] in taken or (args.multi_turn and len(users) < 2)
                or not all(20 <= len(u) <= args.max_chars and u.isascii() for u in users)):
            continue
        taken.add(users[0])
        (code if CODE.search(users[0]) else other).append(users)
        if len(code) >= 4 * want_code and len(other) >= 4 * (args.num - want_code):
            break
    rng = random.Random(args.seed)
    picked = rng.sample(code, min(want_code, len(code))) + rng.sample(other, min(args.num - want_code, len(other)))
    rng.shuffle(picked)
    with open_text(args.out, "w") as f:
        f.writelines(conversation(f"sharegpt-{args.first_id + i}", users) for i, users in enumerate(picked))
    print(f"wrote {len(picked)} conversations ({sum(bool(CODE.search(p[0])) for p in picked)} about code, "
          f"{sum(map(len, picked))} user turns) to {args.out}", file=sys.stderr)


# ---- code

PACKAGES = ("numpy", "transformers", "tokenizers", "safetensors", "fastapi", "pydantic", "starlette", "tqdm",
            "matplotlib", "scipy", "requests", "urllib3", "click", "jinja2", "yaml", "packaging", "httpx")
# The second code file's sources: the first file's and the other pure-Python packages that `scripts/setup.sh --test`
# and the machine image bring (a name that is not installed adds nothing).
WIDE = PACKAGES + ("torch", "pandas", "sympy", "networkx", "datasets", "huggingface_hub", "accelerate", "pyarrow",
                   "rich", "pygments", "jsonschema", "docutils", "IPython", "jedi", "parso", "hypothesis", "fontTools",
                   "PIL", "prompt_toolkit", "libcst", "flask", "botocore", "boto3", "moto", "markdown_it", "anyio",
                   "openai", "pytest", "_pytest", "attr", "dateutil", "fsspec", "multiprocess", "dill",
                   "pyparsing", "cryptography", "mpmath", "gguf", "prometheus_client", "regex", "loguru")
MIN_DOC, MAX_DOC = 40, 800  # characters: a docstring that says what the function does, not a manual page
MIN_BODY, MAX_BODY = 3, 40  # lines of the body the answer should roughly write
CODE_PROMPT = "Complete the following Python function.\n\n```python\n{function}\n```"


def source_files(packages: tuple[str, ...]) -> list[Path]:
    """The standard library's modules (no tests) and those of the installed packages, sorted."""
    stdlib = Path(sysconfig.get_paths()["stdlib"])
    files = list(stdlib.glob("*.py"))
    files += [p for d in ("json", "email", "http", "urllib", "asyncio", "concurrent", "importlib", "logging",
                          "xml", "collections", "unittest") for p in (stdlib / d).rglob("*.py")]
    site = Path(sysconfig.get_paths()["purelib"])
    for name in dict.fromkeys(packages):
        files += (site / name).rglob("*.py")
    return sorted(p for p in files if "test" not in p.relative_to(p.anchor).as_posix().lower())


def function_prompts(path: Path) -> list[str]:
    """One per documented public function or method of a file: its signature and docstring."""
    try:
        tree = ast.parse(path.read_text(encoding="utf-8"))
    except (SyntaxError, UnicodeDecodeError, ValueError):
        return []
    out = []
    for node in ast.walk(tree):
        if not isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) or node.name.startswith("_"):
            continue
        doc = ast.get_docstring(node)
        body = node.end_lineno - node.body[0].end_lineno if node.body else 0
        if not doc or not MIN_DOC <= len(doc) <= MAX_DOC or not MIN_BODY <= body <= MAX_BODY:
            continue
        indented = "\n".join(("    " + ln) if ln else "" for ln in doc.splitlines()).lstrip()
        node.body = [ast.Expr(ast.Constant(indented + "\n    "))]  # signature and docstring, as HumanEval gives them
        node.decorator_list = []
        out.append(ast.unparse(node))
    return out


def code(args) -> None:
    if args.list_wide:
        print(",".join(dict.fromkeys(WIDE)))
        return
    if not args.out:
        raise SystemExit("head_data.py code: --out is required")
    files = source_files(tuple(args.packages.split(",")) if args.packages else PACKAGES)
    head, tail = CODE_PROMPT.split("{function}")  # an earlier file's functions count as seen: never repeated
    seen = {q.removeprefix(head).removesuffix(tail) for q in user_turns(args.exclude)}
    prompts: list[str] = []
    for path in files:
        for p in function_prompts(path):
            if p not in seen:
                seen.add(p)
                prompts.append(p)
    random.Random(args.seed).shuffle(prompts)
    with open_text(args.out, "w") as f:
        f.writelines(conversation(f"code-{args.first_id + n}", [CODE_PROMPT.format(function=p)])
                     for n, p in enumerate(prompts[:args.num]))
    print(f"wrote {min(args.num, len(prompts))} of {len(prompts)} documented functions from {len(files)} files "
          f"to {args.out}", file=sys.stderr)


# ---- self

def normalized(text: str) -> str:
    """The question's words, lower-cased: two questions differing only in case, spacing or punctuation are one."""
    return " ".join(re.findall(r"[a-z0-9]+", text.lower()))


def keep(question: str, finished: bool, seen: set[str], guard) -> bool:
    """Whether a sampled question joins the file (and, if so, it counts as seen)."""
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
            parts.extend(f)
    except EOFError:  # a .gz whose last member a kill cut off
        cut = True
    text = "".join(parts)
    if text and not text.endswith("\n"):  # killed mid-line: that question is asked again
        text, cut = text[:text.rfind("\n") + 1], True
    if cut:
        with open_text(out, "w") as f:
            f.write(text)
    return text


def self_prompts(args) -> None:
    out = Path(args.out)
    kept = [json.loads(line) for line in read_kept(out).splitlines() if line.strip()]
    if len(kept) >= args.num:
        print(f"head_data.py self: {out} already holds {len(kept)} questions", file=sys.stderr)
        return
    import torch

    from peagle.engine import LLMEngine, SamplingParams
    from peagle.train.data import HeldOutGuard

    torch.set_num_threads(1)
    seen = {normalized(q) for q in user_turns(args.exclude)} | {normalized(r["messages"][0]["content"]) for r in kept}
    attempt = max((r["attempt"] for r in kept), default=-1) + 1
    engine = LLMEngine.from_pretrained(None, None, max_num_seqs=args.batch, device="cpu")
    marker = "\x00QUESTION\x00"  # the rendered template up to where a user's words begin
    prefix = engine.tokenizer.apply_chat_template([{"role": "user", "content": marker}], tokenize=False)
    prefix, guard = prefix[:prefix.index(marker)], HeldOutGuard()
    with open_text(out, "a") as f:
        while len(kept) < args.num:
            seeds = range(attempt, attempt + args.batch)
            params = [SamplingParams(max_tokens=192, temperature=1.0, top_p=0.95, seed=args.seed * 10**9 + s,
                                     stop=["<|im_end|>"]) for s in seeds]
            for s, o in zip(seeds, engine.generate([prefix] * args.batch, params, chat=False)):
                if len(kept) < args.num and keep(o.text, o.finish_reason == "stop", seen, guard):
                    kept.append({"id": f"self-{args.first_id + len(kept)}", "attempt": s})
                    f.write(conversation(kept[-1]["id"], [o.text.strip()], attempt=s))
            f.flush()  # a kill loses at most this batch
            attempt += args.batch
            print(f"\r{len(kept)} of {args.num} questions after {attempt} attempts", end="", file=sys.stderr)
    print(f"\nhead_data.py self: {len(kept)} questions in {out}", file=sys.stderr)


# ---- mix and split

def mix(args) -> None:
    lines = []
    for path in args.inputs:
        with open_text(path) as f:
            lines += [line if line.endswith("\n") else line + "\n" for line in f if line.strip()]
    ids = [json.loads(line)["id"] for line in lines]
    if len(set(ids)) != len(ids):
        raise SystemExit("head_data.py mix: the inputs share conversation ids; give each file its own --first-id")
    random.Random(args.seed).shuffle(lines)
    with open_text(args.out, "w") as f:
        f.writelines(lines)
    print(f"head_data.py mix: {len(lines)} conversations from {len(args.inputs)} files to {args.out}", file=sys.stderr)


def bundled_heldout_ids(path: str = BUNDLED_DATA) -> set[str]:
    """The ids `peagle train` held out of the bundled data (its split with the defaults the heads were trained
    with)."""
    from peagle.train.trainer import TrainConfig, heldout_split

    ids = [rec["id"] for rec in iter_json_records(path)]
    heldout, _ = heldout_split(len(ids), TrainConfig.eval_fraction, TrainConfig.seed)
    return {ids[i] for i in heldout}


def split(args) -> None:
    heldout_ids, seen = bundled_heldout_ids(str(Path(__file__).resolve().parent.parent / BUNDLED_DATA)), set()
    counts = {"train": 0, "heldout": 0}
    with open_text(args.train, "w") as train, open_text(args.heldout, "w") as heldout:
        for path in args.inputs:
            with open_text(path) as lines:
                for line in filter(str.strip, lines):
                    conv_id = json.loads(line)["id"]
                    if conv_id in seen:
                        raise SystemExit(f"{path}: conversation id {conv_id!r} appears twice across --inputs; number "
                                         "new prompts past the old ones (--first-id)")
                    seen.add(conv_id)
                    part = "heldout" if conv_id in heldout_ids else "train"
                    (heldout if part == "heldout" else train).write(line if line.endswith("\n") else line + "\n")
                    counts[part] += 1
    print(f"{counts['train']} training and {counts['heldout']} held-out conversations", file=sys.stderr)


def parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = ap.add_subparsers(dest="command", required=True)

    def prompts(name: str, fn, help: str, num: int | None) -> argparse.ArgumentParser:
        p = sub.add_parser(name, help=help)
        p.add_argument("--num", type=int, default=num, required=num is None, help="prompts to write")
        p.add_argument("--first-id", type=int, default=0, help="number the prompts from here (ids must stay unique "
                       "across the files a head is trained on)")
        p.add_argument("--seed", type=int, default=0)
        p.add_argument("--exclude", action="append", default=[],
                       help="a prompt file (JSONL or .jsonl.gz) whose user turns must not be asked again (repeatable)")
        p.add_argument("--out", required=name != "code")
        p.set_defaults(run=fn)
        return p

    p = prompts("sharegpt", sharegpt, "ShareGPT first turns (or several turns), about half about code", 1200)
    p.add_argument("--code-fraction", type=float, default=0.5)
    p.add_argument("--max-chars", type=int, default=1500)
    p.add_argument("--multi-turn", action="store_true", help="conversations of 2 or more user turns, all kept")
    p.add_argument("--max-turns", type=int, default=4, help="--multi-turn: user turns kept per conversation")
    p = prompts("code", code, "documented functions' signatures and docstrings", 4000)
    p.add_argument("--packages", help=f"comma-separated installed packages besides the standard library "
                   f"[{','.join(PACKAGES)}]")
    p.add_argument("--list-wide", action="store_true", help="print the second code file's package list and exit")
    p = prompts("self", self_prompts, "questions the target writes itself", None)
    p.add_argument("--batch", type=int, default=16, help="questions sampled at once")
    p = sub.add_parser("mix", help="shuffle prompt files into one with a fixed seed")
    p.add_argument("--inputs", nargs="+", required=True, help="JSONL (or .jsonl.gz), each id unique")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", required=True)
    p.set_defaults(run=mix)
    p = sub.add_parser("split", help="training and the fixed held-out conversations")
    p.add_argument("--inputs", nargs="+", required=True, help="regenerated conversations (JSONL or .jsonl.gz)")
    p.add_argument("--train", required=True)
    p.add_argument("--heldout", required=True)
    p.set_defaults(run=split)
    return ap


def main(argv: list[str] | None = None) -> None:
    args = parser().parse_args(argv)
    args.run(args)


if __name__ == "__main__":
    main()
