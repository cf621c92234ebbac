#!/usr/bin/env bash
# The sweep behind docs/benchmarks.md: HumanEval on the embedded SmolLM2-135M-Instruct, no speculation vs EAGLE-3
# vs P-EAGLE at K = 3, 7, 11 and concurrency 1, 4, 8, plus transformers' generate() and prompt lookup, every
# configuration served by its own `peagle serve` subprocess (HTTP in the loop).
#
#   benchmarks/run_sweep.sh                 # about 35 min on 2 CPU cores; prints an estimate before it starts
#   nohup benchmarks/run_sweep.sh >/dev/null 2>&1 &   then   tail -f ~/.cache/peagle/bench/humaneval-sweep.log
#
# Heads: the bundled ones (peagle/heads/smollm2-135m-{peagle,eagle3}) when they exist; for a method without one,
# --random-heads creates an UNTRAINED head and the report says so. Rerun this script once trained heads land.
# THREADS=1 (default) keeps torch to one thread per process: on a 2-core machine shared with other work, two
# OpenMP threads spend most of their time waiting for each other (10x slower steps were measured). THREADS=2 on a
# quiet machine. Extra arguments go to `peagle bench` (e.g. --offline, --num-prompts 16).
set -euo pipefail
cd "$(dirname "$0")/.."
OUT="${OUT:-${PEAGLE_HOME:-$HOME/.cache/peagle}/bench/humaneval-sweep}"
LOG="${LOG:-$OUT.log}"
THREADS="${THREADS:-1}"
DOCS=docs/benchmarks
mkdir -p "$OUT" "$DOCS"
python3 -m peagle.cli bench \
  --dataset humaneval --num-prompts 8 --max-tokens 80 \
  --concurrency 1,4,8 --k 3,7,11 \
  --methods baseline,eagle3,peagle,transformers,transformers-pld \
  --random-heads --threads "$THREADS" --out "$OUT" "$@" 2>&1 | tee "$LOG"
cp "$OUT"/results.md "$OUT"/results.json "$OUT"/*.png "$DOCS"/
python3 benchmarks/update_docs.py "$DOCS/results.json" docs/benchmarks.md
echo "docs/benchmarks.md updated from $OUT; revise its reading of the results by hand."
