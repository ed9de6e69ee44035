#!/bin/bash
# Three rounds of: one server (4 prompts, serve_step.sh), then one offline single TTFT, in turns.
# Usage: ab_serve_off.sh OUT_DIR; run from the repository root with sparsekv on PATH.
here=$(dirname "$0"); out=$1
for i in 1 2 3; do
  "$here/serve_step.sh" s$i "$out" --weight-dtype w8a8 --prefill-qk-dtype int8
  python "$here/steplog.py" bench throughput --num-prompts 0 --single-ttft 4000 --threads 2 \
    --weight-dtype w8a8 --prefill-qk-dtype int8 --output "$out/off$i.json" 2>&1 | grep "STEP\|single"
done
