"""Resident memory of the engine per weight format: each configuration loads in a fresh process, and the figure is
that process's resident set (VmRSS) after loading, less what it held once torch, transformers and the kernels were
imported (the same for every format).

    python benchmarks/resident_memory.py
"""
from __future__ import annotations

import json
import os
import subprocess
import sys

CHILD = r"""
import json, sys
import torch
torch.set_num_threads(1)
from peagle.model import kernels
from peagle.engine import LLMEngine
import transformers  # noqa: F401

def rss_mb():
    return next(int(l.split()[1]) for l in open("/proc/self/status") if l.startswith("VmRSS")) / 1024

kernels.library()
base = rss_mb()
model, spec = sys.argv[1], sys.argv[2] == "spec"
cfg = {"model": "smollm2-135m-peagle", "method": "eagle3", "num_speculative_tokens": 3, "parallel_drafting": True}
engine = LLMEngine.from_pretrained(None if model == "bf16" else model, cfg if spec else None, max_num_seqs=1,
                                   max_model_len=1024, speculation_policy="fixed")
print(json.dumps({"weights": engine.kernels["weights"], "mb": round(rss_mb() - base)}))
"""


def main() -> None:
    rows = []
    for model in ("bf16", "smollm2-q4_1"):
        for spec in ("plain", "spec"):
            out = subprocess.run([sys.executable, "-c", CHILD, model, spec], capture_output=True, text=True,
                                 check=True, env={"OMP_NUM_THREADS": "1", **os.environ})
            row = json.loads(out.stdout.strip().splitlines()[-1])
            rows.append((model, spec, row))
            print(f"{model:>14} {'with the P-EAGLE head' if spec == 'spec' else 'target only':>22}: "
                  f"{row['mb']} MB ({row['weights']})", flush=True)
    for spec in ("plain", "spec"):
        bf16 = next(r["mb"] for m, s, r in rows if m == "bf16" and s == spec)
        q = next(r["mb"] for m, s, r in rows if m != "bf16" and s == spec)
        print(f"{'with the head' if spec == 'spec' else 'target only'}: the 4-bit engine holds {q / bf16:.0%} of "
              "the bf16 one's memory")


if __name__ == "__main__":
    main()
