#!/usr/bin/env bash
# The sweeps behind docs/benchmarks.md: no speculation, EAGLE-3 and P-EAGLE at K = 3 and 7 and under the adaptive
# speculation policy (K from 0 up to 7 every step), at concurrency 1, 4 and 8, with the bundled heads, on HumanEval
# and MT-Bench; every configuration served by its own `peagle serve` subprocess (HTTP in the loop).
#
#   bash benchmarks/run_sweep.sh                 # about 15 min on 2 CPU cores (a progress bar shows the time left)
#   DATASETS=mtbench bash benchmarks/run_sweep.sh --num-prompts 16      # one prompt set; extra args go to bench
#
# THREADS=1 (default) keeps torch to one thread per process: on a 2-core machine shared with other work, two
# OpenMP threads spend most of their time waiting for each other (10x slower steps were measured). THREADS=2 on a
# quiet machine.
set -euo pipefail
cd "$(dirname "$0")/.."
ROOT="${ROOT:-${PEAGLE_HOME:-$HOME/.cache/peagle}/bench}"
THREADS="${THREADS:-1}"
for DATASET in ${DATASETS:-humaneval mtbench}; do
  OUT="$ROOT/$DATASET-sweep"
  DOCS="docs/benchmarks/$DATASET"
  mkdir -p "$OUT" "$DOCS"
  python3 -m peagle.cli bench \
    --dataset "$DATASET" --num-prompts 8 --max-tokens 64 \
    --concurrency 1,4,8 --k 3,7,adaptive --methods baseline,eagle3,peagle \
    --threads "$THREADS" --out "$OUT" "$@" 2>&1 | tee "$OUT.log"
  cp "$OUT"/results.md "$OUT"/results.json "$OUT"/*.png "$DOCS"/
done
python3 benchmarks/update_docs.py --summary docs/benchmarks.md humaneval mtbench counting
python3 benchmarks/update_docs.py --readme README.md
echo "docs/benchmarks.md and README.md updated; revise the reading of the results by hand."
