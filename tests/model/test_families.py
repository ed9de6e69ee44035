"""Every supported family on a tiny random model vs Hugging Face transformers (fp32, eager).

Per family: a ragged batch (a 100-token prompt among shorter ones) prefilled together and
decoded 32 greedy tokens; every sampled position's logits equal HF's teacher-forced forward
within 1e-3 and the tokens equal HF ``generate``'s; a chunked prefill equals the one-shot one.
The 100-token prompt is past each family's sliding window (16) and original RoPE context
(32 / 64). Phi-3's longrope is checked on both sides of its switch: a ``max_model_len`` within
the original context keeps the short factors, a longer one the long factors.
"""

from __future__ import annotations

import pytest
import torch

from sparsekv.kv_cache.spec import LayerSpec
from sparsekv.models.decoder import DecoderForCausalLM
from tests.model.family_models import (
    ATOL,
    FAMILY_CONFIGS,
    WINDOW,
    checkpoint_of,
    generate,
    make_engine,
    max_model_len,
    random_hf_model,
    random_prompts,
    teacher_forced_logits,
    tiny_config,
)

NUM_TOKENS = 32
# Prompt lengths per case: every prompt (plus its 32 tokens) on the engine's side of a switch.
PROMPT_LENS = {"phi3-short": (30, 17, 9), "phi3-long": (100, 80, 70)}
DEFAULT_LENS = (100, 37, 9)


@pytest.fixture(scope="module", autouse=True)
def one_thread():
    """Tiny matmuls run faster on one thread (no OpenMP barriers on a 2-core machine)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.fixture(scope="module", params=sorted(FAMILY_CONFIGS))
def family(request):
    """``(name, hf_model, checkpoint, prompts, one-shot results)`` of one family case."""
    name = request.param
    hf_model = random_hf_model(tiny_config(name))
    checkpoint = checkpoint_of(hf_model)
    prompts = random_prompts(PROMPT_LENS.get(name, DEFAULT_LENS), seed=len(name))
    engine = make_engine(checkpoint, max_len=max_model_len(name))
    return name, hf_model, checkpoint, prompts, generate(engine, prompts, NUM_TOKENS)


def test_ragged_batch_and_greedy_match_hf(family):
    name, hf_model, _, prompts, results = family
    for prompt, (tokens, logits) in zip(prompts, results):
        assert len(tokens) == NUM_TOKENS
        expected = teacher_forced_logits(hf_model, prompt, tokens)
        torch.testing.assert_close(logits, expected, atol=ATOL, rtol=0)
    # HF's own greedy loop on the longest prompt gives the same tokens (it stops at EOS,
    # where the engine was told to go on).
    prompt = torch.tensor([prompts[0]])
    hf_tokens = hf_model.generate(prompt, max_new_tokens=NUM_TOKENS, do_sample=False)
    hf_tokens = hf_tokens[0, prompt.shape[1] :].tolist()
    assert results[0][0][: len(hf_tokens)] == hf_tokens
    assert len(hf_tokens) == NUM_TOKENS or hf_tokens[-1] == hf_model.config.eos_token_id


def test_chunked_prefill_equals_one_shot(family):
    _, _, checkpoint, prompts, reference = family
    name = family[0]
    engine = make_engine(checkpoint, max_len=max_model_len(name), max_num_batched_tokens=23)
    results = generate(engine, prompts, 8)
    for (tokens, logits), (ref_tokens, ref_logits) in zip(results, reference):
        assert tokens == ref_tokens[:8]
        torch.testing.assert_close(logits, ref_logits[:8], atol=1e-4, rtol=0)


def test_prompts_reach_past_windows_and_original_context(family):
    """The 100-token prompts exercise what the family varies (a meta-check of the cases)."""
    name, hf_model, _, prompts, _ = family
    config = hf_model.config
    rope = config.rope_parameters
    original = rope.get("original_max_position_embeddings")
    longest = max(len(p) for p in prompts)
    if getattr(config, "sliding_window", None):
        assert longest > config.sliding_window == WINDOW
    if original and name != "phi3-short":
        assert longest > original
    if name == "phi3-short":
        assert longest + NUM_TOKENS <= original


def test_layer_specs_follow_the_windows():
    """Mistral's real window slides every layer; one at least max_model_len is no window;
    Gemma 2 alternates; Qwen2 without use_sliding_window is full."""
    mistral = tiny_config("mistral")
    assert DecoderForCausalLM(mistral).layer_specs() == [LayerSpec("sliding", WINDOW)] * 3
    assert DecoderForCausalLM(mistral, max_model_len=WINDOW).layer_specs() == [LayerSpec()] * 3
    gemma2 = DecoderForCausalLM(tiny_config("gemma2"), max_model_len=512)
    sliding = LayerSpec("sliding", WINDOW)
    assert gemma2.layer_specs() == [sliding, LayerSpec(), sliding]
    assert gemma2.attn_logit_softcap == 4.0 and gemma2.final_logit_softcap == 3.0
    assert DecoderForCausalLM(tiny_config("qwen2")).layer_specs() == [LayerSpec()] * 3
    phi3 = DecoderForCausalLM(tiny_config("phi3-long"))
    assert phi3.variant.rotary_dim == 8 and phi3.head_dim == 16


def test_longrope_sides_differ():
    """The two Phi-3 cases really run different factors (else one of them proves nothing)."""
    short = DecoderForCausalLM(tiny_config("phi3-short"), max_model_len=64)
    long = DecoderForCausalLM(tiny_config("phi3-long"), max_model_len=256)
    assert not torch.allclose(
        short.rotary["full_attention"].inv_freq, long.rotary["full_attention"].inv_freq
    )


def test_generation_config_eos_ids_stop(tmp_path):
    """Several EOS ids of generation_config.json (Llama 3.x's ``<|eot_id|>``) all stop."""
    from sparsekv.loader import load_checkpoint

    hf_model = random_hf_model(tiny_config("llama3"))
    hf_model.save_pretrained(tmp_path)
    hf_model.generation_config.eos_token_id = [1, 7, 9]
    hf_model.generation_config.save_pretrained(tmp_path)
    checkpoint = load_checkpoint(str(tmp_path), torch.float32, tokenizer=_tokenizer_dir(tmp_path))
    assert checkpoint.eos_token_ids == (1, 7, 9)
    engine = make_engine(checkpoint)
    assert {1, 7, 9} <= set(engine.parts.eos_token_ids)


def _tokenizer_dir(tmp_path):
    from tests.model.family_models import tiny_tokenizer

    folder = tmp_path / "tokenizer"
    tiny_tokenizer().save_pretrained(folder)
    return str(folder)
