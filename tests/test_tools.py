"""Every script in benchmarks/ and scripts/ still starts: each Python entry and subcommand answers --help, each shell
script parses, and the cheap ones run once on a tiny random model (their figures are not checked, only that they
are produced); the rest run in the test named beside them. A script added without a line here fails the first
test, so none rots unseen."""
from __future__ import annotations

import json
import runpy
import subprocess
import sys
from pathlib import Path

import pytest

from tests.conftest import needs_native_kernels

ROOT = Path(__file__).resolve().parent.parent
# Python entries -> their subcommands (None: no subcommands), each run with --help
HELP = {
    "benchmarks/ab.py": None, "benchmarks/acceptance.py": None, "benchmarks/engine_decode.py": None,
    "benchmarks/micro.py": ["quant", "forward", "matmul", "verify", "suffix", "accuracy", "memory"],
    "benchmarks/prefix_cache.py": None, "benchmarks/serve.py": ["http", "hostile", "gap", "logprobs", "memory", "soak", "restart"],
    "benchmarks/structured_outputs.py": None, "benchmarks/training.py": ["throughput", "memory", "regen"],
    "benchmarks/perplexity.py": None, "benchmarks/threads.py": None,
    "benchmarks/vs_llama_cpp.py": None, "scripts/bundle_head.py": None, "scripts/device_check.py": None,
    "scripts/startup_phases.py": None,
    "scripts/head_data.py": ["sharegpt", "code", "self", "mix", "split"],
}
# Run by other tests (or, for the shell scripts, parsed here and run as the docs say)
ELSEWHERE = {
    "benchmarks/update_docs.py": "tests/test_docs_figures.py", "scripts/gpu_dry_run_inputs.py": "tests/test_gpu_train.py",
}
SHELL = ["benchmarks/build_llama_cpp.sh", "benchmarks/run_sweep.sh", "scripts/device_check.sh", "scripts/gpu_train.sh",
         "scripts/setup.sh", "scripts/train_heads.sh"]


def test_every_tool_is_exercised_and_the_folders_stay_small():
    tools = {f"{d}/{p.name}" for d in ("benchmarks", "scripts") for p in (ROOT / d).iterdir() if p.is_file()}
    assert tools == set(HELP) | set(ELSEWHERE) | set(SHELL), "give a new script a line in tests/test_tools.py"
    # 14: each measurement that needs processes of its own (quality per kernel path, threads beside busy loops) is a
    # script; the rest are micro.py's subcommands
    assert sum(t.startswith("benchmarks/") for t in tools) <= 14 and sum(t.startswith("scripts/") for t in tools) <= 10
    for test in ELSEWHERE.values():
        assert (ROOT / test).exists()


def run_script(path: str, argv: list[str], monkeypatch) -> None:
    """`python3 path argv...` in this process (the imports are already paid for)."""
    monkeypatch.setattr(sys, "argv", [str(ROOT / path), *argv])
    monkeypatch.syspath_prepend(str((ROOT / path).parent))
    runpy.run_path(str(ROOT / path), run_name="__main__")


@pytest.mark.parametrize("path, sub", [(p, s) for p, subs in HELP.items() for s in (subs or [None])])
def test_help(path, sub, monkeypatch, capsys):
    with pytest.raises(SystemExit) as done:
        run_script(path, [*([sub] if sub else []), "--help"], monkeypatch)
    assert done.value.code == 0
    assert "usage:" in capsys.readouterr().out


@pytest.mark.parametrize("path", SHELL)
def test_shell_scripts_parse(path):
    subprocess.run(["bash", "-n", str(ROOT / path)], check=True)


@needs_native_kernels
def test_micro_quant_forward_and_verify_run_on_a_tiny_model(tiny_llama, one_thread, monkeypatch, capsys):
    run_script("benchmarks/micro.py", ["quant", "--formats", "q4_0", "q8_0", "--rows", "1", "4", "--shape", "64", "64",
                                       "--pool-mb", "1", "--calls", "2", "--repeats", "1"], monkeypatch)
    out = capsys.readouterr().out
    assert "| q4_0 | 4 |" in out and "| q8_0 | 1 |" in out
    run_script("benchmarks/micro.py", ["forward", "--model", str(tiny_llama), "--formats", "bf16", "q8_0", "--rows",
                                       "1", "2", "--context", "8", "--iters", "1", "--prefill", "8"], monkeypatch)
    out = capsys.readouterr().out
    assert "| bf16 |" in out and "| q8_0 |" in out and "prefill of 8 tokens" in out
    run_script("benchmarks/micro.py", ["verify", "--model", str(tiny_llama), "--batch", "2", "--windows", "1",
                                       "--context", "8", "--repeats", "1"], monkeypatch)
    assert json.loads(capsys.readouterr().out.strip().splitlines()[-1])[0]["window"] == 1


@needs_native_kernels
def test_ab_interleaves_configurations_and_checks_them_lossless(tiny_chat_llama, one_thread, monkeypatch, capsys,
                                                               tmp_path):
    run_script("benchmarks/ab.py", ["proposers", "--configs", "none,suffix,ngram", "--model", str(tiny_chat_llama),
                                    "--datasets", "humaneval", "--num-prompts", "2", "--max-tokens", "6",
                                    "--out", str(tmp_path / "ab.json")], monkeypatch)
    rows = json.loads((tmp_path / "ab.json").read_text())["results"]["humaneval"]
    assert list(rows) == ["none", "suffix", "ngram"] and all(r["tokens"] > 0 for r in rows.values())
    assert "| suffix |" in capsys.readouterr().out
    with pytest.raises(SystemExit, match="unknown configuration"):
        run_script("benchmarks/ab.py", ["heads", "--configs", "none,medusa-3"], monkeypatch)


def test_head_data_mix_runs(tmp_path, monkeypatch):
    files = []
    for name in ("a", "b"):
        files.append(tmp_path / f"{name}.jsonl")
        files[-1].write_text("".join(json.dumps({"id": f"{name}{i}", "messages": []}) + "\n" for i in range(5)))
    run_script("scripts/head_data.py", ["mix", "--inputs", *map(str, files), "--out", str(tmp_path / "out.jsonl")],
               monkeypatch)
    assert len((tmp_path / "out.jsonl").read_text().splitlines()) == 10
