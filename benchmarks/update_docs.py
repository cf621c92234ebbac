"""Refresh the generated part of docs/benchmarks.md from a `peagle bench` results.json (run by run_sweep.sh).

    python benchmarks/update_docs.py docs/benchmarks/results.json docs/benchmarks.md

Replaces everything between the markers `<!-- bench:results:begin -->` and `<!-- bench:results:end -->`; the
hand-written reading of the results around them is left alone (revise it when the numbers change).
"""
from __future__ import annotations

import json
import sys
from pathlib import Path

from peagle.bench.metrics import RunMetrics
from peagle.bench.report import build_report, results_section

BEGIN, END = "<!-- bench:results:begin -->", "<!-- bench:results:end -->"


def main(results: str, doc: str) -> None:
    saved = json.loads(Path(results).read_text())
    # Rebuilt from the runs so the page follows the current report code (targets, notes), not the saved copy's.
    report = build_report([RunMetrics.from_dict(r) for r in saved["runs"]], saved["meta"])
    report["plots"] = saved.get("plots")
    doc_path = Path(doc)
    prefix = Path(results).parent.relative_to(doc_path.parent).as_posix() + "/"
    body = results_section(report, level=3, image_prefix=prefix)
    text = doc_path.read_text() if doc_path.exists() else f"# Benchmarks\n\n{BEGIN}\n{END}\n"
    if BEGIN not in text or END not in text:
        raise SystemExit(f"{doc}: the markers {BEGIN} / {END} are missing")
    head, rest = text.split(BEGIN, 1)
    _, tail = rest.split(END, 1)
    doc_path.write_text(f"{head}{BEGIN}\n{body}\n{END}{tail}")


if __name__ == "__main__":
    if len(sys.argv) != 3:
        raise SystemExit(__doc__)
    main(sys.argv[1], sys.argv[2])
