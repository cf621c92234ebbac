"""The one streaming JSON-array reader (benchmark prompt sets and training data): every complete element of an
array of any size, whatever the chunk size, a truncated tail dropped, and a clear error for what is not an array."""
from __future__ import annotations

import io
import json

import pytest

from peagle.jsonarray import NotAJSONArrayError, iter_json_array, opens_json_array


def test_json_array_with_truncated_tail():
    records = [{"id": i, "conversations": [{"from": "human", "value": "x" * i}]} for i in range(50)]
    text = json.dumps(records)
    cut = text[: text.rindex('{"id": 49') + 20]  # the last record is cut in the middle
    got = list(iter_json_array(io.StringIO(cut), chunk_chars=64))
    assert [r["id"] for r in got] == list(range(49))
    assert [r["id"] for r in iter_json_array(io.StringIO(text), chunk_chars=7)] == list(range(50))


@pytest.mark.parametrize("chunk_chars", [1, 2, 5, 64, 1 << 20])
def test_every_element_whatever_the_chunk_size(chunk_chars):
    # whitespace of any kind between elements, leading whitespace longer than a chunk, and numbers that a chunk
    # boundary could cut in two
    elements = [{"a": [1, 2]}, "s, ]", 12345, None, [], 6.5e10]
    text = "\n \t\x0c" * 3 + "[\n" + " ,\r\n".join(json.dumps(e) for e in elements) + "\n]\n"
    assert list(iter_json_array(io.StringIO(text), chunk_chars=chunk_chars)) == elements


def test_the_buffer_is_trimmed_as_elements_are_read():
    records = [{"id": i, "text": "y" * 100} for i in range(200)]
    assert [r["id"] for r in iter_json_array(io.StringIO(json.dumps(records)), chunk_chars=16)] == list(range(200))


@pytest.mark.parametrize("text", ["[]", "  [ ] ", "[", "[\n  ", '[{"id": 1'])
def test_empty_or_cut_before_the_first_element(text):
    assert list(iter_json_array(io.StringIO(text), chunk_chars=2)) == []


@pytest.mark.parametrize("text", ["", "   \n", '{"id": 1}\n{"id": 2}\n', "null"])
def test_not_an_array_is_an_error_naming_the_file(tmp_path, text):
    path = tmp_path / "data.json"
    path.write_text(text)
    with open(path, encoding="utf-8") as f:
        assert not opens_json_array(f)
        with pytest.raises(NotAJSONArrayError, match=f"{path}: not a JSON array"):
            list(iter_json_array(f))


def test_opens_json_array_leaves_the_file_where_it_was(tmp_path):
    path = tmp_path / "data.json"
    path.write_text('\n\n  [{"id": 1}]')
    with open(path, encoding="utf-8") as f:
        assert opens_json_array(f) and f.tell() == 0
        assert list(iter_json_array(f)) == [{"id": 1}]
