#!/usr/bin/env bash
# A head that accepts a lot, to show what the adaptive speculation policy does when speculation pays: the bundled
# P-EAGLE head fine-tuned briefly on a narrow task (counting, answers written by SmolLM2 itself), then benchmarked
# on held-out counting prompts (docs/benchmarks.md, "A head that accepts a lot").
#
#   bash benchmarks/narrow_head.sh        # about 3 min of data, 35 min of training, 8 min of bench on 2 busy cores
set -euo pipefail
cd "$(dirname "$0")/.."
WORK="${WORK:-runs/counting}"
THREADS="${THREADS:-1}"
export OMP_NUM_THREADS="$THREADS"
python3 benchmarks/counting_prompts.py --out "$WORK"
[ -f "$WORK/data/peagle_data.json" ] ||
  peagle data prepare --input "$WORK/train.jsonl" --out "$WORK/data" --regenerate --max-new-tokens 160 \
    --max-model-len 512 --batch-size 32 --max-num-seqs 16
# Two stages from the bundled head: 48 steps at lr 1e-3, then 96 more at 5e-4 (about 2 + 4 passes over the data).
COMMON=(--method peagle --num-layers 2 --num-depths 12 --data "$WORK/data" --draft-vocab-size 8192 --batch-size 8
        --warmup-ratio 0.05 --min-lr-ratio 0.1 --max-seq-len 512 --save-every 32 --teacher-cache "$WORK/teacher-cache"
        --eval-fraction 0)
[ -f "$WORK/head1/model.safetensors" ] ||
  peagle train "${COMMON[@]}" --init-head smollm2-135m-peagle --out "$WORK/head1" --max-steps 48 --lr 1e-3
[ -f "$WORK/head/model.safetensors" ] ||
  peagle train "${COMMON[@]}" --init-head "$WORK/head1" --out "$WORK/head" --max-steps 96 --lr 5e-4
DOCS=docs/benchmarks/counting
mkdir -p "$DOCS"
python3 -m peagle.cli bench --dataset "custom:$WORK/bench.jsonl" --num-prompts 8 --max-tokens 64 \
  --concurrency 1,4,8 --k 3,7,adaptive --methods baseline,peagle --peagle-head "$WORK/head" \
  --threads "$THREADS" --out "$WORK/bench" "$@" 2>&1 | tee "$WORK/bench.log"
cp "$WORK"/bench/results.md "$WORK"/bench/results.json "$WORK"/bench/*.png "$DOCS"/
python3 benchmarks/update_docs.py "$DOCS/results.json" docs/benchmarks.md counting
python3 benchmarks/update_docs.py --summary docs/benchmarks.md humaneval mtbench counting
