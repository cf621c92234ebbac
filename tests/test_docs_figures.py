"""The figures in README.md and the summary in docs/benchmarks.md are generated from the committed result files by
benchmarks/update_docs.py: a hand edit of a generated block, or a result file changed without regenerating, fails
here, as does a README link to a doc section that is not there. Regenerate with the commands in that script's
docstring."""
from __future__ import annotations

import importlib.util
import re
from pathlib import Path

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


def test_readme_figures_are_short():
    rows = [r for r in _update_docs().readme_figures(ROOT).splitlines() if r.startswith("| ") and "---" not in r]
    for row in rows[1:]:
        cells = [c.strip() for c in row.strip("|").split(" | ")]
        assert len(cells) == 3 and all(len(c) <= 100 for c in cells[:2]), f"a README figure's cell is long: {row}"
        assert cells[2].startswith("[") and "](docs/" in cells[2], f"a README figure without its doc's link: {row}"


def test_readme_figures_link_to_sections_that_exist():
    ud = _update_docs()
    for doc, heading in ud.OWNERS.values():
        headings = re.findall(r"^#+ (.+)$", (ROOT / doc).read_text(), flags=re.M)
        assert heading in headings, f"README's figures link to {doc}, {heading!r}, which has no such heading"
    assert ud.anchor("The adaptive policy against fixed K and no speculation") == \
        "the-adaptive-policy-against-fixed-k-and-no-speculation"
    assert ud.anchor("Plain decoding: peagle's engine vs `generate()`") == "plain-decoding-peagles-engine-vs-generate"


def test_readme_states_no_measured_ratio_outside_the_generated_table():
    text = (ROOT / "README.md").read_text()
    outside = text.split("<!-- bench:figures:begin -->")[0] + text.split("<!-- bench:figures:end -->")[1]
    assert not re.findall(r"\d+\.\d+x|tok(?:en)?s/s", outside), \
        "a figure in README.md outside the generated table: put it in the doc that owns its run and point there"


def test_benchmark_summary_is_generated_from_the_sweeps():
    ud = _update_docs()
    doc = ROOT / "docs" / "benchmarks.md"
    assert _section(doc, "summary") == ud.summary(doc, ["humaneval", "mtbench", "counting"])


DOCS = sorted((ROOT / "docs").glob("*.md"))


def test_the_manual_stays_a_manual():
    """README.md is a 3-minute read; no top-level doc grows past an hour's reading or keeps a dated heading (the
    history is in git); no doc points at files outside the repository or at issue numbers."""
    assert len((ROOT / "README.md").read_text().splitlines()) <= 80, "README.md is over 80 lines"
    for doc in [ROOT / "README.md", *DOCS]:
        text = doc.read_text()
        assert len(text.split()) <= 6000 or doc.name == "README.md", f"{doc.name} is over 6,000 words"
        dated = re.findall(r"^#+ .*\d{4}-\d{2}-\d{2}.*$", text, flags=re.M)
        assert not dated, f"{doc.name} has dated headings: {dated}"
        assert "../shared" not in text and not re.search(r"\bissue #?\d+", text, flags=re.I), \
            f"{doc.name} points outside the repository or at an issue number"


def test_every_tool_the_docs_name_is_there():
    """A script or module the manual names exists (one only in git history is named with `git show REV:`)."""
    ours = {p.name for d in ("peagle", "benchmarks", "scripts", "tests", "docker") for p in (ROOT / d).rglob("*")
            if p.suffix in (".py", ".sh")}
    others = {"convert_hf_to_gguf.py"}  # llama.cpp's
    for doc in [ROOT / "README.md", *DOCS]:
        text = re.sub(r"git show [0-9a-f]+:\S+", "", doc.read_text())
        for path in sorted(set(re.findall(r"\b(?:benchmarks|scripts)/[\w./-]+\.(?:py|sh)\b", text))):
            assert (ROOT / path).is_file(), f"{doc.name} names {path}, which is not in the repository"
        for name in sorted(set(re.findall(r"\b[\w-]+\.(?:py|sh)\b", text)) - others):
            assert name in ours, f"{doc.name} names {name}, which is not in the repository"


def test_relative_links_resolve():
    for doc in [ROOT / "README.md", *DOCS]:
        for target in re.findall(r"\]\(([^)#\s]+)(?:#[^)]*)?\)", doc.read_text()):
            if not target.startswith(("http://", "https://")):
                assert (doc.parent / target).exists(), f"{doc.name} links to {target}, which is not there"
