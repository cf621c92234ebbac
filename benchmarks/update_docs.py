"""Refresh generated parts of docs/benchmarks.md from `peagle bench` results (run by run_sweep.sh and
narrow_head.sh).

    python3 benchmarks/update_docs.py docs/benchmarks/humaneval/results.json docs/benchmarks.md humaneval
    python3 benchmarks/update_docs.py --summary docs/benchmarks.md humaneval mtbench counting

The first form writes one sweep's report into the section `humaneval`; the second writes, into the section
`summary`, one table of the adaptive speculation policy against no speculation and the best fixed K, from
docs/benchmarks/SECTION/results.json of each section named. A section is everything between the markers
`<!-- bench:SECTION:begin -->` and `<!-- bench:SECTION:end -->`; the hand-written reading of the results around
them is left alone (revise it when the numbers change).
"""
from __future__ import annotations

import json
import sys
from pathlib import Path

from peagle.bench.metrics import METHOD_NAMES, SPEC_METHODS, RunMetrics
from peagle.bench.report import adaptive_of, best_of, build_report, results_section


def load_report(results: Path) -> dict:
    saved = json.loads(results.read_text())
    # Rebuilt from the runs so the page follows the current report code (targets, notes), not the saved copy's.
    report = build_report([RunMetrics.from_dict(r) for r in saved["runs"]], saved["meta"])
    report["plots"] = saved.get("plots")
    return report


def write_section(doc: Path, section: str, body: str) -> None:
    begin, end = f"<!-- bench:{section}:begin -->", f"<!-- bench:{section}:end -->"
    text = doc.read_text() if doc.exists() else "# Benchmarks\n"
    if begin not in text or end not in text:
        text += f"\n{begin}\n{end}\n"  # a new section goes at the end; move it by hand
    head, rest = text.split(begin, 1)
    _, tail = rest.split(end, 1)
    doc.write_text(f"{head}{begin}\n{body}\n{end}{tail}")


def summary(doc: Path, sections: list[str]) -> str:
    """Per prompt set, concurrency and method: no speculation, the best fixed K, adaptive (its mean K) and the
    ratio of adaptive to the better of the two."""
    lines = ["| prompts | concurrency | method | no speculation | best fixed K | adaptive (mean K) | adaptive / better "
             "| the same per CPU second |", "|---|---:|---|---:|---:|---:|---:|---:|"]
    for section in sections:
        results = doc.parent / "benchmarks" / section / "results.json"
        if not results.exists():  # not measured yet
            continue
        report = load_report(results)
        runs = [RunMetrics.from_dict(r) for r in report["runs"]]
        for c in sorted({r.concurrency for r in runs}):
            _, plain = best_of(runs, "baseline", c)
            for m in SPEC_METHODS:
                adaptive = adaptive_of(runs, m, c)
                k, fixed = best_of(runs, m, c)
                if adaptive is None:
                    continue
                better = max(x for x in (plain, fixed, 0.0) if x is not None)
                mean_k = (adaptive.acceptance or {}).get("mean_k")
                lines.append(
                    f"| {report['meta'].get('dataset')} | {c} | {METHOD_NAMES[m]} | {_f(plain)} | "
                    f"{_f(fixed)}" + (f" (K={k})" if k is not None else "") + f" | {_f(adaptive.otps)}"
                    + (f" ({mean_k:.2f})" if mean_k is not None else "") + " | "
                    + (f"**{adaptive.otps / better:.2f}x**" if better else "—") + " | "
                    + _x(report["table"], c, m) + " |")
    return "\n".join(lines)


def _x(table: list[dict], c: int, method: str) -> str:
    row = next(r for r in table if r["concurrency"] == c)
    r = row["adaptive_vs_best_cpu_otps"].get(method)
    return "—" if r is None else f"{r:.2f}x"


def _f(x: float | None) -> str:
    return "—" if x is None else f"{x:.1f}"


def main(argv: list[str]) -> None:
    if len(argv) >= 2 and argv[0] == "--summary":
        doc = Path(argv[1])
        write_section(doc, "summary", summary(doc, argv[2:]))
    elif len(argv) == 3:
        results, doc = Path(argv[0]), Path(argv[1])
        prefix = results.parent.relative_to(doc.parent).as_posix() + "/"
        write_section(doc, argv[2], results_section(load_report(results), level=4, image_prefix=prefix))
    else:
        raise SystemExit(__doc__)


if __name__ == "__main__":
    main(sys.argv[1:])
