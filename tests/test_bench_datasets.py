"""Prompt sets load offline from the installed packages and from user files; bad input names its line."""
from __future__ import annotations

import json

import pytest

from peagle.bench.datasets import DatasetError, load_dataset


def test_humaneval_prompts():
    prompts = load_dataset("humaneval")
    assert len(prompts) == 164
    assert prompts[0].id == "HumanEval/0" and "def has_close_elements" in prompts[0].text
    assert prompts[0].chat_messages()[0]["role"] == "user"
    assert prompts[0].text in prompts[0].chat_messages()[0]["content"]


def test_mtbench_first_turns():
    prompts = load_dataset("mtbench")
    assert len(prompts) == 80
    assert prompts[0].id == "mtbench/81" and prompts[0].category == "writing"
    assert prompts[0].chat_messages() == [{"role": "user", "content": prompts[0].text}]


def test_sharegpt_reads_records_one_by_one():
    prompts = load_dataset("sharegpt", 5)
    assert len(prompts) == 5 and all(p.text.strip() for p in prompts)
    assert prompts[0].id.startswith("sharegpt/")


def test_sharegpt_file_that_is_not_a_json_array_is_a_dataset_error(tmp_path):
    f = tmp_path / "lines.jsonl"
    f.write_text(json.dumps({"conversations": []}) + "\n")
    with pytest.raises(DatasetError, match="not a JSON array"):
        load_dataset(f"sharegpt:{f}")


def test_fewer_prompts_than_asked_are_cycled():
    prompts = load_dataset("mtbench", 85)
    assert len(prompts) == 85 and prompts[80].text == prompts[0].text and prompts[80].id != prompts[0].id


def test_custom_jsonl_shapes(tmp_path):
    f = tmp_path / "p.jsonl"
    f.write_text("\n".join([
        json.dumps({"prompt": "plain text"}),
        json.dumps({"messages": [{"role": "system", "content": "be brief"}, {"role": "user", "content": "hi"},
                                 {"role": "assistant", "content": "hello"}]}),
        "",
        json.dumps({"conversations": [{"from": "human", "value": "sharegpt turn"}, {"from": "gpt", "value": "a"}]}),
        json.dumps({"turns": ["first turn", "second turn"], "question_id": 7}),
    ]) + "\n")
    prompts = load_dataset(f"custom:{f}")
    assert [p.text for p in prompts] == ["plain text", "hi", "sharegpt turn", "first turn"]
    assert prompts[1].chat_messages() == [{"role": "system", "content": "be brief"}, {"role": "user", "content": "hi"}]
    assert prompts[3].id == "7"


def test_custom_jsonl_bad_line_names_its_number(tmp_path):
    f = tmp_path / "bad.jsonl"
    f.write_text('{"prompt": "ok"}\n\n{"prompt": "also ok"}\n{"prompt": oops}\n')
    with pytest.raises(DatasetError, match=r"bad\.jsonl:4: invalid JSON"):
        load_dataset(f"custom:{f}")
    f.write_text('{"prompt": "ok"}\n{"answer": "no prompt here"}\n')
    with pytest.raises(DatasetError, match=r"bad\.jsonl:2: no prompt"):
        load_dataset(f"custom:{f}")


def test_speed_bench_local_files(tmp_path):
    pq = pytest.importorskip("pyarrow.parquet")
    import pyarrow as pa

    root = tmp_path / "SPEED-Bench"
    (root / "qualitative").mkdir(parents=True)
    table = pa.table({"question_id": ["q1", "q2"], "category": ["coding", "math"],
                      "turns": [["write code"], ["add numbers", "again"]]})
    pq.write_table(table, root / "qualitative" / "test-00000.parquet")
    prompts = load_dataset(f"speed-bench:{root}")
    assert [(p.id, p.text, p.category) for p in prompts] == [("q1", "write code", "coding"),
                                                            ("q2", "add numbers", "math")]
    (root / "throughput_1k").mkdir()
    (root / "throughput_1k" / "x.jsonl").write_text(json.dumps({"question_id": "t", "turns": []}) + "\n")
    with pytest.raises(DatasetError, match="reconstructed"):
        load_dataset(f"speed-bench:{root / 'throughput_1k'}")


def test_unknown_or_missing_sets_fail_clearly(tmp_path):
    with pytest.raises(DatasetError, match="unknown dataset"):
        load_dataset("gsm8k")
    with pytest.raises(DatasetError, match="no such file"):
        load_dataset(f"custom:{tmp_path / 'missing.jsonl'}")
    with pytest.raises(DatasetError, match="not available offline"):
        load_dataset("speed-bench")


def test_shared_system_prompts_share_one_long_system_turn():
    ps = load_dataset("shared-system", 3)
    systems = {p.messages[0]["content"] for p in ps}
    assert len(systems) == 1 and len(next(iter(systems))) > 5000  # one handbook, long enough to cache
    assert len({p.messages[1]["content"] for p in ps}) == 3 and all(p.text.endswith(p.messages[1]["content"])
                                                                    for p in ps)


def test_sharegpt_multiturn_resends_the_history(tmp_path):
    conv = [{"from": f, "value": v} for f, v in
            [("human", "q1"), ("gpt", "a1"), ("human", "q2"), ("gpt", "a2"), ("human", "q3"), ("gpt", "a3")]]
    path = tmp_path / "sg.json"
    path.write_text(json.dumps([{"id": "c", "conversations": conv},
                                {"id": "single", "conversations": conv[:2]}]))
    ps = load_dataset(f"sharegpt-multiturn:{path}")
    assert [p.id for p in ps] == ["sharegpt-multiturn/c/1", "sharegpt-multiturn/c/2"]
    assert [m["content"] for m in ps[1].messages] == ["q1", "a1", "q2", "a2", "q3"]
    assert ps[1].messages[:3] == ps[0].messages  # each turn starts with the one before: what the cache reuses


def test_code_edit_sends_a_whole_file_and_asks_for_it_back():
    import ast

    prompts = load_dataset("code-edit")
    assert len(prompts) == 164 and len({p.id for p in prompts}) == 164
    assert [p.text for p in load_dataset("code-edit", 5)] == [p.text for p in prompts[:5]]  # deterministic
    assert len({p.category for p in prompts}) == 5
    for p in prompts:
        code = p.text.split("```python\n", 1)[1].split("```", 1)[0]
        ast.parse(code)  # a whole, valid file (parsed, never run)
        assert "Reply with the whole updated file" in p.text and p.chat_messages()[0]["content"] == p.text
    rename = next(p for p in prompts if p.category == "code-edit/rename")
    old, new = rename.text.split("Rename the function `", 1)[1].split("`")[0:3:2]
    assert f"def {old}(" in rename.text and new == old.split("_")[0] + "".join(w.title() for w in old.split("_")[1:])


def test_summarise_quotes_passages_are_bounded_and_fixed():
    from peagle.bench import datasets

    prompts = load_dataset("summarise-quotes")
    assert len(prompts) > 100 and len({p.id for p in prompts}) == len(prompts)
    assert [p.text for p in load_dataset("summarize-quotes", 3)] == [p.text for p in prompts[:3]]
    for p in prompts:
        passage = p.text.split("\n\n", 1)[1]
        assert datasets.SUMMARY_MIN_CHARS <= len(passage) <= datasets.SUMMARY_MAX_CHARS
        assert "quote the passage's exact words" in p.text
