#!/usr/bin/env bash
# The heads' training campaign: one command, started in the background whenever work on the project begins, that
# picks up wherever the last run stopped (on a fresh machine: from the bundled heads and the data in the
# repository; checkpoints live under WORK, out of git). One core by default; every stage resumes after a kill.
#
#   nohup bash scripts/campaign.sh >> runs/campaign.log 2>&1 &     # WORK=runs/campaign
#
# Stages, in order (each one skips itself when its output is complete). Data first: it is what the heads lack, and
# it travels in git, where a checkpoint does not.
#   1. regen  SmolLM2's answers to data/heads/prompts-3.jsonl (new ShareGPT prompts; made once, resumable; the
#             answers so far are committed as data/heads/smollm2-regenerated-3.jsonl.gz with
#             `gzip -c runs/campaign/regen3/regenerated.jsonl > data/heads/smollm2-regenerated-3.jsonl.gz`)
#   1b.       the same for data/heads/prompts-code.jsonl (Python functions' signatures and docstrings from the
#             standard library and installed packages, scripts/make_code_prompts.py), committed as
#             data/heads/smollm2-regenerated-code.jsonl.gz
#   2. data   every conversation the bundled heads have not trained on (data/heads/smollm2-regenerated-2.jsonl from
#             line FIRST_UNSEEN on, and stages 1 and 1b's answers), without the bundled heads' 32 held-out conversations,
#             and those 32 apart
#   3. peagle continue the bundled P-EAGLE head on them with the cheapest step that learns as much
#             (docs/heads.md, "Recipe search": 8 COD depths at r 0.7, frozen LM head), checkpoint every 20 steps,
#             held-out evaluation every 100
#   4. eagle3 the same for the bundled EAGLE-3 head
#   5. accept benchmarks/acceptance.py on both continued heads into WORK/acceptance; re-bundling stays a decision
#             (scripts/bundle_head.py HEAD NAME --acceptance WORK/acceptance/acceptance.json refuses a head whose
#             benchmark acceptance is not 2% above the bundle's on every set)
set -euo pipefail
cd "$(dirname "$0")/.."
WORK="${WORK:-runs/campaign}"
FIRST_UNSEEN="${FIRST_UNSEEN:-1217}"   # the second bundle trained on lines 1-1,216 of smollm2-regenerated-2.jsonl
LR="${LR:-5e-4}"                       # a continuation's rate (docs/heads.md, "The second bundle")
export OMP_NUM_THREADS="${OMP_NUM_THREADS:-1}"
mkdir -p "$WORK"
log() { echo "campaign $(date -u +%FT%TZ): $*"; }

if [ ! -f data/heads/prompts-3.jsonl ]; then
  python3 scripts/make_head_prompts.py --num 8000 --seed 2 --first-id 4000 --exclude data/heads/prompts.jsonl \
    --exclude data/heads/prompts-2.jsonl --out data/heads/prompts-3.jsonl
fi
# regenerate PROMPTS NAME COMMITTED: SmolLM2's answers to PROMPTS in WORK/NAME. The answers made so far travel in
# the repository (COMMITTED, gzip): a fresh machine resumes after them.
regenerate() {
  local prompts=$1 name=$2 committed=$3
  log "regenerate $prompts"
  mkdir -p "$WORK/$name"
  if [ -f "$committed" ] && [ "$(gzip -dc "$committed" | wc -l)" -gt "$(cat "$WORK/$name/regenerated.jsonl" 2>/dev/null | wc -l)" ]; then
    gzip -dc "$committed" > "$WORK/$name/regenerated.jsonl"
  fi
  peagle data prepare --input "$prompts" --out "$WORK/$name" --regenerate --max-new-tokens 256 \
    --max-model-len 1024 --batch-size 32 --max-num-seqs 16   # skips the answers already there
}
regenerate data/heads/prompts-3.jsonl regen3 data/heads/smollm2-regenerated-3.jsonl.gz          # stage 1
regenerate data/heads/prompts-code.jsonl regen-code data/heads/smollm2-regenerated-code.jsonl.gz  # stage 1b
NEW=("$WORK/unseen.jsonl" "$WORK/regen3/regenerated.jsonl" "$WORK/regen-code/regenerated.jsonl")

if [ ! -f "$WORK/heldout-data/peagle_data.json" ]; then
  log "stage 2: data"
  tail -n "+$FIRST_UNSEEN" data/heads/smollm2-regenerated-2.jsonl > "$WORK/unseen.jsonl"
  python3 scripts/split_head_data.py --inputs data/heads/smollm2-regenerated.jsonl "${NEW[@]}" \
    --train "$WORK/all.jsonl" --heldout "$WORK/heldout.jsonl"
  # Only conversations the bundled heads have not seen train; the held-out ones come from the first file.
  python3 - "$WORK" "${NEW[@]}" <<'EOF'
import json, sys
work, new = sys.argv[1], sys.argv[2:]
unseen = {json.loads(l)["id"] for f in new for l in open(f) if l.strip()}
with open(f"{work}/train.jsonl", "w") as out:
    for line in open(f"{work}/all.jsonl"):
        if line.strip() and json.loads(line)["id"] in unseen:
            out.write(line)
EOF
  peagle data prepare --input "$WORK/train.jsonl" --out "$WORK/train-data"
  peagle data prepare --input "$WORK/heldout.jsonl" --out "$WORK/heldout-data"
fi

COMMON=(--data "$WORK/train-data" --eval-data "$WORK/heldout-data" --eval-every 100 --eval-depths 8 --lr "$LR"
        --save-every 20 --resume latest --teacher-cache "$WORK/teacher-cache" --no-progress)
if [ ! -f "$WORK/peagle/model.safetensors" ]; then
  log "stage 3: P-EAGLE"
  peagle train --method peagle --init-head smollm2-135m-peagle --out "$WORK/peagle" --num-depths 8 \
    --cod-ratio 0.7 --freeze-lm-head "${COMMON[@]}"
fi
if [ ! -f "$WORK/eagle3/model.safetensors" ]; then
  log "stage 4: EAGLE-3"
  peagle train --method eagle3 --init-head smollm2-135m-eagle3 --out "$WORK/eagle3" --freeze-lm-head "${COMMON[@]}"
fi

if [ ! -f "$WORK/acceptance/acceptance.md" ]; then
  log "stage 5: acceptance"
  python3 benchmarks/acceptance.py --peagle-head "$WORK/peagle" --eagle3-head "$WORK/eagle3" --out "$WORK/acceptance"
fi
log "done; compare $WORK/acceptance/acceptance.md with docs/heads/acceptance.md"
