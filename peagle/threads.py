"""How many threads peagle's processes run, and how their idle OpenMP threads wait (docs/engine.md, "Threads").

PyTorch's OpenMP runtime (libgomp on Linux, which peagle's kernels share) reads OMP_NUM_THREADS, OMP_WAIT_POLICY
and GOMP_SPINCOUNT once, when torch is first imported. `peagle/__init__.py` calls `apply_defaults()` before anything
imports torch, so that every peagle process (the `peagle` command and `import peagle`) starts with:

  OMP_NUM_THREADS=N     N = the cores this process may run on: its CPU affinity (taskset, cpusets), fewer when a
                        cgroup CPU quota (containers' --cpus) allows less, rounded down, at least 1.
  GOMP_SPINCOUNT=3000   a thread that reaches a barrier before the others spins 3,000 times (a PAUSE instruction
                        each, tens of microseconds), then sleeps. libgomp's own default spins 300,000 times
                        (milliseconds): while other processes hold a core, the spinning thread burns the time the
                        descheduled one needs, and two threads decoded 5-15x slower than one. Sleeping at once
                        (OMP_WAIT_POLICY=PASSIVE) avoids that but pays a wake-up at every barrier: on a quiet machine
                        two threads then ran the 135M model slower than one. A short spin covers the gap between one
                        parallel region and the next on a quiet machine and gives up the core soon on a busy one
                        (docs/engine.md, "Threads", has the measurements). Set only where the user set neither
                        GOMP_SPINCOUNT nor OMP_WAIT_POLICY.

The default count is where the engine starts: it then runs each decode step on 1 to N threads, whichever its
measured step times say is faster now (peagle/engine/thread_count.py), for as long as the count stays peagle's
(`adaptive`). Nothing here overrides a value the user set in the environment; `--threads` on `peagle serve`,
`generate` and `bench` sets the count after start-up (`set_threads`), and either keeps it fixed. Processes peagle
starts inherit the values, and the names peagle filled in are recorded with their values in PEAGLE_THREAD_DEFAULTS,
so a peagle child decides its own defaults again instead of taking them for a user's choice (a value changed since,
e.g. by `peagle bench --threads` for its servers, is a choice).

This module must not import torch at module level: it runs before torch's OpenMP runtime is loaded.
"""
from __future__ import annotations

import math
import os
import sys
from pathlib import Path

# How long a thread waiting at a barrier spins before it sleeps, in libgomp's iterations (a PAUSE instruction each).
SPIN_COUNT = 3000
DEFAULTS_ENV = "PEAGLE_THREAD_DEFAULTS"  # NAME=VALUE,... that peagle filled in (not the user)
_WAIT_VARS = ("OMP_WAIT_POLICY", "GOMP_SPINCOUNT")
_VARS = ("OMP_NUM_THREADS", *_WAIT_VARS)
# where cgroup v2 (cpu.max) and v1 (cpu/cpu.cfs_quota_us) keep CPU quotas
_CGROUP_ROOT = Path("/sys/fs/cgroup")

# source: who chose the count; count: the count peagle set last (the engine may change it: adaptive())
_state = {"source": None, "torch_first": False, "user": {}, "count": None}


def affinity_cores() -> int:
    """The CPUs this process may run on (its affinity mask; os.cpu_count() where the OS has no such call)."""
    try:
        return max(1, len(os.sched_getaffinity(0)))
    except (AttributeError, OSError):
        return max(1, os.cpu_count() or 1)


def cpu_quota(root: Path = _CGROUP_ROOT, proc_cgroup: Path = Path("/proc/self/cgroup")) -> float | None:
    """CPUs' worth of time the process's cgroup may use per period (a container's --cpus), or None without a
    quota. Reads cgroup v2's cpu.max, else v1's cpu.cfs_quota_us / cpu.cfs_period_us; a few small files."""
    candidates: list[Path] = []
    try:
        for line in proc_cgroup.read_text().splitlines():
            _, controllers, path = line.split(":", 2)
            rel = path.lstrip("/")
            if controllers == "":
                candidates.append(root / rel / "cpu.max")
            elif "cpu" in controllers.split(","):
                for mount in ("cpu", "cpu,cpuacct", "cpuacct,cpu"):
                    candidates.append(root / mount / rel / "cpu.cfs_quota_us")
    except (OSError, ValueError):
        pass
    candidates += [root / "cpu.max", root / "cpu" / "cpu.cfs_quota_us", root / "cpu,cpuacct" / "cpu.cfs_quota_us"]
    for f in candidates:
        try:
            if f.name == "cpu.max":
                quota, period = f.read_text().split()[:2]
                if quota == "max":
                    return None
                return int(quota) / int(period)
            quota = int(f.read_text())
            if quota <= 0:  # -1: no quota
                return None
            return quota / int(f.with_name("cpu.cfs_period_us").read_text())
        except (OSError, ValueError):
            continue
    return None


def default_threads() -> int:
    """The thread count peagle starts with: the cores in the affinity mask, fewer if a CPU quota allows fewer
    (rounded down, at least one)."""
    cores = affinity_cores()
    quota = cpu_quota()
    if quota is not None:
        cores = min(cores, max(1, math.floor(quota)))
    return cores


def apply_defaults(environ: dict | None = None) -> dict:
    """Fill in OMP_NUM_THREADS, and GOMP_SPINCOUNT where the user set neither it nor OMP_WAIT_POLICY; return what
    the user set. A value peagle filled in for a parent process (recorded in PEAGLE_THREAD_DEFAULTS, and still
    unchanged) is decided again. Call before torch is imported: torch's OpenMP reads the environment once, at its
    import. Where torch came first, the thread count is still applied (torch.set_num_threads); the wait cannot be."""
    env = os.environ if environ is None else environ
    inherited = dict(item.split("=", 1) for item in env.get(DEFAULTS_ENV, "").split(",") if "=" in item)
    user = {v: env[v] for v in _VARS if v in env and inherited.get(v) != env[v]}
    for v in _VARS:
        if v not in user and v in inherited:
            env.pop(v, None)  # the parent's default, decided again below
    filled = {}
    if "OMP_NUM_THREADS" not in user:
        env["OMP_NUM_THREADS"] = filled["OMP_NUM_THREADS"] = str(default_threads())
    if not any(v in user for v in _WAIT_VARS):
        env["GOMP_SPINCOUNT"] = filled["GOMP_SPINCOUNT"] = str(SPIN_COUNT)
    if filled:
        env[DEFAULTS_ENV] = ",".join(f"{k}={v}" for k, v in filled.items())
    else:
        env.pop(DEFAULTS_ENV, None)
    if environ is None:
        _state["user"] = user
        _state["torch_first"] = "torch" in sys.modules
        _state["source"] = "OMP_NUM_THREADS" if "OMP_NUM_THREADS" in user else "default"
        _state["count"] = int(filled["OMP_NUM_THREADS"]) if "OMP_NUM_THREADS" in filled else None
        if _state["torch_first"] and "OMP_NUM_THREADS" in filled:
            sys.modules["torch"].set_num_threads(int(filled["OMP_NUM_THREADS"]))
    return user


THREADS_HELP = ("CPU threads for the forward, fixed (default: up to the cores this process may use, from its CPU "
                "affinity and any cgroup CPU quota, fewer while measured steps run faster on fewer because other "
                "work holds cores; OMP_NUM_THREADS fixes the count too). A thread that waits for the others "
                f"spins briefly, then sleeps (GOMP_SPINCOUNT={SPIN_COUNT} unless it or OMP_WAIT_POLICY is set), so "
                "two threads beside other busy processes do not collapse (docs/engine.md, \"Threads\")")


def add_threads_arg(parser) -> None:
    """`--threads N` (range-checked), for the commands that run a model."""
    from peagle import cli_args

    parser.add_argument("--threads", type=cli_args.threads, default=None, help=THREADS_HELP)


def apply_threads_arg(args) -> None:
    """Apply `--threads` where it was given."""
    if getattr(args, "threads", None):
        set_threads(args.threads)


def set_threads(n: int, source: str = "--threads") -> None:
    """Run torch (and peagle's kernels, which ask torch) on `n` threads from now on; `source` "default" leaves the
    count peagle's to change step by step again (adaptive())."""
    import torch

    torch.set_num_threads(n)
    _state["source"] = source
    _state["count"] = n


def adaptive() -> bool:
    """Whether the count is peagle's to change step by step (peagle/engine/thread_count.py): it is the default, and
    nothing has set another since (OMP_NUM_THREADS, `--threads`, torch.set_num_threads)."""
    import torch

    return _state["source"] == "default" and torch.get_num_threads() == _state["count"]


def set_adaptive_count(n: int) -> None:
    """Run the next steps on `n` threads, keeping the count peagle's to change."""
    import torch

    if torch.get_num_threads() != n:
        torch.set_num_threads(n)
    _state["count"] = n


def wait_settings() -> str:
    """How libgomp's waiting threads wait, as it read the environment: 'GOMP_SPINCOUNT=3000', 'OMP_WAIT_POLICY=PASSIVE',
    or 'libgomp default' (spin about 300,000 times, then sleep)."""
    torch_first = _state["torch_first"]
    seen = _state["user"] if torch_first else os.environ  # what was in the environment when torch loaded OpenMP
    text = ", ".join(f"{v}={seen[v].upper() if v == 'OMP_WAIT_POLICY' else seen[v]}" for v in _WAIT_VARS if v in seen)
    return text or ("libgomp default (torch imported before peagle)" if torch_first else "libgomp default")


def summary() -> dict:
    """The threads facts for stats, /v1/models and logs: the count and where it came from, how waiting threads
    wait, the cores this process may use."""
    import torch

    quota = cpu_quota()
    return {"threads": torch.get_num_threads(), "threads_from": _state["source"] or "torch default",
            "omp_wait": wait_settings(), "cores": affinity_cores(),
            **({"cpu_quota": round(quota, 2)} if quota is not None else {})}


def describe() -> str:
    """One line for logs: '2 threads (default; GOMP_SPINCOUNT=3000; 2 cores)'."""
    s = summary()
    quota = f", CPU quota {s['cpu_quota']:g}" if "cpu_quota" in s else ""
    return (f"{s['threads']} thread{'s' if s['threads'] != 1 else ''} ({s['threads_from']}; {s['omp_wait']}; "
            f"{s['cores']} cores{quota})")
