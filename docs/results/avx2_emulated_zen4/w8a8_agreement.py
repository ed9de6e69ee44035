"""Teacher-forced agreement of `--weight-dtype` engines with the dense fp32 engine's greedy
tokens on SmolLM2 (8 texts, 128-token prompts, 64 tokens: the test suite's `_agreement`), written
with provenance to the JSON path given. Run from the repository root under the AVX2 variables of
summary.md: `python docs/results/avx2_emulated_zen4/w8a8_agreement.py OUT.json w8a8,int8`."""

import json
import sys

import torch

from sparsekv.evaluation.provenance import provenance
from sparsekv.loader import load_checkpoint
from sparsekv.models.quant import int8_rows
from tests.model import test_weight_dtype as suite

out, weight_dtypes = sys.argv[1], sys.argv[2].split(",")
checkpoint = load_checkpoint("smollm2-135m-instruct", torch.float32)
references = suite._references(checkpoint)
rows = []
for weight_dtype in weight_dtypes:
    agreement, per_text = suite._agreement(checkpoint, references, weight_dtype, "float32")
    rows.append({"weight_dtype": weight_dtype, "agreement": agreement, "per_text": per_text})
    print(weight_dtype, f"{agreement:.3f}", f"worst {min(per_text.values()):.3f}", flush=True)
document = {
    "int8_gemm_saturates": int8_rows.int8_gemm_saturates(),
    "rows": rows,
    "provenance": provenance({"weight_dtypes": weight_dtypes, "dtype": "float32"}),
}
with open(out, "w") as f:
    json.dump(document, f, indent=1, default=str)
