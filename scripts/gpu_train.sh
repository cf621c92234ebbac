#!/usr/bin/env bash
# A GPU training run in one command (docs/training.md, "Training on a GPU machine"): both heads, P-EAGLE and EAGLE-3,
# from the same recipe and time budget, evaluated on held-out rows and left as safetensors shards of at most 16 MiB.
#
#   bash scripts/gpu_train.sh --pack runs/gpu/in --data DIR [--eval-data DIR] [--heads] [--recipe "FLAGS"] \
#        [--wheels DIR | --download-wheels DIR]          # here: gather the inputs as checked parts, in trips
#   bash scripts/gpu_train.sh --inputs runs/gpu/in --out OUT [--deadline-s 540]   # there: run, before the deadline
#   bash scripts/gpu_train.sh --dry-run --out OUT        # here: pack and run it all on this CPU, tiny random target
#   python3 -m peagle.train.transfer join OUT/peagle heads/gpu-peagle           # back here: one head folder again
#
# The run side needs only Python, torch and transformers: it checks every part against its trip's SHA256SUMS, joins
# the files and checks them against the MANIFEST, installs the packed wheels of the packages that machine lacks
# (pip --no-index), builds the target from the GGUF (the embedded model's own conversion), trains both heads side by
# side with --time-budget (what the deadline leaves, less --reserve-s for start-up and saving), and writes, per head,
# OUT/<method>/ (shards, config.json, eval.json, training_record.json, train_log.jsonl) and OUT/<method>.log, and
# OUT/gpu_train.json with the seconds each part took.
set -euo pipefail
ROOT="$(cd "$(dirname "$0")/.." && pwd)"
MODE="" INPUTS="" OUT="" DEADLINE=540 RESERVE=60 PACK_ARGS=() WORK=""
# The GPU recipe: 32 rows per step, 8 per forward, --lr scaled from the bundled recipe's batch of 4 by sqrt; epochs
# enough that the time budget, not the data, ends the run (not yet tuned on a GPU: the first run's log says).
RECIPE="--batch-size 32 --micro-batch-size 8 --lr-scaling sqrt --max-seq-len 4096 --epochs 5 --save-every 0"
while [ $# -gt 0 ]; do
  case "$1" in
    --pack) MODE=pack; OUT="$2"; shift 2 ;;
    --inputs) MODE=run; INPUTS="$2"; shift 2 ;;
    --dry-run) MODE=dry; shift ;;
    --out) OUT="$2"; shift 2 ;;
    --deadline-s) DEADLINE="$2"; shift 2 ;;
    --reserve-s) RESERVE="$2"; shift 2 ;;
    --work) WORK="$2"; shift 2 ;;
    --recipe) RECIPE="$2"; shift 2 ;;
    --heads) PACK_ARGS+=(--heads); shift ;;
    --data|--eval-data|--wheels|--download-wheels|--target) PACK_ARGS+=("$1" "$2"); shift 2 ;;
    -h|--help) sed -n '2,17p' "$0"; exit 0 ;;
    *) echo "gpu_train.sh: unknown argument $1 (--help lists them)" >&2; exit 2 ;;
  esac
done
[ -n "$MODE" ] || { echo "gpu_train.sh: give --pack DIR, --inputs DIR --out DIR, or --dry-run --out DIR" >&2; exit 2; }
[ -n "$OUT" ] || { echo "gpu_train.sh: --out DIR is missing" >&2; exit 2; }

if [ "$MODE" = pack ]; then
  PYTHONPATH="$ROOT${PYTHONPATH:+:$PYTHONPATH}" python3 -m peagle.train.transfer pack --out "$OUT" \
    --recipe "$RECIPE" "${PACK_ARGS[@]}"
  exit 0
fi

if [ "$MODE" = dry ]; then
  T0=$(date +%s.%N)
  DRY="$OUT/.dry"
  rm -rf "$DRY" && mkdir -p "$DRY"
  export PYTHONPATH="$ROOT${PYTHONPATH:+:$PYTHONPATH}"
  # this machine's CPU kernels, already built, rather than a fresh build in the run's own PEAGLE_HOME
  PEAGLE_KERNELS_DIR="${PEAGLE_KERNELS_DIR:-$(python3 -c 'from peagle.model.kernels import build_dir; print(build_dir())')}"
  export PEAGLE_KERNELS_DIR
  python3 "$ROOT/scripts/gpu_dry_run_inputs.py" "$DRY"
  python3 -m peagle.train.transfer pack --out "$DRY/in" --data "$DRY/data" --eval-data "$DRY/heldout" \
    --target "$DRY/target" --recipe "--device cpu --batch-size 4 --micro-batch-size 2 --lr-scaling sqrt \
    --max-seq-len 128 --epochs 1000 --save-every 0 --num-depths 3 --eval-samples 4 --eval-anchors 32"
  PACK_S=$(python3 -c "import time; print(round(time.time() - $T0, 2))")
  bash "$0" --inputs "$DRY/in" --out "$OUT" --deadline-s "${DRY_DEADLINE_S:-45}" --reserve-s "${DRY_RESERVE_S:-30}" \
    --work "$DRY/work"
  python3 - "$OUT/gpu_train.json" "$PACK_S" <<'EOF'
import json, sys
path = sys.argv[1]
record = json.load(open(path))
record["seconds"] = {"pack": float(sys.argv[2]), **record["seconds"]}
json.dump(record, open(path, "w"), indent=2)
EOF
  [ -n "${GPU_TRAIN_KEEP_WORK:-}" ] || rm -rf "$DRY"  # kept (tests compare the shards with the trained heads)
  exit 0
fi

# ---- the run side -------------------------------------------------------------------------------------------------
START=$(date +%s.%N)
since() { python3 -c "import time; print(round(time.time() - $1, 2))"; }
left() { python3 -c "import time; print(int($DEADLINE - (time.time() - $START)))"; }
mkdir -p "$OUT"
WORK="${WORK:-${TMPDIR:-/tmp}/peagle-gpu-run.$$}"
rm -rf "$WORK" && mkdir -p "$WORK/files" "$WORK/site" "$WORK/code"
trap '[ -n "${GPU_TRAIN_KEEP_WORK:-}" ] || rm -rf "$WORK"' EXIT  # also when a check below refuses the inputs
declare -A SECONDS_OF

T=$(date +%s.%N)
trips=$(find "$INPUTS" -name SHA256SUMS -printf '%h\n' | sort)
[ -n "$trips" ] || { echo "gpu_train.sh: no trip-*/SHA256SUMS under $INPUTS (made by --pack)" >&2; exit 2; }
for trip in $trips; do
  (cd "$trip" && sha256sum -c --quiet SHA256SUMS) || { echo "gpu_train.sh: $trip: a part is damaged" >&2; exit 3; }
done
python3 - "$WORK/files" $trips <<'EOF'
import hashlib, json, sys
from pathlib import Path
dest, trips = Path(sys.argv[1]), [Path(t) for t in sys.argv[2:]]
manifest = json.loads((trips[0] / "MANIFEST").read_text())
where = {p.name: p for t in trips for p in t.iterdir()}
for f in manifest["files"]:
    missing = [p for p in f["parts"] if p not in where]
    if missing:
        sys.exit(f"gpu_train.sh: {f['name']}: parts {missing} did not arrive (carry every trip-*)")
    h = hashlib.sha256()
    with open(dest / f["name"], "wb") as out:
        for p in f["parts"]:
            block = where[p].read_bytes()
            h.update(block)
            out.write(block)
    if h.hexdigest() != f["sha256"]:
        sys.exit(f"gpu_train.sh: {f['name']}: joined file does not match its checksum")
print(f"gpu_train.sh: {len(manifest['files'])} files joined and checked", file=sys.stderr)
EOF
SECONDS_OF[verify_and_join]=$(since "$T")

T=$(date +%s.%N)
F="$WORK/files"
tar xzf "$F/code.tar.gz" -C "$WORK/code"
[ -f "$F/heads.tar" ] && tar xf "$F/heads.tar" -C "$WORK/code/peagle"
if [ -f "$F/wheels.tar" ]; then
  mkdir -p "$WORK/wheels" && tar xf "$F/wheels.tar" -C "$WORK/wheels"
  # only what this machine lacks: its own torch, transformers and their dependencies stay as they are
  mapfile -t missing < <(python3 - "$WORK/wheels" <<'EOF'
import sys
from importlib.metadata import PackageNotFoundError, version
from pathlib import Path
for whl in sorted(Path(sys.argv[1]).glob("*.whl")):
    try:
        version(whl.name.split("-")[0])
    except PackageNotFoundError:
        print(whl)
EOF
)
  if [ ${#missing[@]} -gt 0 ]; then
    python3 -m pip install --quiet --no-index --no-deps --find-links "$WORK/wheels" --target "$WORK/site" "${missing[@]}"
  fi
  echo "gpu_train.sh: installed ${#missing[@]} wheel(s) this machine lacked" >&2
fi
export PYTHONPATH="$WORK/site:$WORK/code" PEAGLE_HOME="$WORK/home"
SECONDS_OF[install]=$(since "$T")

T=$(date +%s.%N)
tar xJf "$F/data.tar.xz" -C "$WORK"
DATA_ARGS=(--data "$WORK/data")
[ -d "$WORK/eval-data" ] && DATA_ARGS+=(--eval-data "$WORK/eval-data")
TARGET_ARGS=()
if [ -f "$F/target.gguf" ]; then
  # the embedded model's package, as far as peagle.model.loading looks for it: the GGUF it ships
  GGUF_FILE=$(python3 -c "from peagle.model.loading import GGUF_PACKAGE as p, GGUF_FILE as f; print(p + '/' + f)")
  mkdir -p "$WORK/site/${GGUF_FILE%%/*}" && touch "$WORK/site/${GGUF_FILE%%/*}/__init__.py"
  mv "$F/target.gguf" "$WORK/site/$GGUF_FILE"
  python3 -c "from peagle.model.loading import embedded_model_dir; embedded_model_dir()"
else
  tar xzf "$F/target.tar.gz" -C "$WORK"
  TARGET_ARGS=(--target "$WORK/target")
fi
SECONDS_OF[target]=$(since "$T")

T=$(date +%s.%N)
read -r -a RECIPE_ARGS < "$F/recipe.args"
BUDGET=$(( $(left) - RESERVE ))
[ "$BUDGET" -gt 0 ] || { echo "gpu_train.sh: no time left to train ($(left) s to the deadline, $RESERVE reserved)" >&2; exit 4; }
echo "gpu_train.sh: training both heads for $BUDGET s each, side by side: ${RECIPE_ARGS[*]}" >&2
pids=()
for method in peagle eagle3; do
  init=()
  [ -d "$WORK/code/peagle/heads/smollm2-135m-$method" ] && init=(--init-head "smollm2-135m-$method")
  timeout "$(( $(left) - 5 ))" python3 -m peagle.cli train --method "$method" --out "$WORK/train/$method" \
    "${DATA_ARGS[@]}" "${TARGET_ARGS[@]}" "${init[@]}" --time-budget "$BUDGET" --no-progress "${RECIPE_ARGS[@]}" \
    > "$OUT/$method.log" 2>&1 &
  pids+=($!)
done
rc=0
for pid in "${pids[@]}"; do wait "$pid" || rc=$?; done
SECONDS_OF[train]=$(since "$T")
[ "$rc" = 0 ] || { echo "gpu_train.sh: training failed (exit $rc); see $OUT/peagle.log, $OUT/eagle3.log" >&2; exit "$rc"; }

T=$(date +%s.%N)
for method in peagle eagle3; do
  rm -rf "$OUT/$method"
  python3 -m peagle.train.transfer shard "$WORK/train/$method" "$OUT/$method" > /dev/null
done
SECONDS_OF[shard]=$(since "$T")

python3 - "$OUT/gpu_train.json" "$DEADLINE" "$BUDGET" "$(since "$START")" \
  "$(for k in "${!SECONDS_OF[@]}"; do echo "$k=${SECONDS_OF[$k]}"; done)" <<'EOF'
import json, platform, sys
import torch
path, deadline, budget, total, parts = sys.argv[1], float(sys.argv[2]), float(sys.argv[3]), float(sys.argv[4]), sys.argv[5]
seconds = dict(line.split("=") for line in parts.split())
order = ["verify_and_join", "install", "target", "train", "shard"]
record = {"deadline_s": deadline, "time_budget_s": budget, "total_s": total,
          "seconds": {k: float(seconds[k]) for k in order},
          "device": torch.cuda.get_device_name(0) if torch.cuda.is_available() else platform.processor() or "cpu",
          "python": platform.python_version(), "torch": torch.__version__}
json.dump(record, open(path, "w"), indent=2)
EOF
echo "gpu_train.sh: done in $(since "$START") s of $DEADLINE; heads in $OUT/peagle and $OUT/eagle3" >&2
