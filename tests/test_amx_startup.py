"""Start-up where the OS refuses AMX: Linux grants a process the AMX tile state only on request (arch_prctl
ARCH_REQ_XCOMP_PERM), and a tile instruction without it dies with SIGILL (llama.cpp b11434's llama-server does, on
an Intel Xeon with AMX). peagle asks once when the kernels load and, refused, runs the next path. Here a preloaded
shim makes that request fail as a kernel without AMX support (or a sandbox's seccomp filter) would, in a fresh
process: it must still start, leave AMX out of its paths, compute correctly, and name the reason when AMX is asked
for by PEAGLE_CPU_KERNELS."""
from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from peagle.model import kernels

pytestmark = pytest.mark.skipif(not kernels.cpu_has("amx"),
                                reason="this CPU has no AMX: no tile state to refuse (the promise applies where "
                                       "the CPU has AMX)")

# The libc syscall() wrapper, interposed: the AMX permission request fails with EPERM, and says so on stderr.
SHIM = r"""
#define _GNU_SOURCE
#include <dlfcn.h>
#include <errno.h>
#include <stdarg.h>
#include <stdio.h>
#include <sys/syscall.h>
long syscall(long number, ...) {
    va_list ap;
    va_start(ap, number);
    long a = va_arg(ap, long), b = va_arg(ap, long), c = va_arg(ap, long), d = va_arg(ap, long),
         e = va_arg(ap, long), f = va_arg(ap, long);
    va_end(ap);
    if (number == SYS_arch_prctl && a == 0x1023 /* ARCH_REQ_XCOMP_PERM */) {
        fprintf(stderr, "shim: AMX tile state refused\n");
        errno = EPERM;
        return -1;
    }
    long (*real)(long, ...) = (long (*)(long, ...))dlsym(RTLD_NEXT, "syscall");
    return real(number, a, b, c, d, e, f);
}
"""

CHILD = r"""
import json, torch
from peagle.model import kernels
w = torch.randn(96, 64).bfloat16()
x = torch.randn(5, 64).bfloat16()
packed = kernels.PackedWeight.pack(w)
y = kernels.packed_linear(x, packed)
exact = x.double() @ w.double().T
from peagle.model import quant
qw = quant.QuantWeight.quantize(w.float(), "q4_0")
qy = kernels.packed_linear(x, qw)  # 5 rows: AMX int8 tiles where granted
print(json.dumps({"paths": kernels.supported_paths(), "matmul": kernels.matmul_path(),
                  "blocks": kernels.quant_path(), "blocks_ok": bool(torch.isfinite(qy.float()).all()),
                  "error": ((y.double() - exact).abs().max() / exact.abs().max()).item()}))
"""


@pytest.fixture(scope="module")
def refusing_shim(tmp_path_factory) -> Path:
    compiler = os.environ.get("CC") or shutil.which("cc") or shutil.which("gcc")
    out = tmp_path_factory.mktemp("shim") / "refuse_amx.so"
    src = out.with_suffix(".c")
    src.write_text(SHIM)
    subprocess.run([compiler, "-O2", "-fPIC", "-shared", str(src), "-o", str(out), "-ldl"], check=True)
    return out


def run_child(shim: Path, **env) -> subprocess.CompletedProcess:
    environ = {k: v for k, v in os.environ.items() if k != "PEAGLE_CPU_KERNELS"}
    environ.update(LD_PRELOAD=str(shim), PEAGLE_KERNELS_DIR=str(kernels.build_dir()), **env)
    return subprocess.run([sys.executable, "-c", CHILD], capture_output=True, text=True, env=environ, timeout=600)


def test_refused_amx_falls_back_to_the_next_path(refusing_shim):
    kernels.library()  # build once here, so the child only loads it
    r = run_child(refusing_shim)
    assert r.returncode == 0, r.stderr[-2000:]  # no SIGILL (-4)
    assert "shim: AMX tile state refused" in r.stderr  # the request was made, and refused
    got = json.loads(r.stdout.strip().splitlines()[-1])
    assert "amx" not in got["paths"] and got["paths"][0] == "avx512-bf16"
    assert got["matmul"] == "avx512-bf16"
    assert got["blocks"] == "avx512-vnni" and got["blocks_ok"]  # block products off AMX int8 tiles too
    assert got["error"] < 2 ** -7


def test_asking_for_refused_amx_names_the_paths_that_run(refusing_shim):
    r = run_child(refusing_shim, PEAGLE_CPU_KERNELS="amx")
    assert r.returncode != 0 and r.returncode != -4  # an error, not SIGILL
    assert "PEAGLE_CPU_KERNELS=amx cannot run on this machine; it runs: avx512-bf16, avx2" in r.stderr


def test_granted_amx_runs_amx():
    """Without the shim, the same CPU runs AMX (so the tests above refuse something that is really there)."""
    assert "amx" in kernels.supported_paths()
