"""The figures in README.md and docs/benchmarks.md are generated from the committed result files by
benchmarks/update_docs.py: a hand edit of a generated block, or a result file changed without regenerating, fails
here. Regenerate with the commands in that script's docstring."""
from __future__ import annotations

import importlib.util
import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent


def _update_docs():
    spec = importlib.util.spec_from_file_location("update_docs", ROOT / "benchmarks" / "update_docs.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _section(doc: Path, name: str) -> str:
    text = doc.read_text()
    begin, end = f"<!-- bench:{name}:begin -->\n", f"\n<!-- bench:{name}:end -->"
    assert text.count(begin) == 1 and text.count(end) == 1, f"{doc.name} needs one generated section {name!r}"
    return text.split(begin, 1)[1].split(end, 1)[0]


def test_readme_figures_are_generated_from_the_committed_results():
    ud = _update_docs()
    for source in ud.README_SOURCES:
        assert (ROOT / source).is_file(), f"{source} is read by the README's table but is not there"
    assert _section(ROOT / "README.md", "figures") == ud.readme_figures(ROOT), \
        "README.md's figures differ from their result files: python3 benchmarks/update_docs.py --readme README.md"


def test_readme_states_no_measured_ratio_outside_the_generated_table():
    text = (ROOT / "README.md").read_text()
    outside = text.split("<!-- bench:figures:begin -->")[0] + text.split("<!-- bench:figures:end -->")[1]
    assert not re.findall(r"\d+\.\d+x|tok(?:en)?s/s", outside), \
        "a figure in README.md outside the generated table: put it in the doc that owns its run and point there"


@pytest.mark.parametrize("section,level", [("humaneval", 4), ("mtbench", 4), ("counting", 4), ("results", 3)])
def test_benchmark_sections_are_generated_from_their_results(section, level):
    ud = _update_docs()
    doc = ROOT / "docs" / "benchmarks.md"
    results = doc.parent / "benchmarks" / section / "results.json" if section != "results" else \
        doc.parent / "benchmarks" / "results.json"
    prefix = results.parent.relative_to(doc.parent).as_posix() + "/"
    assert _section(doc, section) == ud.results_section(ud.load_report(results), level=level, image_prefix=prefix)


def test_benchmark_summary_is_generated_from_the_sweeps():
    ud = _update_docs()
    doc = ROOT / "docs" / "benchmarks.md"
    assert _section(doc, "summary") == ud.summary(doc, ["humaneval", "mtbench", "counting"])
