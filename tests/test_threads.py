"""Thread defaults (peagle/threads.py): set before torch's OpenMP reads them, a user's values win, and --threads is
range-checked and applied. No timings here: benchmarks/threads.py measures them (docs/engine.md, "Threads")."""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from peagle import cli_args, threads

REPO = Path(__file__).resolve().parents[1]
VARS = ("OMP_NUM_THREADS", "OMP_WAIT_POLICY", "GOMP_SPINCOUNT", "OMP_DISPLAY_ENV", threads.DEFAULTS_ENV)
# What libgomp itself says it read (OMP_DISPLAY_ENV=VERBOSE prints its settings to stderr when torch loads it), then
# what torch and peagle report.
PROBE = ("import peagle, torch; from peagle import threads; s = threads.summary(); "
         "print(torch.get_num_threads(), s['threads_from'], s['omp_wait'], sep='|')")


def run_python(code: str, **env) -> tuple[str, dict[str, str]]:
    """Run `code` in a fresh interpreter with the OMP variables cleared and `env` set; returns its stdout and the
    settings libgomp displayed."""
    clean = {k: v for k, v in os.environ.items() if k not in VARS}
    r = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, timeout=120,
                       env={**clean, "OMP_DISPLAY_ENV": "VERBOSE", **env})
    assert r.returncode == 0, r.stderr
    shown = {}
    for line in r.stderr.splitlines():
        name, eq, value = line.strip().partition(" = ")
        if eq:
            shown[name] = value.strip("'")
    return r.stdout.strip(), shown


def gomp_shown(shown: dict) -> bool:
    return "GOMP_SPINCOUNT" in shown  # torch's OpenMP here is libgomp, which names its spin count


def test_defaults_reach_openmp_before_torch_reads_them():
    out, shown = run_python(PROBE)
    n = threads.default_threads()
    assert out == f"{n}|default|GOMP_SPINCOUNT={threads.SPIN_COUNT}"
    if gomp_shown(shown):  # libgomp read them at torch's import (its own default spins 300,000 times)
        assert shown["GOMP_SPINCOUNT"] == str(threads.SPIN_COUNT) and shown["OMP_NUM_THREADS"] == str(n)


@pytest.mark.parametrize("env, spins", [
    ({"OMP_NUM_THREADS": "1", "OMP_WAIT_POLICY": "active"}, "30000000000"),  # libgomp's spin for ACTIVE
    ({"OMP_NUM_THREADS": "1", "OMP_WAIT_POLICY": "passive"}, "0"),
    ({"OMP_NUM_THREADS": "1", "GOMP_SPINCOUNT": "77"}, "77"),
])
def test_a_users_values_win(env, spins):
    out, shown = run_python(PROBE, **env)
    wait = ", ".join(f"{k}={v.upper()}" for k, v in env.items() if k != "OMP_NUM_THREADS")
    assert out == f"1|OMP_NUM_THREADS|{wait}"
    if gomp_shown(shown):
        assert shown["GOMP_SPINCOUNT"] == spins and shown["OMP_NUM_THREADS"] == "1"


def test_torch_imported_first_keeps_the_count_and_says_the_wait_came_too_late():
    out, shown = run_python(PROBE.replace("import peagle, torch", "import torch, peagle"))
    assert out == f"{threads.default_threads()}|default|libgomp default (torch imported before peagle)"
    if gomp_shown(shown):
        assert shown["GOMP_SPINCOUNT"] == "300000"  # libgomp's own


def test_a_child_decides_again_unless_its_value_was_changed():
    env = {}
    assert threads.apply_defaults(env) == {}
    assert env["GOMP_SPINCOUNT"] == str(threads.SPIN_COUNT) and env["OMP_NUM_THREADS"] == str(threads.default_threads())
    child = dict(env)
    assert threads.apply_defaults(child) == {} and child == env  # what peagle filled in is not a user's choice
    child["OMP_NUM_THREADS"] = "7"  # e.g. `peagle bench --threads 7` for its servers
    assert threads.apply_defaults(child) == {"OMP_NUM_THREADS": "7"}
    assert child["OMP_NUM_THREADS"] == "7" and child[threads.DEFAULTS_ENV] == f"GOMP_SPINCOUNT={threads.SPIN_COUNT}"
    child = {**env, "OMP_WAIT_POLICY": "passive"}  # a user's policy: the parent's spin count must not override it
    assert threads.apply_defaults(child) == {"OMP_WAIT_POLICY": "passive"} and "GOMP_SPINCOUNT" not in child
    user = {"OMP_NUM_THREADS": "3", "GOMP_SPINCOUNT": "10"}
    assert threads.apply_defaults(user) == {"OMP_NUM_THREADS": "3", "GOMP_SPINCOUNT": "10"}
    assert threads.DEFAULTS_ENV not in user and "OMP_WAIT_POLICY" not in user


@pytest.mark.parametrize("files, quota", [
    ({"cpu.max": "max 100000\n"}, None),
    ({"cpu.max": "150000 100000\n"}, 1.5),
    ({"cpu/cpu.cfs_quota_us": "-1\n", "cpu/cpu.cfs_period_us": "100000\n"}, None),
    ({"cpu/cpu.cfs_quota_us": "50000\n", "cpu/cpu.cfs_period_us": "100000\n"}, 0.5),
    ({}, None),
])
def test_cpu_quota_from_cgroup_files(tmp_path, files, quota):
    for name, text in files.items():
        (tmp_path / name).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / name).write_text(text)
    proc = tmp_path / "proc-cgroup"
    proc.write_text("0::/\n" if "cpu.max" in files else "1:cpu,cpuacct:/\n")
    assert threads.cpu_quota(tmp_path, proc) == quota


def test_default_threads_follow_affinity_and_quota(monkeypatch):
    monkeypatch.setattr(threads, "affinity_cores", lambda: 8)
    for quota, n in ((None, 8), (16.0, 8), (2.5, 2), (0.3, 1)):
        monkeypatch.setattr(threads, "cpu_quota", lambda q=quota: q)
        assert threads.default_threads() == n


@pytest.mark.parametrize("module", ["peagle.serve.cli", "peagle.engine.generate_cmd", "peagle.bench.cli"])
def test_threads_flag_is_range_checked(module, capsys):
    import importlib

    parser = argparse.ArgumentParser()
    importlib.import_module(module).register("x", parser)
    assert parser.parse_args(["--threads", "1"]).threads == 1
    assert parser.parse_args([]).threads is None
    for bad in ("0", "-1", "two", "1025"):
        with pytest.raises(SystemExit) as e:
            parser.parse_args(["--threads", bad])
        assert e.value.code == 2
        assert "--threads" in capsys.readouterr().err
    assert cli_args.threads.lo == 1


def test_threads_flag_is_applied_and_reported():
    import torch

    before = torch.get_num_threads()
    try:
        threads.apply_threads_arg(argparse.Namespace(threads=1))
        assert torch.get_num_threads() == 1
        s = threads.summary()
        assert s["threads"] == 1 and s["threads_from"] == "--threads"
        assert threads.describe().startswith("1 thread (--threads; ")
        threads.apply_threads_arg(argparse.Namespace(threads=None))  # not given: nothing changes
        assert torch.get_num_threads() == 1
    finally:
        threads.set_threads(before, "default")


def test_generate_applies_and_reports_the_flag(capsys):
    import torch

    from peagle.cli import main

    before = torch.get_num_threads()
    try:
        assert main(["generate", "--threads", "1", "--no-speculation", "--max-tokens", "2", "--json", "hi"]) == 0
        assert torch.get_num_threads() == 1
    finally:
        threads.set_threads(before, "default")
    result = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert result["threads"] == 1 and result["threads_from"] == "--threads"
    assert result["cores"] == threads.affinity_cores() and result["omp_wait"]
