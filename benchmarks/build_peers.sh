#!/usr/bin/env bash
# Builds the llama.cpp peers for benchmarks/real_size.py from the llama-cpp-python 0.3.36 sdist:
#   native   (GGML_NATIVE=ON: this CPU's VNNI / AVX512-BF16; the fair peer): llama-server and
#            llama-quantize, via ../shared/peers/build-llama-server.sh into NATIVE_DIR
#            (default /tmp/llama-server), build/ of the sdist's llama.cpp;
#   portable (GGML_NATIVE=OFF, AVX2 + AVX-512 as that script's fallback): llama-server in a second
#            build tree of the same source (build-portable/), for comparison only.
# The native binary must serve a model, not only print --version: on a VM that advertises AMX but
# faults on its tile instructions (ldtilecfg: SIGSEGV/SIGILL at the first matmul) it is rebuilt
# native without AMX (-mno-amx-*), keeping VNNI and AVX512-BF16.
# About 5-7 minutes per build on 2 cores. Usage: build_peers.sh [NATIVE_DIR]; prints the binaries.
# SKIP_PORTABLE=1 builds only the native peer; CHECK_MODEL=FILE.gguf picks the model of the check
# (default: inferd's smollm2 GGUF).
set -euo pipefail
PEERS=${PEERS_SCRIPT:-/work/shared/peers/build-llama-server.sh}
DIR=${1:-/tmp/llama-server}
SRC=$DIR/llama_cpp_python-0.3.36/vendor/llama.cpp
CHECK_MODEL=${CHECK_MODEL:-$(ls "${INFERD_HOME:-$HOME/.cache/inferd}"/snapshots/smollm2/*.gguf 2>/dev/null | head -n 1)}
COMMON=(-DLLAMA_CURL=OFF -DLLAMA_BUILD_TESTS=OFF -DCMAKE_BUILD_TYPE=Release)

serves() {  # serves BIN: it loads CHECK_MODEL (warm-up matmuls included) and answers /health
  local bin=$1 port=$((20000 + RANDOM % 20000)) log pid
  [ -n "$CHECK_MODEL" ] || return 0
  log=$(mktemp)
  "$bin" -m "$CHECK_MODEL" --host 127.0.0.1 --port "$port" -t 2 -np 1 -c 512 --no-webui >"$log" 2>&1 &
  pid=$!
  for _ in $(seq 180); do
    if ! kill -0 "$pid" 2>/dev/null; then
      wait "$pid" || echo "$bin died (exit $?) loading $CHECK_MODEL: $(tail -n 2 "$log")" >&2
      rm -f "$log"
      return 1
    fi
    if curl -sf "http://127.0.0.1:$port/health" >/dev/null; then
      kill "$pid"; wait "$pid" || true; rm -f "$log"
      return 0
    fi
    sleep 1
  done
  kill "$pid"; wait "$pid" || true; rm -f "$log"
  return 1
}

t0=$(date +%s)
SERVER=$(bash "$PEERS" "$DIR" | tail -n 1)
echo "native llama-server: $SERVER ($(($(date +%s) - t0)) s)" >&2
if ! serves "$SERVER"; then
  t0=$(date +%s)
  NOAMX="-mno-amx-tile -mno-amx-int8 -mno-amx-bf16"
  rm -rf "$SRC/build"
  cmake -S "$SRC" -B "$SRC/build" -DGGML_NATIVE=ON -DCMAKE_C_FLAGS="$NOAMX" \
    -DCMAKE_CXX_FLAGS="$NOAMX" "${COMMON[@]}" >/dev/null
  cmake --build "$SRC/build" --target llama-server -j2 >/dev/null
  serves "$SERVER" || { echo "native llama-server without AMX still fails" >&2; exit 1; }
  echo "native llama-server rebuilt without AMX: $SERVER ($(($(date +%s) - t0)) s)" >&2
fi
# llama-quantize in the same (native) build tree, so the quantized files are the peer's own.
t0=$(date +%s)
cmake --build "$SRC/build" --target llama-quantize -j2 >/dev/null
echo "llama-quantize: $SRC/build/bin/llama-quantize ($(($(date +%s) - t0)) s)" >&2
PORT_BIN=$SRC/build-portable/bin/llama-server
if [ "${SKIP_PORTABLE:-0}" != 1 ] && ! { [ -x "$PORT_BIN" ] && serves "$PORT_BIN"; }; then
  t0=$(date +%s)
  rm -rf "$SRC/build-portable"
  cmake -S "$SRC" -B "$SRC/build-portable" -DGGML_NATIVE=OFF -DGGML_AVX2=ON -DGGML_AVX512=ON \
    -DGGML_FMA=ON -DGGML_F16C=ON "${COMMON[@]}" >/dev/null
  cmake --build "$SRC/build-portable" --target llama-server -j2 >/dev/null
  echo "portable llama-server: $PORT_BIN ($(($(date +%s) - t0)) s)" >&2
fi
echo "native=$SERVER"
echo "quantize=$SRC/build/bin/llama-quantize"
if [ -x "$PORT_BIN" ]; then echo "portable=$PORT_BIN"; fi
