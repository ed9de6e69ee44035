"""fp32 prefill through the native flash kernel (``prefill_ops.prefill_attention`` on its fp32
variants) in a whole engine: the same greedy tokens, and logits within 1e-4, as the reference
backend (PyTorch's attention), on a tiny random Llama (head_dim 32) and on SmolLM2-135M
(head_dim 64, GQA 3)."""

from __future__ import annotations

import pytest
import torch

from sparsekv.attention.cpu import prefill_ops
from tests.model.family_models import (
    checkpoint_of,
    generate,
    make_engine,
    random_hf_model,
    random_prompts,
    tiny_config,
)

LOGITS_ATOL = 1e-4


def _compare(checkpoint, prompts, max_tokens, monkeypatch) -> None:
    dtypes = []
    real = prefill_ops.prefill_attention

    def spy(query, *args, **kwargs):
        dtypes.append(query.dtype)
        return real(query, *args, **kwargs)

    with monkeypatch.context() as patch:
        patch.setattr(prefill_ops, "prefill_attention", spy)
        native = generate(make_engine(checkpoint, attention_backend="cpu"), prompts, max_tokens)
    layers = checkpoint.hf_config.num_hidden_layers
    assert dtypes and set(dtypes) == {torch.float32} and len(dtypes) >= layers
    reference = generate(make_engine(checkpoint, attention_backend="torch"), prompts, max_tokens)
    for (tokens, logits), (want_tokens, want_logits) in zip(native, reference):
        assert tokens == want_tokens
        torch.testing.assert_close(logits, want_logits, atol=LOGITS_ATOL, rtol=0)


@pytest.mark.kernel_variant("prefill")
def test_tiny_llama_fp32_prefill_matches_the_reference_backend(monkeypatch):
    config = tiny_config("llama3")
    config.hidden_size, config.head_dim = 128, 32  # a head_dim the kernel takes
    checkpoint = checkpoint_of(random_hf_model(config, seed=3))
    _compare(checkpoint, random_prompts([150, 70, 1], seed=5), 8, monkeypatch)


@pytest.mark.slow
@pytest.mark.kernel_variant("prefill")
def test_smollm2_fp32_prefill_matches_the_reference_backend(smollm2_checkpoint, monkeypatch):
    generator = torch.Generator().manual_seed(11)
    prompts = [torch.randint(10, 40000, (n,), generator=generator).tolist() for n in (100, 30)]
    _compare(smollm2_checkpoint, prompts, 4, monkeypatch)
