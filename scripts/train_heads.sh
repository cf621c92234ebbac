#!/usr/bin/env bash
# Reproduce the bundled SmolLM2 heads (peagle/heads/smollm2-135m-{peagle,eagle3}) from scratch; docs/heads.md says
# what each step took on which machine.
#
#   bash scripts/train_heads.sh              # WORK=runs/heads by default; every step resumes where it stopped
#   WORK=runs/heads2 CONTINUE=1 STEPS=480 BATCH=4 bash scripts/train_heads.sh
#       # train the bundled heads further (--init-head, fresh optimizer and schedule) in a new WORK folder
#
# 1. prompts: 1600 ShareGPT first turns, half about code (data/heads/prompts.jsonl is the committed result)
# 2. answers: regenerated greedily by SmolLM2 itself, so the heads learn what the target really says
#    (data/heads/smollm2-regenerated.jsonl is the committed result; delete it to regenerate from scratch)
# 3. both heads trained on the same data for the same number of steps, in parallel, one core each
# 4. bundled in compact form, then measured on MT-Bench and HumanEval (benchmarks/acceptance.py)
set -euo pipefail
cd "$(dirname "$0")/.."
WORK="${WORK:-runs/heads}"
STEPS="${STEPS:-190}"
BATCH="${BATCH:-8}"
export OMP_NUM_THREADS="${OMP_NUM_THREADS:-1}"  # one core per process: two threads stall on a shared 2-core machine
mkdir -p "$WORK"

[ -f data/heads/prompts.jsonl ] || python3 scripts/make_head_prompts.py --num 1600 --out data/heads/prompts.jsonl
if [ ! -f data/heads/smollm2-regenerated.jsonl ]; then
  peagle data prepare --input data/heads/prompts.jsonl --out "$WORK/regen" --regenerate --max-new-tokens 256 \
    --max-model-len 1024 --batch-size 32 --max-num-seqs 16
  cp "$WORK/regen/regenerated.jsonl" data/heads/smollm2-regenerated.jsonl
fi
[ -f "$WORK/data/peagle_data.json" ] ||
  peagle data prepare --input data/heads/smollm2-regenerated.jsonl --out "$WORK/data"

COMMON=(--data "$WORK/data" --draft-vocab-size 8192 --max-steps "$STEPS" --batch-size "$BATCH" --lr 1e-3
        --warmup-ratio 0.05 --min-lr-ratio 0.1 --save-every 20 --resume latest --teacher-cache "$WORK/teacher-cache")
INIT_P=() INIT_E=()
if [ -n "${CONTINUE:-}" ]; then
  INIT_P=(--init-head smollm2-135m-peagle) INIT_E=(--init-head smollm2-135m-eagle3)
fi
peagle train --method peagle --num-layers 2 --num-depths 12 --out "$WORK/peagle" "${COMMON[@]}" "${INIT_P[@]}" \
  2> "$WORK/peagle.log" &
peagle train --method eagle3 --num-layers 1 --num-depths 7 --out "$WORK/eagle3" "${COMMON[@]}" "${INIT_E[@]}" \
  2> "$WORK/eagle3.log" &
wait

python3 scripts/bundle_head.py "$WORK/peagle" smollm2-135m-peagle
python3 scripts/bundle_head.py "$WORK/eagle3" smollm2-135m-eagle3
python3 benchmarks/acceptance.py --out docs/heads
