"""Code prompts for the heads, in the domain HumanEval measures but not from it: Python functions of the standard
library and of installed packages, each given as its signature and docstring (the shape of a HumanEval prompt),
for `peagle data prepare --regenerate` to complete with the target's own answer.

    python3 scripts/make_code_prompts.py --num 4000 --first-id 0 --out data/heads/prompts-code.jsonl.gz
    python3 scripts/make_code_prompts.py --num 6000 --first-id 4000 --packages "$(python3 scripts/make_code_prompts.py \
        --list-wide)" --exclude data/heads/prompts-code.jsonl.gz --out data/heads/prompts-code-2.jsonl.gz

Functions are read with `ast` (nothing is imported), deduplicated by their prompt, and drawn with a fixed seed from
the sorted list, so one machine's packages give one file; it is committed, since another machine's packages differ.
HumanEval's own functions are not in any package, and `peagle data prepare` refuses a HumanEval prompt anyway.
"""
from __future__ import annotations

import argparse
import ast
import json
import random
import sys
import sysconfig
from pathlib import Path

from peagle.train.data import PLACEHOLDER_ANSWER, iter_json_records, open_text

PACKAGES = ("numpy", "transformers", "tokenizers", "safetensors", "fastapi", "pydantic", "starlette", "tqdm",
            "matplotlib", "scipy", "requests", "urllib3", "click", "jinja2", "yaml", "packaging", "httpx")
# The second code file's sources: the first file's and the other pure-Python packages that `scripts/setup.sh --test`
# and the machine image bring (a name that is not installed adds nothing).
WIDE = PACKAGES + ("torch", "pandas", "sympy", "networkx", "datasets", "huggingface_hub", "accelerate", "pyarrow",
                   "rich", "pygments", "jsonschema", "docutils", "IPython", "jedi", "parso", "hypothesis", "fontTools",
                   "PIL", "prompt_toolkit", "libcst", "flask", "botocore", "boto3", "moto", "markdown_it", "anyio",
                   "openai", "pytest", "_pytest", "attr", "dateutil", "fsspec", "multiprocess", "dill",
                   "pyparsing", "cryptography", "mpmath", "gguf", "prometheus_client", "regex", "loguru")
MIN_DOC, MAX_DOC = 40, 800        # characters: a docstring that says what the function does, not a manual page
MIN_BODY, MAX_BODY = 3, 40        # lines of the body the answer should roughly write


def source_files(packages: tuple[str, ...] = PACKAGES) -> list[Path]:
    """The standard library's modules (no tests) and those of the installed packages, sorted."""
    stdlib = Path(sysconfig.get_paths()["stdlib"])
    files = [p for p in stdlib.glob("*.py")]
    files += [p for d in ("json", "email", "http", "urllib", "asyncio", "concurrent", "importlib", "logging",
                          "xml", "collections", "unittest") for p in (stdlib / d).rglob("*.py")]
    site = Path(sysconfig.get_paths()["purelib"])
    for name in dict.fromkeys(packages):
        files += (site / name).rglob("*.py")
    return sorted(p for p in files if "test" not in p.relative_to(p.anchor).as_posix().lower())


def function_prompts(path: Path) -> list[str]:
    """One prompt per documented public function or method of a file: its signature and docstring."""
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


PROMPT = "Complete the following Python function.\n\n```python\n{function}\n```"


def _function(prompt: str) -> str:
    """The function a prompt asks for (PROMPT's inverse)."""
    head, tail = PROMPT.split("{function}")
    return prompt.removeprefix(head).removesuffix(tail)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--num", type=int, default=4000)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--first-id", type=int, default=0, help="number the prompts code-N from here")
    ap.add_argument("--packages", help="comma-separated installed packages to read besides the standard library "
                    f"(default: {','.join(PACKAGES)})")
    ap.add_argument("--list-wide", action="store_true", help="print the second code file's package list and exit")
    ap.add_argument("--exclude", action="append", default=[],
                    help="a JSONL (or .jsonl.gz) of code prompts (an earlier file) whose functions must not be "
                    "picked again")
    ap.add_argument("--out")
    args = ap.parse_args()
    if args.list_wide:
        print(",".join(dict.fromkeys(WIDE)))
        return
    if not args.out:
        ap.error("--out is required")
    files = source_files(tuple(args.packages.split(",")) if args.packages else PACKAGES)
    # An earlier file's functions count as seen, so a second file never repeats one of its prompts.
    seen: set[str] = {_function(rec["messages"][0]["content"]) for path in args.exclude
                      for rec in iter_json_records(path)}
    prompts: list[str] = []
    for i, path in enumerate(files, 1):
        for p in function_prompts(path):
            if p not in seen:
                seen.add(p)
                prompts.append(p)
        if i % 500 == 0 or i == len(files):
            print(f"\r{i}/{len(files)} files, {len(prompts)} functions", end="", file=sys.stderr, flush=True)
    print(file=sys.stderr)
    random.Random(args.seed).shuffle(prompts)
    with open_text(args.out, "w") as f:  # (a .gz name writes it compressed)
        for n, p in enumerate(prompts[:args.num]):
            text = PROMPT.format(function=p)
            f.write(json.dumps({"id": f"code-{args.first_id + n}",
                                "messages": [{"role": "user", "content": text},
                                             {"role": "assistant", "content": PLACEHOLDER_ANSWER}]},
                               ensure_ascii=False) + "\n")
    print(f"wrote {min(args.num, len(prompts))} of {len(prompts)} documented functions from {len(files)} files "
          f"to {args.out}", file=sys.stderr)


if __name__ == "__main__":
    main()
