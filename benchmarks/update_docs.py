"""Refresh the generated parts of docs/benchmarks.md and README.md from the committed result files (run by
run_sweep.sh and narrow_head.sh; tests/test_docs_figures.py checks that the committed docs equal what this writes).

    python3 benchmarks/update_docs.py --summary docs/benchmarks.md humaneval mtbench counting
    python3 benchmarks/update_docs.py --readme README.md

The first writes, into the section `summary`, one table of the adaptive speculation policy against no speculation
and the best fixed K, from docs/benchmarks/SECTION/results.json of each section named (each run's full report is the
results.md beside it); the second writes README.md's table of figures (section `figures`) from the result files in
README_SOURCES, each row linking to the doc section that owns its run. A section is everything between the markers
`<!-- bench:SECTION:begin -->` and `<!-- bench:SECTION:end -->`; the hand-written reading around them is left alone
(revise it when the numbers change).
"""
from __future__ import annotations

import json
import sys
from pathlib import Path

from peagle.bench.metrics import METHOD_NAMES, SPEC_METHODS, RunMetrics
from peagle.bench.report import adaptive_of, best_of, build_report


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


# README.md's figures: one row per figure, each from one committed result file, its cell a figure or two and a
# link to the doc section that owns the run (its command, machine and reading). The engine benchmark's JSON does not
# record its command line; docs/engine.md gives it.
ENGINE_DECODE = "docs/engine_decode.json"
ACCEPTANCE = "docs/heads/acceptance.json"
VS_LLAMA_CPP = "docs/benchmarks/vs_llama_cpp.json"
SWEEPS = {"humaneval": "docs/benchmarks/humaneval/results.json", "mtbench": "docs/benchmarks/mtbench/results.json"}
README_SOURCES = (ENGINE_DECODE, ACCEPTANCE, VS_LLAMA_CPP, *SWEEPS.values())
DATASET_TITLES = {"humaneval": "HumanEval", "mtbench": "MT-Bench"}
# (doc, section heading) that owns each row's run; tests/test_docs_figures.py checks that every heading exists
OWNERS = {"plain": ("docs/engine.md", "Plain decoding"), "drafting": ("docs/engine.md", "Drafting cost against K"),
          "acceptance": ("docs/heads.md", "Acceptance"),
          "sweep": ("docs/benchmarks.md", "The adaptive policy against fixed K and no speculation"),
          "llama.cpp": ("docs/performance.md", "Against llama.cpp's speculative decoding")}


def anchor(heading: str) -> str:
    """The fragment GitHub gives a markdown heading: lower case, punctuation dropped, spaces to hyphens."""
    kept = "".join(c for c in heading.lower() if c.isalnum() or c in " -_")
    return kept.replace(" ", "-")


def _link(key: str) -> str:
    doc, heading = OWNERS[key]
    return f"[{doc.removeprefix('docs/')}]({doc}#{anchor(heading)})"


def readme_figures(root: Path) -> str:
    """README.md's table, read from the result files under `root` (the repository)."""
    rows = ["Generated from the committed result files by `python3 benchmarks/update_docs.py --readme README.md`; "
            "each link leads to the run's command, machine and reading.", "",
            "| measured | result | run |", "|---|---|---|"]
    rows += _engine_rows(root) + _acceptance_rows(root) + _llama_cpp_rows(root)
    for dataset, path in SWEEPS.items():
        rows += _sweep_rows(root, dataset, path)
    return "\n".join(rows)


def _engine_rows(root: Path) -> list[str]:
    e = json.loads((root / ENGINE_DECODE).read_text())
    plain, ms = e["plain"], e["drafting"]["drafter_ms_per_step"]
    k1 = str(min(int(k) for k in ms["parallel"]))
    return [f"| plain decoding, batch 1 | {plain['peagle_tokens_per_s']:.1f} tokens/s, {plain['speedup']:.2f}x "
            f"transformers `generate()` | {_link('plain')} |",
            f"| drafting time, K=7 over K={k1} | P-EAGLE {ms['parallel']['7'] / ms['parallel'][k1]:.2f}x, EAGLE-3 "
            f"{ms['chain']['7'] / ms['chain'][k1]:.2f}x | {_link('drafting')} |"]


def _acceptance_rows(root: Path) -> list[str]:
    runs = json.loads((root / ACCEPTANCE).read_text())
    k = max(r["k"] for r in runs)
    rows = []
    for dataset in dict.fromkeys(r["dataset"] for r in runs):
        at_k = {r["method"]: r["mean_acceptance_length"] for r in runs if r["dataset"] == dataset and r["k"] == k}
        rows.append(f"| mean acceptance length, {DATASET_TITLES.get(dataset, dataset)}, K={k} | "
                    + ", ".join(f"{METHOD_NAMES[m]} {at_k[m]:.2f}" for m in ("peagle", "eagle3") if m in at_k)
                    + f" | {_link('acceptance')} |")
    return rows


def _llama_cpp_rows(root: Path) -> list[str]:
    """peagle's default and its EAGLE-3 against llama-server's speculation on the same GGUF file."""
    ratios = json.loads((root / VS_LLAMA_CPP).read_text())["ratios"]
    default = ", ".join(f"{w} {ratios[w]['default_vs_best_llama_cpp']:.2f}x" for w in ("code-edit", "fresh-chat"))
    eagle3 = [ratios[w]["eagle3_vs_llama_cpp_eagle3"] for w in ratios]
    return [f"| speculation against llama-server's, same Q4_0 file, 1 thread | default over llama.cpp's best: "
            f"{default}; same EAGLE-3 head {min(eagle3):.2f}-{max(eagle3):.2f}x | {_link('llama.cpp')} |"]


def _sweep_rows(root: Path, dataset: str, path: str) -> list[str]:
    """P-EAGLE adaptive against the better of no speculation and its best fixed K, per CPU second, at each
    concurrency."""
    report = load_report(root / path)
    cs = sorted({r["concurrency"] for r in report["runs"]})
    ratios = " / ".join(_x(report["table"], c, "peagle") for c in cs)
    return [f"| `peagle bench` {DATASET_TITLES.get(dataset, dataset)}, concurrency {' / '.join(map(str, cs))} | "
            f"P-EAGLE adaptive {ratios} the better of fixed K and none, per CPU second | {_link('sweep')} |"]


def main(argv: list[str]) -> None:
    if len(argv) >= 2 and argv[0] == "--summary":
        doc = Path(argv[1])
        write_section(doc, "summary", summary(doc, argv[2:]))
    elif len(argv) == 2 and argv[0] == "--readme":
        doc = Path(argv[1])
        write_section(doc, "figures", readme_figures(doc.resolve().parent))
    else:
        raise SystemExit(__doc__)


if __name__ == "__main__":
    main(sys.argv[1:])
