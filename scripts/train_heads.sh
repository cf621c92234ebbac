#!/usr/bin/env bash
# Train the SmolLM2 heads (peagle/heads/smollm2-135m-{peagle,eagle3}) with `peagle train`'s defaults, which are the
# bundled heads' recipe (docs/heads.md says what each step took on which machine). A long job: every step resumes
# where it stopped, so run it again (in the background, across sessions) until the heads are trained.
#
#   nohup bash scripts/train_heads.sh > runs/heads3.log 2>&1 &    # WORK=runs/heads3, STEPS=2000 by default
#   STEPS=4000 bash scripts/train_heads.sh                        # train further: the same WORK, a longer schedule
#   BUNDLE=1 bash scripts/train_heads.sh                          # after measuring: copy the heads into the package
#
# 1. data: ShareGPT prompts answered greedily by SmolLM2 itself, so the heads learn what the target really says: the
#    1,600 of data/heads/smollm2-regenerated.jsonl.gz and the 2,400 more of data/heads/smollm2-regenerated-2.jsonl.gz
#    (answers to data/heads/prompts-2.jsonl.gz; any prompt still unanswered is regenerated first: about 35 per minute
#    on one core, resumable)
# 2. the bundled heads' 32 held-out conversations kept apart (scripts/head_data.py split), evaluated every 100 steps
# 3. both heads trained on the same data, in parallel, one core each, checkpointing every 20 steps (--resume latest)
# 4. measured on MT-Bench and HumanEval (benchmarks/acceptance.py) into WORK/acceptance; bundle only a head that is
#    clearly better than the bundled one (every bundle stays in the repository's history)
set -euo pipefail
cd "$(dirname "$0")/.."
WORK="${WORK:-runs/heads3}"
STEPS="${STEPS:-2000}"
export OMP_NUM_THREADS="${OMP_NUM_THREADS:-1}"  # one core per process: two threads stall on a shared 2-core machine
mkdir -p "$WORK/regen"

if [ -n "${BUNDLE:-}" ]; then
  python3 scripts/bundle_head.py "$WORK/peagle" smollm2-135m-peagle
  python3 scripts/bundle_head.py "$WORK/eagle3" smollm2-135m-eagle3
  python3 benchmarks/acceptance.py --out docs/heads
  exit 0
fi

if [ ! -f "$WORK/regen/regenerated.jsonl" ]; then  # the committed answers, unpacked: regeneration appends to them
  gzip -dc data/heads/smollm2-regenerated-2.jsonl.gz > "$WORK/regen/regenerated.jsonl.tmp"
  mv "$WORK/regen/regenerated.jsonl.tmp" "$WORK/regen/regenerated.jsonl"
fi
peagle data prepare --input data/heads/prompts-2.jsonl.gz --out "$WORK/regen" --regenerate --max-new-tokens 256 \
  --max-model-len 1024 --batch-size 32 --max-num-seqs 16  # skips the answers already there
if [ ! -f "$WORK/heldout-data/peagle_data.json" ]; then
  python3 scripts/head_data.py split --inputs data/heads/smollm2-regenerated.jsonl.gz "$WORK/regen/regenerated.jsonl" \
    --train "$WORK/train.jsonl" --heldout "$WORK/heldout.jsonl"
  peagle data prepare --input "$WORK/train.jsonl" --out "$WORK/train-data"
  peagle data prepare --input "$WORK/heldout.jsonl" --out "$WORK/heldout-data"
fi

COMMON=(--data "$WORK/train-data" --eval-data "$WORK/heldout-data" --eval-every 100 --eval-depths 8
        --max-steps "$STEPS" --save-every 20 --resume latest --teacher-cache "$WORK/teacher-cache")
peagle train --method peagle --out "$WORK/peagle" "${COMMON[@]}" 2>> "$WORK/peagle.log" &
peagle train --method eagle3 --out "$WORK/eagle3" "${COMMON[@]}" 2>> "$WORK/eagle3.log" &
wait

python3 benchmarks/acceptance.py --peagle-head "$WORK/peagle" --eagle3-head "$WORK/eagle3" --out "$WORK/acceptance"
echo "compare $WORK/acceptance/acceptance.md with docs/heads/acceptance.md; BUNDLE=1 bundles the new heads"
