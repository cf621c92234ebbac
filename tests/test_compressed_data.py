"""Committed conversation files may be stored gzip-compressed; they read back identical to what was written."""
import gzip
import json

from peagle.train.data import iter_json_records


def test_gzip_jsonl_reads_back_identical(tmp_path):
    records = [{"messages": [{"role": "user", "content": f"q{i} é"}, {"role": "assistant", "content": f"a{i}"}]}
               for i in range(5)]
    text = "".join(json.dumps(r, ensure_ascii=False) + "\n" for r in records)
    plain, packed = tmp_path / "c.jsonl", tmp_path / "c.jsonl.gz"
    plain.write_text(text, encoding="utf-8")
    with gzip.open(packed, "wt", encoding="utf-8", compresslevel=9) as f:
        f.write(text)
    assert list(iter_json_records(packed)) == list(iter_json_records(plain)) == records
