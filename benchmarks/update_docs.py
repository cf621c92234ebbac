"""Refresh a generated part of docs/benchmarks.md from a `peagle bench` results.json (run by run_sweep.sh).

    python3 benchmarks/update_docs.py docs/benchmarks/humaneval/results.json docs/benchmarks.md humaneval

Replaces everything between the markers `<!-- bench:SECTION:begin -->` and `<!-- bench:SECTION:end -->`; the
hand-written reading of the results around them is left alone (revise it when the numbers change).
"""
from __future__ import annotations

import json
import sys
from pathlib import Path

from peagle.bench.metrics import RunMetrics
from peagle.bench.report import build_report, results_section


def main(results: str, doc: str, section: str) -> None:
    begin, end = f"<!-- bench:{section}:begin -->", f"<!-- bench:{section}:end -->"
    saved = json.loads(Path(results).read_text())
    # Rebuilt from the runs so the page follows the current report code (targets, notes), not the saved copy's.
    report = build_report([RunMetrics.from_dict(r) for r in saved["runs"]], saved["meta"])
    report["plots"] = saved.get("plots")
    doc_path = Path(doc)
    prefix = Path(results).parent.relative_to(doc_path.parent).as_posix() + "/"
    body = results_section(report, level=3, image_prefix=prefix)
    text = doc_path.read_text() if doc_path.exists() else "# Benchmarks\n"
    if begin not in text or end not in text:
        text += f"\n{begin}\n{end}\n"  # a new section goes at the end; move it by hand
    head, rest = text.split(begin, 1)
    _, tail = rest.split(end, 1)
    doc_path.write_text(f"{head}{begin}\n{body}\n{end}{tail}")


if __name__ == "__main__":
    if len(sys.argv) != 4:
        raise SystemExit(__doc__)
    main(*sys.argv[1:])
