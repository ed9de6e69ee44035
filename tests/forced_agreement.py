"""Teacher-forced greedy agreement of an engine with reference runs on real texts: the harness
of the accuracy tests of ``--weight-dtype`` (``tests/model/test_weight_dtype.py``) and of
``--prefill-qk-dtype`` (``tests/model/test_prefill_qk_int8.py``)."""

from __future__ import annotations

import torch

from sparsekv.bench import common
from sparsekv.config import CompressionConfig
from sparsekv.evaluation.fidelity import fidelity, long_texts
from sparsekv.sampling_params import SamplingParams


def real_prompts(tokenizer, length: int, count: int) -> dict[str, list[int]]:
    """``count`` real texts of at least ``length`` tokens, cut to ``length``, by name."""
    texts = long_texts(tokenizer, min_tokens=length, count=count)
    assert len(texts) == count
    return {name: tokenizer.encode(text, add_special_tokens=False)[:length] for name, text in texts}


def forced_agreement(
    engine, prompts: dict[str, list[int]], references: dict
) -> tuple[float, dict[str, float]]:
    """Mean agreement of ``engine``'s greedy tokens with the references' when each text's
    reference tokens are forced (``bench.fidelity.full_runs``: name -> (tokens, logits)), and
    each text's; asserts that every text ran all of its forced positions."""
    requests = []
    for name, ids in prompts.items():
        tokens = references[name][0]
        params = SamplingParams(max_tokens=len(tokens), temperature=0.0, ignore_eos=True)
        policy = CompressionConfig(method="none")
        requests.append(common.BenchRequest(name, ids, params, policy, tokens, True))
    results = {}

    def compare(output, request):
        tokens, logits = references[output.request_id]
        results[output.request_id] = fidelity(tokens, logits, torch.stack(request.logits))

    common.run_requests(engine, requests, on_finish=compare)
    assert results.keys() == prompts.keys()
    assert all(r.num_positions == len(references[k][0]) for k, r in results.items())
    agreement = sum(r.agreement for r in results.values()) / len(results)
    return agreement, {k: r.agreement for k, r in results.items()}
