#!/usr/bin/env bash
# The heads' training campaign: one command, started in the background whenever work on the project begins, that
# picks up wherever the last run stopped (on a fresh machine: from the bundled heads and the data in the
# repository; checkpoints live under WORK, out of git). Two lanes on two cores; every stage resumes after a kill.
#
#   mkdir -p runs && nohup bash scripts/campaign.sh >> runs/campaign.log 2>&1 &     # WORK=runs/campaign
#   kill PID                                                                       # stops every lane and what it runs
#
# Progress outlives a machine only as data and as re-bundled heads (scripts/campaign_rounds.py): the heads train
# in rounds of ROWS conversations, each small enough to finish in one working session, each gated against the
# bundled head (measured side by side on this machine) and re-bundled only when clearly better; the round's end moves
# the head's cursor in data/heads/campaign.json, committed with the bundles, so that the next round trains on new
# conversations. Stages (each skips itself when its output is complete), in two lanes: the training lane's trainer
# runs the target for its next step in a second thread (--teacher-ahead), so it uses both cores, and the data lane
# runs at nice 10 in what the trainer leaves (while the pool holds rounds the trainer has not reached, training is
# what is short: docs/heads.md, "Two cores for the trainer"):
#   1. regen  SmolLM2's answers to data/heads/prompts-3.jsonl.gz (new ShareGPT prompts; made once, resumable; the
#             answers so far are committed as data/heads/smollm2-regenerated-3.jsonl.gz with
#             `gzip -c runs/campaign/regen3/regenerated.jsonl > data/heads/smollm2-regenerated-3.jsonl.gz`)
#   then, side by side:
#   data lane
#     1b.       the same for data/heads/prompts-code.jsonl.gz (Python functions' signatures and docstrings from the
#               standard library and installed packages, scripts/make_code_prompts.py), committed as
#               data/heads/smollm2-regenerated-code.jsonl.gz
#     1c.       the same for data/heads/prompts-multi.jsonl.gz (ShareGPT conversations of 2-4 user turns, each later
#               question after SmolLM2's own earlier answers: histories of thousands of tokens), committed as
#               data/heads/smollm2-regenerated-multi.jsonl.gz
#     1d.       the same for data/heads/prompts-4.jsonl.gz (the last usable ShareGPT first turns, up to 4,000
#               characters, and 6,000 more documented functions from a wider set of installed packages, shuffled
#               together: scripts/mix_prompts.py; answers of up to 512 tokens), committed as
#               data/heads/smollm2-regenerated-4.jsonl.gz
#     1e.       questions SmolLM2 writes itself (scripts/make_self_prompts.py: ShareGPT is used up; made once,
#               resumable, committed as data/heads/prompts-self.jsonl.gz as it grows), shuffled with 5,000 more
#               functions (data/heads/prompts-code-3.jsonl.gz) into data/heads/prompts-5.jsonl.gz and answered like
#               1d, committed as data/heads/smollm2-regenerated-5.jsonl.gz
#     4. eagle3 rounds, once 1e is done: like stage 3, on the teacher outputs the two heads share when their cursors
#               meet (--share-teacher-cache: whichever reaches a row first runs the target, the other reads the row
#               and deletes it)
#   training lane
#     2. data   the pool: every conversation the second bundle had not trained on, in a fixed order that only grows
#               at its end (data/heads/smollm2-regenerated-2.jsonl.gz from line FIRST_UNSEEN on, stage 1's answers
#               and the first CODE_FIRST of stage 1b's; then the rest of 1b's and 1c's, shuffled together so that
#               no round is all code; then 1d's, then 1e's as they come), without the
#               bundled heads' 32 held-out conversations, which are kept apart for evaluation
#     3. peagle rounds: the P-EAGLE head continued on the next ROWS conversations past its cursor, joined into rows of
#               up to PACK tokens (long histories), with the cheapest step that learns as much (docs/heads.md, "Recipe
#               search": 8 COD depths at r 0.7, frozen LM head); a round continues the last round's head when it is
#               on this machine, bundled or not (else the bundle: campaign_rounds.py start); checkpoint every 20
#               steps, held-out evaluation every 100 (the same 32 conversations in every round); then the gate:
#               benchmarks/acceptance.py at K=7 on all of HumanEval and MT-Bench for the bundled head and the
#               round's, and scripts/campaign_rounds.py close, which re-bundles the round's head if its gain averaged
#               over both sets is above zero at 95% confidence over the prompts (scripts/bundle_head.py) and it is
#               lower on neither, records the round and advances the cursor
#   slice lane (mostly asleep): scripts/campaign_slices.py measures the bundled heads and every 200th step's
#             checkpoint of every round on the first 16 HumanEval and 16 MT-Bench prompts (K 7), into ROUND/slices
# Each lane writes its output, with a line when each of its stages starts, to WORK/logs/LANE.log. After a round that
# re-bundled, commit peagle/heads/ and data/heads/campaign.json (the next round starts from the new bundle).
# All of it in one braced group, which bash reads whole before running: editing this file while a campaign runs
# (a commit, a pull) cannot change what the running one does next.
{
set -euo pipefail
# Its own process group, so that stopping the campaign (kill PID) stops everything it started: the lanes and what
# they run stop with it (all of the group but itself), and each stage resumes next time. Long foreground commands
# run as `cmd & wait $!`, so that a signal is acted on at once rather than when they finish.
if [ -z "${CAMPAIGN_GROUP:-}" ]; then CAMPAIGN_GROUP=1 exec setsid bash "$0" "$@"; fi
trap 'trap "" TERM; kill -- -$$' EXIT
trap 'exit 143' INT TERM
cd "$(dirname "$0")/.."
WORK="${WORK:-runs/campaign}"
FIRST_UNSEEN="${FIRST_UNSEEN:-1217}"   # the second bundle trained on lines 1-1,216 of smollm2-regenerated-2.jsonl.gz
CODE_FIRST="${CODE_FIRST:-1280}"       # code answers in round 1's training data: those committed when it was fixed
# ROWS: conversations per round, sized to finish within a session: P-EAGLE's step (4 conversations) took about 5.5 s
# on a Zen 4 core, whose AVX-512 BF16 the trainer's bf16 compute uses, and 20-28 s on a Zen 3 core, which has no bf16
# instructions (docs/heads.md, "Rounds that fit a session"). ROWS sizes new rounds only: a round already begun at a
# head's cursor is finished whatever ROWS is (ROWS=1600 when a session has about an hour left for the next round).
if [ -z "${ROWS:-}" ]; then grep -qw -e avx512_bf16 -e amx_bf16 /proc/cpuinfo && ROWS=3200 || ROWS=800; fi
LR="${LR:-5e-4}"                       # a continuation's rate (docs/heads.md, "The second bundle")
# LM_HEAD: "frozen" (the cheapest step of "Recipe search") or "trained". Round 11 trained it, since held-out accuracy
# had stopped rising on the frozen head over rounds 5-10, and ended lower at depth 1 (0.481 against round 10's 0.501;
# docs/heads.md, "The eleventh round"), so later rounds freeze it again. A round keeps the choice it began with.
LM_HEAD="${LM_HEAD:-frozen}"
# PACK: new rounds train on rows of up to PACK tokens joined from consecutive conversations (docs/training.md, "Data":
# long histories), one row per step (about as many tokens as 4 conversations); 0 trains on single conversations, 4
# per step. A round already prepared keeps its rows.
PACK="${PACK:-4096}"
export OMP_NUM_THREADS="${OMP_NUM_THREADS:-1}"
mkdir -p "$WORK/logs"
exec 9> "$WORK/.lock"   # one campaign per WORK: a second would train into the same folders
flock -n 9 || { echo "campaign: another one is running in $WORK (see $WORK/logs)"; exit 0; }
log() { echo "campaign $(date -u +%FT%TZ): $*"; }

if [ ! -f data/heads/prompts-3.jsonl.gz ]; then
  python3 scripts/make_head_prompts.py --num 8000 --seed 2 --first-id 4000 --exclude data/heads/prompts.jsonl.gz \
    --exclude data/heads/prompts-2.jsonl.gz --out data/heads/prompts-3.jsonl.gz
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
# regenerate PROMPTS NAME [LEN [NEW]]: SmolLM2's answers to PROMPTS in WORK/NAME, skipping the answers already there;
# a conversation longer than LEN tokens (1024) is cut before the turn that would pass it, an answer at NEW tokens (256)
regenerate() {
  log "regenerate $1"
  peagle data prepare --input "$1" --out "$WORK/$2" --regenerate --max-new-tokens "${4:-256}" \
    --max-model-len "${3:-1024}" --batch-size 32 --max-num-seqs 16
}
restore regen3 data/heads/smollm2-regenerated-3.jsonl.gz
restore regen-code data/heads/smollm2-regenerated-code.jsonl.gz
restore regen-multi data/heads/smollm2-regenerated-multi.jsonl.gz
restore regen4 data/heads/smollm2-regenerated-4.jsonl.gz
restore regen5 data/heads/smollm2-regenerated-5.jsonl.gz
regenerate data/heads/prompts-3.jsonl.gz regen3 >> "$WORK/logs/data.log" 2>&1 & wait $!   # stage 1

# common ROUND: the training flags every stage shares, on ROUND's data and teacher cache (held out: the same 32)
# (--attn-chunk 512: the deeper COD rows attend in chunks whose own block is computed densely though a chain is at
#  most 7 long; smaller chunks waste less, the same outputs: about 1 CPU-second a step, docs/heads.md)
common() {
  local rows_per_step=4
  grep -q '"packed_to": [0-9]' "$1/train-data/peagle_data.json" && rows_per_step=1
  COMMON=(--data "$1/train-data" --batch-size "$rows_per_step" --eval-data "$WORK/heldout-data" --eval-every 100 --eval-depths 8
          --save-every 20 --resume latest --teacher-cache "$1/teacher-cache" --share-teacher-cache
          --max-seq-len 4096 --attn-chunk 512 --teacher-ahead --no-progress)
}
# train ROUND METHOD [FLAG...]: continue METHOD's last round's head (or the bundle: campaign_rounds.py start) on
# ROUND's data into ROUND/METHOD, unless that head is already done (training_args.json is written last, after the
# head); the head a round starts from is fixed when it begins, in ROUND/METHOD.started_from
train() {
  local round=$1 method=$2
  shift 2
  [ -f "$round/$method/training_args.json" ] && return 0
  if [ ! -f "$round/$method.lm_head" ]; then  # a round begun before the knob existed trained a frozen LM head
    if [ -f "$round/$method.started_from" ]; then echo frozen; else echo "$LM_HEAD"; fi > "$round/$method.lm_head"
  fi
  if [ ! -f "$round/$method.lr" ]; then  # likewise its rate: 5e-4 before the knob was kept per round
    if [ -f "$round/$method.started_from" ]; then echo 5e-4; else echo "$LR"; fi > "$round/$method.lr"
  fi
  [ -f "$round/$method.started_from" ] || python3 scripts/campaign_rounds.py start --method "$method" \
    --rounds "$WORK/rounds" > "$round/$method.started_from"
  local from freeze=()
  from=$(cat "$round/$method.started_from")
  [ "$(cat "$round/$method.lm_head")" = frozen ] && freeze=(--freeze-lm-head)
  log "train $method in $round from $from ($(cat "$round/$method.lm_head") LM head, lr $(cat "$round/$method.lr"))"
  common "$round"
  peagle train --method "$method" --init-head "$from" --out "$round/$method" "${freeze[@]}" "$@" "${COMMON[@]}" \
    --lr "$(cat "$round/$method.lr")"
}
# gate ROUND METHOD: the bundled head and the round's, at K=7 on all of HumanEval and MT-Bench, side by side on this
# machine (the bundle's figures kept per bundle and kernel source under WORK/baseline: kernels that round otherwise
# make other greedy text); then re-bundle, record and advance
gate() {
  local round=$1 method=$2 base
  base="$WORK/baseline/$method-$(sha256sum "peagle/heads/smollm2-135m-$method/model.safetensors" | cut -c1-12)"
  base="$base-kernels-$(sha256sum peagle/model/kernels.c | cut -c1-8)"
  log "acceptance at K=7 of the bundled $method head and of $round's"
  python3 benchmarks/acceptance.py --methods "$method" --k 7 "--$method-head" "smollm2-135m-$method" --out "$base"
  python3 benchmarks/acceptance.py --methods "$method" --k 7 "--$method-head" "$round/$method" \
    --out "$round/acceptance-$method"
  python3 scripts/campaign_rounds.py close --method "$method" --round "$round" \
    --acceptance "$round/acceptance-$method/acceptance.json" --baseline "$base/acceptance.json"
}
# rounds METHOD [FLAG...]: round after round of METHOD while the pool has ROWS new conversations for it
rounds() {
  local method=$1 round status pool
  shift
  # (the second source is a group of two finished files, shuffled together: campaign_rounds.py)
  pool=("$WORK/train.jsonl" "$WORK/regen-code/regenerated.jsonl:$((CODE_FIRST + 1))+$WORK/regen-multi/regenerated.jsonl"
        "$WORK/regen4/regenerated.jsonl" "$WORK/regen5/regenerated.jsonl")
  while true; do
    set +e
    round=$(python3 scripts/campaign_rounds.py next --method "$method" --rows "$ROWS" --rounds "$WORK/rounds" \
      --heldout "$WORK/heldout.jsonl" "${pool[@]}")
    status=$?
    set -e
    [ "$status" -eq 3 ] && { log "$method: the pool has fewer than $ROWS new conversations; rounds stop"; return 0; }
    [ "$status" -eq 0 ] || return "$status"
    (
      flock 8   # the other head may be preparing the same round
      if [ ! -f "$round/train-data/peagle_data.json" ]; then
        pack=()
        [ "$PACK" -gt 0 ] && pack=(--pack-to "$PACK")
        peagle data prepare --input "$round/train.jsonl" --out "$round/train-data" "${pack[@]}"
      fi
    ) 8> "$round/.prepare.lock"
    train "$round" "$method" "$@"
    gate "$round" "$method"
  done
}

data_lane() {
  renice -n 10 -p "$BASHPID" > /dev/null   # what it starts inherits it
  regenerate data/heads/prompts-code.jsonl.gz regen-code         # stage 1b
  regenerate data/heads/prompts-multi.jsonl.gz regen-multi 4096  # stage 1c
  # stage 1d: prompts of up to 4,000 characters; answers of up to 512 tokens, since two thirds of SmolLM2's are cut
  # at 256 and its prompts are nearly all used, more of each answer is where more training tokens come from
  regenerate data/heads/prompts-4.jsonl.gz regen4 2048 512
  # stage 1e: ShareGPT is used up, so chat questions SmolLM2 writes itself, mixed with 5,000 more functions
  log "stage 1e: questions the target writes (data/heads/prompts-self.jsonl.gz)"
  python3 scripts/make_self_prompts.py --num 5000 --first-id 30000 --exclude data/heads/prompts.jsonl.gz \
    --exclude data/heads/prompts-2.jsonl.gz --exclude data/heads/prompts-3.jsonl.gz \
    --exclude data/heads/prompts-multi.jsonl.gz --exclude data/heads/prompts-4.jsonl.gz \
    --out data/heads/prompts-self.jsonl.gz
  [ -f data/heads/prompts-5.jsonl.gz ] || python3 scripts/mix_prompts.py --inputs data/heads/prompts-self.jsonl.gz \
    data/heads/prompts-code-3.jsonl.gz --seed 0 --out data/heads/prompts-5.jsonl.gz
  regenerate data/heads/prompts-5.jsonl.gz regen5 2048 512
  until [ -f "$WORK/heldout-data/peagle_data.json" ]; do sleep 60; done   # (a failed stage 2 stops the campaign)
  rounds eagle3                                               # stage 4
}

training_lane() {
  if [ ! -f "$WORK/heldout-data/peagle_data.json" ]; then
    log "stage 2: data"
    local code="$WORK/regen-code/regenerated.jsonl"
    if [ ! -f "$code" ] || [ "$(wc -l < "$code")" -lt "$CODE_FIRST" ]; then
      echo "campaign: $code has fewer than CODE_FIRST=$CODE_FIRST answers; commit them or lower CODE_FIRST" >&2
      return 1
    fi
    gzip -dc data/heads/smollm2-regenerated-2.jsonl.gz | tail -n "+$FIRST_UNSEEN" > "$WORK/unseen.jsonl"
    head -n "$CODE_FIRST" "$code" > "$WORK/code-first.jsonl"
    local new=("$WORK/unseen.jsonl" "$WORK/regen3/regenerated.jsonl" "$WORK/code-first.jsonl")
    python3 scripts/split_head_data.py --inputs data/heads/smollm2-regenerated.jsonl.gz "${new[@]}" \
      --train "$WORK/all.jsonl" --heldout "$WORK/heldout.jsonl"
    # Only conversations the bundled heads have not seen train; the held-out ones come from the first file.
    python3 - "$WORK" "${new[@]}" <<'PY'
import json, sys
work, new = sys.argv[1], sys.argv[2:]
unseen = {json.loads(l)["id"] for f in new for l in open(f) if l.strip()}
with open(f"{work}/train.jsonl", "w") as out:
    for line in open(f"{work}/all.jsonl"):
        if line.strip() and json.loads(line)["id"] in unseen:
            out.write(line)
PY
    peagle data prepare --input "$WORK/heldout.jsonl" --out "$WORK/heldout-data"
  fi
  rounds peagle --num-depths 8 --cod-ratio 0.7                # stage 3
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
python3 scripts/campaign_slices.py --work "$WORK" --rounds "$WORK/rounds" --watch >> "$WORK/logs/slices.log" 2>&1 &
wait $training
wait $data
log "done: the pool is used up for both heads; add data (a stage like 1d, appended to the pool) for more rounds"
exit
}
