#!/usr/bin/env bash
# The heads' training campaign: one command, started in the background whenever work on the project begins, that
# picks up wherever the last run stopped (on a fresh machine: from the bundled heads and the data in the
# repository; checkpoints live under WORK, out of git). One core per lane; every stage resumes after a kill.
#
#   mkdir -p runs && nohup bash scripts/campaign.sh >> runs/campaign.log 2>&1 &     # WORK=runs/campaign
#   kill PID                                                                       # stops every lane and what it runs
#
# Stages (each one skips itself when its output is complete), in two lanes of one core each: data in one, training
# in the other, so that the heads train while the data engine still answers. Data is what the heads lack, and it
# travels in git, where a checkpoint does not.
#   1. regen  SmolLM2's answers to data/heads/prompts-3.jsonl (new ShareGPT prompts; made once, resumable; the
#             answers so far are committed as data/heads/smollm2-regenerated-3.jsonl.gz with
#             `gzip -c runs/campaign/regen3/regenerated.jsonl > data/heads/smollm2-regenerated-3.jsonl.gz`)
#   then, side by side:
#   data lane
#     1b.       the same for data/heads/prompts-code.jsonl (Python functions' signatures and docstrings from the
#               standard library and installed packages, scripts/make_code_prompts.py), committed as
#               data/heads/smollm2-regenerated-code.jsonl.gz
#     1c.       the same for data/heads/prompts-multi.jsonl (ShareGPT conversations of 2-4 user turns, each later
#               question after SmolLM2's own earlier answers: histories of thousands of tokens), committed as
#               data/heads/smollm2-regenerated-multi.jsonl.gz
#     4. eagle3 once 1c is done: the bundled EAGLE-3 head continued like stage 3, on the teacher outputs the two
#               heads share (--share-teacher-cache: whichever reaches a row first runs the target, the other reads
#               the row and deletes it, so the target's forward runs once per row and the cache stays small)
#     7. eagle3 round 2: EAGLE-3 continued from stage 4's head like stage 6
#   training lane
#     2. data   every conversation the bundled heads have not trained on (data/heads/smollm2-regenerated-2.jsonl
#               from line FIRST_UNSEEN on, stage 1's answers, and the first CODE_FIRST of stage 1b's, the ones
#               committed when this round's data was fixed), without the bundled heads' 32 held-out
#               conversations, and those 32 apart
#     3. peagle continue the bundled P-EAGLE head on them with the cheapest step that learns as much
#               (docs/heads.md, "Recipe search": 8 COD depths at r 0.7, frozen LM head), checkpoint every 20
#               steps, held-out evaluation every 100 (the same 32 conversations in every round)
#     5. data   round 2, once 1c is done: the code answers past the first CODE_FIRST and every multi-turn
#               conversation, in WORK/round2 (a round's folders are laid out like WORK's)
#     6. peagle round 2: P-EAGLE continued from stage 3's head, with --max-seq-len 4096 (the multi-turn histories)
#   slice lane (mostly asleep): scripts/campaign_slices.py measures the bundled heads and every 200th step's
#             checkpoint of both heads in both rounds on the first 16 HumanEval and 16 MT-Bench prompts (K 7), into
#             ROUND/slices
#   accept, when a round's two heads are both done (by whichever lane finishes the round): benchmarks/acceptance.py on
#             both into ROUND/acceptance, and the round's teacher cache deleted; re-bundling stays a decision
#             (scripts/bundle_head.py HEAD NAME --acceptance ROUND/acceptance/acceptance.json refuses a head whose
#             benchmark acceptance is not 2% above the bundle's on every set)
# Each lane writes its output, with a line when each of its stages starts, to WORK/logs/LANE.log.
set -euo pipefail
# Its own process group, so that stopping the campaign (kill PID) stops everything it started: the lanes and what
# they run stop with it (all of the group but itself), and each stage resumes next time. Long foreground commands
# run as `cmd & wait $!`, so that a signal is acted on at once rather than when they finish.
if [ -z "${CAMPAIGN_GROUP:-}" ]; then CAMPAIGN_GROUP=1 exec setsid bash "$0" "$@"; fi
trap 'trap "" TERM; kill -- -$$' EXIT
trap 'exit 143' INT TERM
cd "$(dirname "$0")/.."
WORK="${WORK:-runs/campaign}"
FIRST_UNSEEN="${FIRST_UNSEEN:-1217}"   # the second bundle trained on lines 1-1,216 of smollm2-regenerated-2.jsonl
CODE_FIRST="${CODE_FIRST:-1280}"       # code answers in round 1's training data: those committed when it was fixed
ROUND2="$WORK/round2"                   # round 2's folders: its data, heads, teacher cache, slices and acceptance
LR="${LR:-5e-4}"                       # a continuation's rate (docs/heads.md, "The second bundle")
export OMP_NUM_THREADS="${OMP_NUM_THREADS:-1}"
mkdir -p "$WORK/logs"
exec 9> "$WORK/.lock"   # one campaign per WORK: a second would train into the same folders
flock -n 9 || { echo "campaign: another one is running in $WORK (see $WORK/logs)"; exit 0; }
log() { echo "campaign $(date -u +%FT%TZ): $*"; }

if [ ! -f data/heads/prompts-3.jsonl ]; then
  python3 scripts/make_head_prompts.py --num 8000 --seed 2 --first-id 4000 --exclude data/heads/prompts.jsonl \
    --exclude data/heads/prompts-2.jsonl --out data/heads/prompts-3.jsonl
fi
# restore NAME COMMITTED: the answers made so far travel in the repository (COMMITTED, gzip); a fresh machine
# resumes after them.
restore() {
  local name=$1 committed=$2
  mkdir -p "$WORK/$name"
  if [ -f "$committed" ] && [ "$(gzip -dc "$committed" | wc -l)" -gt "$(cat "$WORK/$name/regenerated.jsonl" 2>/dev/null | wc -l)" ]; then
    gzip -dc "$committed" > "$WORK/$name/regenerated.jsonl"
  fi
}
# regenerate PROMPTS NAME [LEN]: SmolLM2's answers to PROMPTS in WORK/NAME, skipping the answers already there;
# a conversation longer than LEN tokens (1024) is cut before the turn that would pass it.
regenerate() {
  log "regenerate $1"
  peagle data prepare --input "$1" --out "$WORK/$2" --regenerate --max-new-tokens 256 \
    --max-model-len "${3:-1024}" --batch-size 32 --max-num-seqs 16
}
restore regen3 data/heads/smollm2-regenerated-3.jsonl.gz
restore regen-code data/heads/smollm2-regenerated-code.jsonl.gz
restore regen-multi data/heads/smollm2-regenerated-multi.jsonl.gz
regenerate data/heads/prompts-3.jsonl regen3 >> "$WORK/logs/data.log" 2>&1 & wait $!   # stage 1

# common ROUND: the training flags every stage shares, on ROUND's data and teacher cache (held out: round 1's 32)
common() {
  COMMON=(--data "$1/train-data" --eval-data "$WORK/heldout-data" --eval-every 100 --eval-depths 8 --lr "$LR"
          --save-every 20 --resume latest --teacher-cache "$1/teacher-cache" --share-teacher-cache --no-progress)
}
# train ROUND METHOD INIT [FLAG...]: continue INIT (a bundled head's name or a finished run) on ROUND's data into
# ROUND/METHOD, unless that head is already done (training_args.json is written last, after the head)
train() {
  local round=$1 method=$2 init=$3
  shift 3
  [ -f "$round/$method/training_args.json" ] && return 0
  log "train $method in $round from $init"
  common "$round"
  peagle train --method "$method" --init-head "$init" --out "$round/$method" --freeze-lm-head "$@" "${COMMON[@]}"
}
# finish_round ROUND: once both of ROUND's heads are done, their benchmark acceptance (stage 5) and the teacher
# cache's removal (nobody reads it again); run by both lanes, done by the one that finishes the round last
finish_round() {
  local round=$1
  [ -f "$round/peagle/training_args.json" ] && [ -f "$round/eagle3/training_args.json" ] || return 0
  (
    flock -n 8 || exit 0   # the other lane is finishing it
    rm -rf "$round/teacher-cache"
    if [ ! -f "$round/acceptance/acceptance.md" ]; then
      log "acceptance of $round's heads"
      python3 benchmarks/acceptance.py --peagle-head "$round/peagle" --eagle3-head "$round/eagle3" \
        --out "$round/acceptance"
      log "$round done; compare $round/acceptance/acceptance.md with docs/heads/acceptance.md"
    fi
  ) 8> "$round/.finish.lock"
}

data_lane() {
  regenerate data/heads/prompts-code.jsonl regen-code         # stage 1b
  regenerate data/heads/prompts-multi.jsonl regen-multi 4096  # stage 1c
  until [ -f "$WORK/heldout-data/peagle_data.json" ]; do sleep 60; done   # (a failed stage 2 stops the campaign)
  train "$WORK" eagle3 smollm2-135m-eagle3                    # stage 4
  finish_round "$WORK"
  until [ -f "$ROUND2/train-data/peagle_data.json" ]; do sleep 60; done
  train "$ROUND2" eagle3 "$WORK/eagle3" --max-seq-len 4096    # stage 7
  finish_round "$ROUND2"
}

training_lane() {
  if [ ! -f "$WORK/heldout-data/peagle_data.json" ]; then
    log "stage 2: data"
    local code="$WORK/regen-code/regenerated.jsonl"
    if [ ! -f "$code" ] || [ "$(wc -l < "$code")" -lt "$CODE_FIRST" ]; then
      echo "campaign: $code has fewer than CODE_FIRST=$CODE_FIRST answers; commit them or lower CODE_FIRST" >&2
      return 1
    fi
    tail -n "+$FIRST_UNSEEN" data/heads/smollm2-regenerated-2.jsonl > "$WORK/unseen.jsonl"
    head -n "$CODE_FIRST" "$code" > "$WORK/code-first.jsonl"
    local new=("$WORK/unseen.jsonl" "$WORK/regen3/regenerated.jsonl" "$WORK/code-first.jsonl")
    python3 scripts/split_head_data.py --inputs data/heads/smollm2-regenerated.jsonl "${new[@]}" \
      --train "$WORK/all.jsonl" --heldout "$WORK/heldout.jsonl"
    # Only conversations the bundled heads have not seen train; the held-out ones come from the first file.
    python3 - "$WORK" "${new[@]}" <<'EOF'
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
  local peagle=(--num-depths 8 --cod-ratio 0.7)
  train "$WORK" peagle smollm2-135m-peagle "${peagle[@]}"     # stage 3
  until [ -f "$WORK/regen-multi/peagle_data.json" ]; do sleep 60; done   # stage 1c's end
  round2_data                                                 # stage 5
  finish_round "$WORK"
  train "$ROUND2" peagle "$WORK/peagle" "${peagle[@]}" --max-seq-len 4096   # stage 6
  finish_round "$ROUND2"
}

# Round 2's data: the code answers past round 1's first CODE_FIRST and every multi-turn conversation (none of them
# held out: those stay round 1's 32, so that every round's evaluations compare).
round2_data() {
  [ -f "$ROUND2/train-data/peagle_data.json" ] && return 0
  log "stage 5: round 2's data"
  mkdir -p "$ROUND2"
  { tail -n "+$((CODE_FIRST + 1))" "$WORK/regen-code/regenerated.jsonl"; cat "$WORK/regen-multi/regenerated.jsonl"; } \
    > "$ROUND2/train.jsonl"
  peagle data prepare --input "$ROUND2/train.jsonl" --out "$ROUND2/train-data"
}

# lane NAME FUNCTION: FUNCTION (with set -e) with its output in WORK/logs/NAME.log; when it fails, the campaign stops
# (the other lanes with it) rather than wait on a lane that waits on it.
lane() {
  local status
  set +e   # (not `|| status=$?`: on the left of || bash would ignore the lane's own set -e)
  ( set -e; "$2" ) >> "$WORK/logs/$1.log" 2>&1
  status=$?
  set -e
  if [ "$status" -ne 0 ]; then log "the $1 lane failed (exit $status): see $WORK/logs/$1.log"; kill -TERM $$; fi
  return "$status"
}
lane data data_lane & data=$!
lane training training_lane & training=$!
python3 scripts/campaign_slices.py --work "$WORK" --work "$ROUND2" --watch >> "$WORK/logs/slices.log" 2>&1 & slices=$!
wait $training
wait $data
wait $slices || log "the slice lane failed: see $WORK/logs/slices.log"
log "done: both rounds"
