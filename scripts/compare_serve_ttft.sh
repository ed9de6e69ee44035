#!/usr/bin/env bash
# TTFT of one long prompt through `sparsekv serve` (HTTP, streamed, token-id prompt) and through
# the offline engine (`bench throughput --single-ttft`), on the same engine flags.
#
# Usage: scripts/compare_serve_ttft.sh [OUTDIR]          (default docs/results)
# Env:   INPUT_LEN (4000)  RUNS (3 HTTP requests, one after another)  PORT (8123)
#        THREADS (2)  ENGINE_FLAGS ("--kv-cache-memory 1")
# Writes OUTDIR/compare_serve_ttft_http.json and OUTDIR/compare_serve_ttft_offline.json and
# prints both TTFTs with the load average before and after.
set -euo pipefail

out="${1:-docs/results}"
input="${INPUT_LEN:-4000}"
runs="${RUNS:-3}"
port="${PORT:-8123}"
threads="${THREADS:-2}"
read -r -a flags <<< "${ENGINE_FLAGS:---kv-cache-memory 1}"
mkdir -p "$out"
echo "before: $(uptime)"

sparsekv serve --port "$port" --threads-per-rank "$threads" "${flags[@]}" \
    > "$out/compare_serve_ttft_server.log" 2>&1 &
server=$!
trap 'kill "$server" 2>/dev/null || true' EXIT
for _ in $(seq 600); do
    curl -sf "http://127.0.0.1:$port/health" > /dev/null && break
    kill -0 "$server" 2>/dev/null || { tail -20 "$out/compare_serve_ttft_server.log"; exit 1; }
    sleep 1
done
sparsekv bench serve --base-url "http://127.0.0.1:$port" --dataset random \
    --input-len "$input" --output-len 2 --num-prompts "$runs" --max-concurrency 1 \
    --no-progress --output "$out/compare_serve_ttft_http.json"
kill "$server"
wait "$server" || true
trap - EXIT

sparsekv bench throughput --num-prompts 0 --single-ttft "$input" --threads "$threads" \
    --no-progress "${flags[@]}" --output "$out/compare_serve_ttft_offline.json"
echo "after: $(uptime)"
