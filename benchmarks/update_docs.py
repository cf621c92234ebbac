"""Refresh the generated parts of docs/benchmarks.md and README.md from the committed result files (run by
run_sweep.sh and narrow_head.sh; tests/test_docs_figures.py checks that the committed docs equal what this writes).

    python3 benchmarks/update_docs.py docs/benchmarks/humaneval/results.json docs/benchmarks.md humaneval
    python3 benchmarks/update_docs.py docs/benchmarks/results.json docs/benchmarks.md results 3
    python3 benchmarks/update_docs.py --summary docs/benchmarks.md humaneval mtbench counting
    python3 benchmarks/update_docs.py --readme README.md

The first form writes one sweep's report into the section `humaneval` (its headings at level 4, or the level
given after the section); the third writes, into the section `summary`, one table of the adaptive speculation
policy against no speculation and the best fixed K, from docs/benchmarks/SECTION/results.json of each section
named; the last writes README.md's table of figures (section `figures`) from the result files in README_SOURCES,
each row naming its file and the command that wrote it. A section is everything between the markers
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


# README.md's figures, each from one committed result file. The engine benchmark's JSON does not record its
# command line, so it is written here as docs/engine.md gives it; the others carry or print theirs.
ENGINE_DECODE = "docs/engine_decode.json"
ENGINE_DECODE_COMMAND = ("python3 benchmarks/engine_decode.py --max-tokens 96 --repeats 2 --iters 10 --threads 1 "
                         "--out docs/engine_decode.json")
ACCEPTANCE = "docs/heads/acceptance.json"
ACCEPTANCE_MD = "docs/heads/acceptance.md"  # the same run's report: its first line names the command and machine
SWEEPS = {"humaneval": "docs/benchmarks/humaneval/results.json", "mtbench": "docs/benchmarks/mtbench/results.json"}
SWEEP_SCRIPT = "bash benchmarks/run_sweep.sh"
README_SOURCES = (ENGINE_DECODE, ACCEPTANCE, ACCEPTANCE_MD, *SWEEPS.values())
DATASET_TITLES = {"humaneval": "HumanEval", "mtbench": "MT-Bench first turns"}


def readme_figures(root: Path) -> str:
    """README.md's table: one row per figure, its result file and the command that wrote it, read from the files
    under `root` (the repository)."""
    rows = [f"Generated by `python3 benchmarks/update_docs.py --readme README.md` from the committed result files "
            "each row names (tests/test_docs_figures.py fails on a hand edit); the doc beside each row has the "
            "run's machine, load and reading.", "",
            "| what | result | result file, command, doc |", "|---|---|---|"]
    rows += _engine_rows(root)
    rows += _acceptance_rows(root)
    for dataset, path in SWEEPS.items():
        rows += _sweep_rows(root, dataset, path)
    return "\n".join(rows)


def _engine_rows(root: Path) -> list[str]:
    e = json.loads((root / ENGINE_DECODE).read_text())
    plain, d = e["plain"], e["drafting"]
    ms = d["drafter_ms_per_step"]
    ks = sorted(int(k) for k in ms["parallel"])
    k1, k7, kmax = str(ks[0]), "7", str(ks[-1])
    where = f"`{ENGINE_DECODE}`: `{ENGINE_DECODE_COMMAND}` ({e['machine']}; {e['clock']}); docs/engine.md"
    return [
        f"| plain decoding, batch 1, {plain['max_tokens']} new tokens | peagle's engine "
        f"{plain['peagle_tokens_per_s']:.1f} tokens/s, transformers `generate()` "
        f"{plain['transformers_tokens_per_s']:.1f} ({plain['speedup']:.2f}x) | {where} |",
        f"| drafter time per step, K={k7} against K={k1} ({d['context']}-token drafter context) | P-EAGLE "
        f"{ms['parallel'][k7] / ms['parallel'][k1]:.2f}x (K={kmax}: {d['parallel_k_max_over_k1']:.2f}x); "
        f"EAGLE-3's chain {ms['chain'][k7] / ms['chain'][k1]:.2f}x (K={kmax}: {d['chain_k_max_over_k1']:.2f}x) "
        f"| the same run |"]


def _acceptance_rows(root: Path) -> list[str]:
    runs = json.loads((root / ACCEPTANCE).read_text())
    first = (root / ACCEPTANCE_MD).read_text().splitlines()[0]  # "Measured by `CMD` on MACHINE; ..."
    command, machine = first.split("`")[1], first.split("` on ", 1)[1].split(";")[0]
    k = max(r["k"] for r in runs)
    parts = []
    for dataset in dict.fromkeys(r["dataset"] for r in runs):
        at_k = {r["method"]: r for r in runs if r["dataset"] == dataset and r["k"] == k}
        parts.append(f"{DATASET_TITLES.get(dataset, dataset)} ({at_k['peagle']['prompts']} prompts): "
                     + ", ".join(f"{METHOD_NAMES[m]} {at_k[m]['mean_acceptance_length']:.2f}"
                                 for m in ("peagle", "eagle3") if m in at_k))
    same = all(len({r["outputs_sha256"] for r in runs if r["dataset"] == ds}) == 1
               for ds in {r["dataset"] for r in runs})
    lossless = (f"every configuration of a prompt set produced the same tokens ({len(runs)} runs)" if same else
                "the configurations of a prompt set did NOT all produce the same tokens")
    return [f"| bundled heads, mean acceptance length at K={k} | {'; '.join(parts)}; {lossless} | `{ACCEPTANCE}` "
            f"(and `{ACCEPTANCE_MD}`): `{command}` ({machine}); docs/heads.md, \"Acceptance\" |"]


def _sweep_rows(root: Path, dataset: str, path: str) -> list[str]:
    report = load_report(root / path)
    runs = [RunMetrics.from_dict(r) for r in report["runs"]]
    cs = sorted({r.concurrency for r in runs})
    meta = report["meta"]

    def per_c(value) -> str:
        return " / ".join(value(c) for c in cs)

    cells = [f"no speculation {per_c(lambda c: _f(best_of(runs, 'baseline', c)[1]))}"]
    for m in [m for m in SPEC_METHODS if any(r.method == m for r in runs)]:
        best = [best_of(runs, m, c) for c in cs]
        ks = {k for k, _ in best}
        cells.append(f"{METHOD_NAMES[m]} K={ks.pop()} " + " / ".join(_f(v) for _, v in best) if len(ks) == 1 else
                     f"{METHOD_NAMES[m]} best fixed K " + " / ".join(f"{_f(v)} (K={k})" for k, v in best))
    for m in [m for m in SPEC_METHODS if any(adaptive_of(runs, m, c) for c in cs)]:
        ratios = []
        for c in cs:
            adaptive = adaptive_of(runs, m, c)
            better = max(x for x in (best_of(runs, "baseline", c)[1], best_of(runs, m, c)[1], 0.0) if x is not None)
            ratios.append(f"{adaptive.otps / better:.2f}x" if adaptive and better else "—")
        cells.append(f"{METHOD_NAMES[m]} adaptive at {' / '.join(ratios)} the better of no speculation and its best "
                     f"fixed K (per CPU second {per_c(lambda c: _x(report['table'], c, m))})")
    started = (meta.get("started") or "")[:10]
    return [f"| `peagle bench`, {DATASET_TITLES.get(dataset, dataset)}, {meta.get('num_prompts')} prompts x "
            f"{meta.get('max_tokens')} tokens, output tokens/s at concurrency {' / '.join(map(str, cs))} | "
            f"{'; '.join(cells)} | `{path}`: `{meta.get('command')}` (run by `{SWEEP_SCRIPT}`; {started}, "
            f"{meta.get('machine', {}).get('summary')}); docs/benchmarks.md |"]


def main(argv: list[str]) -> None:
    if len(argv) >= 2 and argv[0] == "--summary":
        doc = Path(argv[1])
        write_section(doc, "summary", summary(doc, argv[2:]))
    elif len(argv) == 2 and argv[0] == "--readme":
        doc = Path(argv[1])
        write_section(doc, "figures", readme_figures(doc.resolve().parent))
    elif len(argv) in (3, 4):
        results, doc = Path(argv[0]), Path(argv[1])
        prefix = results.parent.relative_to(doc.parent).as_posix() + "/"
        level = int(argv[3]) if len(argv) == 4 else 4
        write_section(doc, argv[2], results_section(load_report(results), level=level, image_prefix=prefix))
    else:
        raise SystemExit(__doc__)


if __name__ == "__main__":
    main(sys.argv[1:])
