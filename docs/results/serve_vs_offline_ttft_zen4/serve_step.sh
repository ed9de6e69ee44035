#!/bin/bash
# One `sparsekv serve` process with every engine step timed (steplog.py), four 4000-token
# prompts one at a time (`sparsekv bench serve`), then the TTFT of each and the step times.
# Usage: serve_step.sh TAG OUT_DIR [serve args...]; run from the repository root.
here=$(dirname "$0"); tag=$1; out=$2; shift 2
python "$here/steplog.py" serve --port 8131 --threads-per-rank 2 --kv-cache-memory 1 "$@" > "$out/srv_$tag.log" 2>&1 &
for k in $(seq 120); do curl -sf http://127.0.0.1:8131/health >/dev/null && break; sleep 1; done
sparsekv bench serve --base-url http://127.0.0.1:8131 --dataset random --input-len 4000 --output-len 2 \
  --num-prompts 4 --max-concurrency 1 --no-progress --output "$out/srv_$tag.json" > /dev/null 2>&1
pkill -f "steplog.py serve --port 8131"; sleep 3
grep STEP "$out/srv_$tag.log" > "$out/srv_${tag}_steps.txt"
