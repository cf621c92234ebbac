#!/usr/bin/env bash
# The engine's lossless checks and a short decode benchmark on a CUDA machine with no network, small random models
# (under 8 minutes on one GPU). Installs this package without touching the machine's torch.
#   bash scripts/device_check.sh            # results also in $OUT/device_check.json when OUT is set
set -euo pipefail
cd "$(dirname "$0")/.."
python3 -c "import torch; assert torch.cuda.is_available(), 'no CUDA device'; print(torch.cuda.get_device_name(0))"
python3 -m pip install --quiet --disable-pip-version-check --no-deps -e . 2>/dev/null \
  || python3 -m pip install --quiet --disable-pip-version-check -e .
python3 scripts/device_check.py --device cuda ${OUT:+--out "$OUT/device_check.json"}
