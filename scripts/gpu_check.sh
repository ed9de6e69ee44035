#!/usr/bin/env bash
# GPU check of the Triton attention backend, under 8 minutes, each result written to $OUT as
# soon as it exists (summary.txt gathers one line per step):
#
#   1. env.txt          GPU, driver, Python, torch, triton, git SHA
#   2. conformance.*    the Triton conformance tests on the GPU: fp32, fp16 and bf16 (bf16 runs
#                       only here: the interpreter's bf16 arithmetic is not the GPU's), PyTorch's
#                       flash prefill beside the Triton one; the backend tests when the
#                       AttentionBackend seam is present
#   3. decode_bench.*   decode attention alone: batch 64 x 4096 slots, Llama-3-8B heads, bf16;
#                       CUDA-event time against bytes read / measured copy bandwidth
#   4. graphs.*         graph-captured vs eager engine decode (scripts/gpu_check_graphs.py, when
#                       present)
#   5. engine_bench.*   random-weight Llama-3-8B shape (concurrency 1, 8, 32, 64) and SmolLM2
#                       shape: full cache vs SnapKV at 4000 in / 256 out, output tok/s and TTFT
#                       P50 (scripts/gpu_bench_engine.py, one JSON entry per run as it ends)
#
# Needs: a CUDA GPU, python with torch and triton, and the wheels of
# scripts/gpu_check_requirements.txt in $WHEELS (default: .gpu_wheels beside scripts/) unless
# pytest is already installed. Usage: OUT=/path/to/results scripts/gpu_check.sh
set -u
REPO=$(cd "$(dirname "$0")/.." && pwd)
OUT=${OUT:-$REPO/gpu_check_out}
PY=${PYTHON:-python3}
WHEELS=${WHEELS:-$REPO/.gpu_wheels}
DEPS=${TMPDIR:-/tmp}/sparsekv_gpu_check_deps
mkdir -p "$OUT"
START=$(date +%s)
log() { echo "[$(($(date +%s) - START))s] $*" | tee -a "$OUT/summary.txt"; }
cd "$REPO" || exit 1

{
  nvidia-smi
  "$PY" -c "import sys, torch, triton; print(sys.version); print('torch', torch.__version__, 'cuda', torch.version.cuda); print('triton', triton.__version__); print(torch.cuda.get_device_name(0))"
  git rev-parse HEAD 2>/dev/null || true
} > "$OUT/env.txt" 2>&1
log "env: $(tail -2 "$OUT/env.txt" | head -1)"

# Test tools: from the carried wheels into a private folder (the system site stays as it is).
if ! "$PY" -c "import pytest, pytest_timeout" 2>/dev/null; then
  "$PY" -m pip install -q --no-index --find-links "$WHEELS" --target "$DEPS" \
    -r scripts/gpu_check_requirements.txt > "$OUT/pip.txt" 2>&1 \
    || log "pip: installing from $WHEELS failed (pip.txt)"
fi
export PYTHONPATH="$REPO:$DEPS${PYTHONPATH:+:$PYTHONPATH}"
export SPARSEKV_TEST_DEVICE=cuda
unset TRITON_INTERPRET

# 2. Conformance. The backend tests need the AttentionBackend seam; their engine test compares
# with the CPU backend on CPU tensors, so it stays in CPU CI.
TESTS="tests/unit/test_triton_decode.py tests/unit/test_triton_prefill.py tests/unit/test_triton_kv_write.py"
if [ -f sparsekv/attention/backends/base.py ]; then
  TESTS="$TESTS tests/unit/test_triton_backend.py"
fi
# shellcheck disable=SC2086  # TESTS is a list of paths
timeout 240 "$PY" -m pytest -q -p no:cacheprovider --timeout=120 -k "not engine" $TESTS \
  --junitxml="$OUT/conformance.xml" > "$OUT/conformance.txt" 2>&1
log "conformance (rc=$?): $(tail -1 "$OUT/conformance.txt")"

# 3. Decode attention microbenchmark.
timeout 90 "$PY" scripts/gpu_bench_decode.py --out "$OUT/decode_bench.json" \
  > "$OUT/decode_bench.txt" 2>&1
log "decode bench (rc=$?): $(tail -1 "$OUT/decode_bench.txt")"

# 4. Graph-captured vs eager decode of the engine.
if [ -f scripts/gpu_check_graphs.py ]; then
  timeout 150 "$PY" scripts/gpu_check_graphs.py --out "$OUT/graphs.json" > "$OUT/graphs.txt" 2>&1
  log "graphs vs eager (rc=$?): $(tail -1 "$OUT/graphs.txt")"
else
  log "graphs vs eager: scripts/gpu_check_graphs.py not present, skipped"
fi

# 5. Engine sweep with random-weight models. It starts no run past --deadline-s, so that the
# whole check stays under 8 minutes; each run is in engine_bench.json as soon as it ends.
LEFT=$((450 - $(date +%s) + START))
if [ "$LEFT" -gt 60 ]; then
  timeout "$LEFT" "$PY" scripts/gpu_bench_engine.py --out "$OUT/engine_bench.json" \
    --deadline-s $((LEFT - 60)) > "$OUT/engine_bench.txt" 2>&1
  log "engine bench (rc=$?): $(tail -1 "$OUT/engine_bench.txt")"
else
  log "engine bench: skipped, ${LEFT}s left"
fi
log "done in $(($(date +%s) - START)) s"
