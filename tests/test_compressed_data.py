"""Committed conversation files are stored gzip-compressed; they read back identical to what was written, and the
scripts that write or extend such a file write gzip when its name ends in `.gz`."""
import gzip
import json
import subprocess
from pathlib import Path

from peagle.train.data import iter_json_records, open_text

ROOT = Path(__file__).resolve().parent.parent


def test_gzip_jsonl_reads_back_identical(tmp_path):
    records = [{"messages": [{"role": "user", "content": f"q{i} é"}, {"role": "assistant", "content": f"a{i}"}]}
               for i in range(5)]
    text = "".join(json.dumps(r, ensure_ascii=False) + "\n" for r in records)
    plain, packed = tmp_path / "c.jsonl", tmp_path / "c.jsonl.gz"
    plain.write_text(text, encoding="utf-8")
    with gzip.open(packed, "wt", encoding="utf-8", compresslevel=9) as f:
        f.write(text)
    assert list(iter_json_records(packed)) == list(iter_json_records(plain)) == records


def test_open_text_writes_and_appends_gzip_that_gzip_reads(tmp_path):
    """A written .gz carries no name or time (the same text, the same bytes); an append adds a gzip member, and
    both this reader and `gzip -dc` read the members as one text."""
    path = tmp_path / "c.jsonl.gz"
    with open_text(path, "w") as f:
        f.write('{"id": "a", "text": "é"}\n')
    first = path.read_bytes()
    with open_text(path, "w") as f:
        f.write('{"id": "a", "text": "é"}\n')
    assert path.read_bytes() == first and first[:2] == b"\x1f\x8b"
    with open_text(path, "a") as f:
        f.write('{"id": "b"}\n')
    assert [r["id"] for r in iter_json_records(path)] == ["a", "b"]
    unpacked = subprocess.run(["gzip", "-dc", str(path)], capture_output=True, check=True).stdout
    assert unpacked.decode("utf-8") == '{"id": "a", "text": "é"}\n{"id": "b"}\n'
    plain = tmp_path / "c.jsonl"
    with open_text(plain, "w") as f:
        f.write('{"id": "a"}\n')
    assert plain.read_text() == '{"id": "a"}\n'


def test_committed_conversation_files_are_compressed():
    """The training data in data/heads travels gzip-compressed: no plain JSONL among the tracked files."""
    tracked = subprocess.run(["git", "ls-files", "data"], cwd=ROOT, capture_output=True, text=True)
    if tracked.returncode != 0 or not tracked.stdout.strip():  # not a git checkout: the files on disk
        names = [str(p.relative_to(ROOT)) for p in (ROOT / "data").rglob("*") if p.is_file()]
    else:
        names = tracked.stdout.split()
    assert [n for n in names if n.endswith(".jsonl.gz")]
    assert not [n for n in names if n.endswith((".jsonl", ".json")) and not n.endswith("campaign.json")]
