"""``TritonBackend`` (``--attention-backend triton``) through the ``AttentionBackend``
interface, against the reference backend on the same inputs (fp32, 1e-5), and a 2-layer
engine run with it against the native CPU backend: same greedy tokens, same kept slots.

Kernels run under Triton's interpreter on CPU tensors (``tests/triton_kernels.py``), or on a
GPU with ``SPARSEKV_TEST_DEVICE=cuda`` (the engine test stays on the CPU: it compares with the
CPU backend).
"""

from __future__ import annotations

import importlib

import pytest
import torch

from sparsekv.attention import torch_ref
from sparsekv.attention.backends import DecodeParams, backend_class
from sparsekv.attention.backends.torch_backend import TorchBackend
from sparsekv.compression.base import Compressor
from sparsekv.config import (
    CacheConfig,
    CompressionConfig,
    EngineConfig,
    ModelConfig,
    SchedulerConfig,
)
from sparsekv.kv_cache import quant
from sparsekv.sampling_params import SamplingParams
from tests import triton_kernels
from tests.conftest import run_to_completion, tiny_checkpoint, tiny_llama_config
from tests.triton_kernels import DEVICE, FP32_TOL, triton_mode  # noqa: F401

triton_kernels.load()
backend_module = importlib.import_module("sparsekv.attention.backends.triton_backend")
TRITON = backend_module.TritonBackend()
REFERENCE = TorchBackend()


def on_device(*tensors):
    return [t.to(DEVICE) for t in tensors]


def assert_close(got, want):
    for a, b in zip(got, want):
        if b is None:
            assert a is None
        else:
            torch.testing.assert_close(a.cpu(), b.cpu(), **FP32_TOL)


def paged_case(seed=0, block_size=16, head_dim=64):
    gen = torch.Generator().manual_seed(seed)
    pool = torch.randn(12, 2, 2, block_size, head_dim, generator=gen)
    tables = torch.tensor([[3, 7, 1], [5, 0, 0], [9, 2, 11]])
    lens, first = torch.tensor([40, 1, 37]), torch.tensor([0, 0, 16])
    query = torch.randn(3, 6, head_dim, generator=gen)
    return query, pool, tables, lens, first


def test_registered_under_its_name():
    assert backend_class("triton") is backend_module.TritonBackend
    assert TRITON.name == "triton" and TRITON.prepare()


@pytest.mark.parametrize(("window", "softcap"), [(None, None), (20, 5.0)])
def test_paged_decode_equals_reference(window, softcap):
    query, pool, tables, lens, first = paged_case()
    params = DecodeParams(tables, lens, 0.125, first, window, softcap, return_attn_mass=True)
    want = REFERENCE.paged_decode(query, pool, params)
    query, pool, tables, lens, first = on_device(query, pool, tables, lens, first)
    params = DecodeParams(tables, lens, 0.125, first, window, softcap, return_attn_mass=True)
    assert_close(TRITON.paged_decode(query, pool, params), want)


@pytest.mark.parametrize("fmt", ["int8", "fp8"])
def test_quantized_decode_equals_reference(fmt):
    query, pool, tables, lens, first = paged_case(seed=1)
    codes, scales = quant.quantize_int8(pool) if fmt == "int8" else quant.quantize_fp8(pool)
    params = DecodeParams(tables, lens, 0.125, first, return_attn_mass=True)
    want = REFERENCE.paged_decode_quantized(query, codes, scales, params)
    query, codes, scales, tables, lens, first = on_device(query, codes, scales, tables, lens, first)
    assert TRITON.supports_quantized_decode(query, codes, scales)
    params = DecodeParams(tables, lens, 0.125, first, return_attn_mass=True)
    assert_close(TRITON.paged_decode_quantized(query, codes, scales, params), want)


@pytest.mark.parametrize(("window", "softcap"), [(None, None), (12, 4.0)])
def test_chunk_from_pages_equals_reference(window, softcap):
    """The chunk kernel reads float pages in place; it refuses codes (quantized pools gather
    their dequantized slots instead)."""
    _, pool, tables, _, _ = paged_case(seed=7)
    gen = torch.Generator().manual_seed(8)
    query = torch.randn(4, 9, 64, generator=gen)
    key, value = torch.randn(2, 2, 9, 64, generator=gen)
    want = REFERENCE.prefill_attention_paged(
        query, key, value, pool, tables[0], 37, 0.1, window, softcap
    )
    got = TRITON.prefill_attention_paged(
        *on_device(query, key, value, pool, tables[0]), 37, 0.1, window, softcap
    )
    assert_close(got, want)
    codes = pool.to(torch.int8)
    with pytest.raises(ValueError, match="kv_pool"):
        backend_module.prefill_paged.chunk_attention_paged(
            *on_device(query, key, value, codes, tables[0]), 37, 0.1
        )


def test_prefill_and_window_scores_equal_reference():
    gen = torch.Generator().manual_seed(2)
    query = torch.randn(4, 9, 64, generator=gen)
    key, value = torch.randn(2, 2, 30, 64, generator=gen)
    for window, softcap in ((None, None), (12, 4.0)):
        want = REFERENCE.prefill_attention(query, key, value, 0.1, window, softcap)
        got = TRITON.prefill_attention(*on_device(query, key, value), 0.1, window, softcap)
        assert_close(got, want)
    _, lse = torch_ref.attention_with_lse(query, key, value, 0.1)
    for given, softcap in ((lse, None), (None, 3.0)):
        want = REFERENCE.window_scores(key, query, given, 0.1, softcap)
        lse_arg = given.to(DEVICE) if given is not None else None
        got = TRITON.window_scores(key.to(DEVICE), query.to(DEVICE), lse_arg, 0.1, softcap)
        torch.testing.assert_close(got.cpu(), want, **FP32_TOL)


def test_window_scores_paged_equals_reference():
    _, pool, _, _, _ = paged_case(seed=3)
    tables = torch.tensor([[3, 7, 1], [5, 0, 2]])
    queries = torch.randn(8, 6, 64, generator=torch.Generator().manual_seed(4))
    want = REFERENCE.window_scores_paged(queries, pool, tables, 40, None, 0.1)
    queries, pool, tables = on_device(queries, pool, tables)
    assert TRITON.supports_window_scores_paged(queries, pool)
    assert_close(TRITON.window_scores_paged(queries, pool, tables, 40, None, 0.1), want)


def test_page_writes_equal_reference():
    _, pool, _, _, _ = paged_case(seed=5)
    gen = torch.Generator().manual_seed(6)
    key, value = torch.randn(2, 5, 2, 64, generator=gen)
    slots = torch.tensor([3, 17, 40, 41, 190])
    dense_key, dense_value = torch.randn(2, 2, 30, 64, generator=gen)
    kept = torch.stack([torch.randperm(30, generator=gen)[:20] for _ in range(2)])
    moved = torch.stack([torch.randperm(40, generator=gen)[:21].sort().values for _ in range(4)])
    moved, source, target = moved.view(2, 2, 21), torch.tensor([[3, 7, 1], [5, 0, 2]]), None
    target = source[:, :2]
    results = []
    for backend, device in ((REFERENCE, torch.device("cpu")), (TRITON, DEVICE)):
        written = pool.clone().to(device)
        backend.write_kv(written, *(t.to(device) for t in (slots, key, value)))
        backend.write_kept_slots(
            written, *(t.to(device) for t in (torch.tensor([4, 6]), dense_key, dense_value, kept))
        )
        backend.move_slots(written, *(t.to(device) for t in (source, target, moved)))
        results.append(written.cpu())
    assert torch.equal(results[0], results[1])


def _greedy_run(
    checkpoint, backend: str, prompt: list[int], chunk: int = 4096
) -> tuple[list[int], list]:
    """Greedy tokens of a SnapKV run (prefill compression, then one decode-time compaction;
    prompts longer than ``chunk`` tokens prefill in chunks) and every kept-slot selection, in
    order."""
    from sparsekv.engine.engine_setup import build_engine_parts
    from sparsekv.engine.llm_engine import LLMEngine

    config = EngineConfig(
        model=ModelConfig(dtype="float32", device="cpu", attention_backend=backend),
        cache=CacheConfig(kv_cache_memory=0.01, num_pages=64, enable_prefix_caching=False),
        compression=CompressionConfig(method="snapkv", budget=24, window=4, full_layers=0),
        scheduler=SchedulerConfig(max_num_batched_tokens=chunk),
    )
    engine = LLMEngine(config, build_engine_parts(config, checkpoint))
    kept = []
    keep_top = Compressor.keep_top

    def recording(self, *args, **kwargs):
        chosen = keep_top(self, *args, **kwargs)
        kept.append(chosen.clone())
        return chosen

    Compressor.keep_top = recording
    try:
        params = SamplingParams(max_tokens=20, temperature=0.0, ignore_eos=True)
        output = run_to_completion(engine, [("a", prompt, params)])["a"]
    finally:
        Compressor.keep_top = keep_top
    return list(output.outputs[0].token_ids), kept


@pytest.mark.parametrize("chunk", [4096, 16], ids=["one-shot", "chunked"])
def test_engine_with_triton_backend_equals_cpu_backend(smollm2_tokenizer, monkeypatch, chunk):
    config = tiny_llama_config(num_layers=2)
    checkpoint, _ = tiny_checkpoint(config, smollm2_tokenizer, seed=3)
    prompt = torch.randint(0, 49152, (40,), generator=torch.Generator().manual_seed(9)).tolist()
    cpu_tokens, cpu_kept = _greedy_run(checkpoint, "cpu", prompt, chunk)
    launches = {}
    for module, name in (
        (backend_module.decode, "paged_decode_attention"),
        (backend_module.prefill, "attention_with_lse"),
        (backend_module.prefill_paged, "chunk_attention_paged"),
        (backend_module.kv_write, "write_kv"),
    ):
        kernel = getattr(module, name)

        def counted(*args, _kernel=kernel, _name=name, **kwargs):
            launches[_name] = launches.get(_name, 0) + 1
            return _kernel(*args, **kwargs)

        monkeypatch.setattr(module, name, counted)
    triton_tokens, triton_kept = _greedy_run(checkpoint, "triton", prompt, chunk)
    # The Triton kernels ran every layer of every step (20 tokens: 1 prefill + 19 decodes).
    assert launches["attention_with_lse"] >= 2 and launches["paged_decode_attention"] >= 2 * 19
    assert launches["write_kv"] >= 2 * 19
    # Chunks of 16: the second chunk of each layer reads the first from the pages; the last
    # one compresses, so it attends over a dense copy that the compressor scores.
    assert launches.get("chunk_attention_paged", 0) == (2 if chunk == 16 else 0)
    assert triton_tokens == cpu_tokens and len(cpu_tokens) == 20
    # Prefill compresses each layer; the decode-time compaction ranks both layers at once.
    assert len(cpu_kept) == 3
    assert len(triton_kept) == len(cpu_kept)
    for a, b in zip(triton_kept, cpu_kept):
        assert torch.equal(a, b)
