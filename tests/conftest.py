"""Shared fixtures: the real tokenizer and model loaded once, tiny random models, and the
page-leak check that runs after every test (no page leaks: the free count returns to its
baseline after every request, finished, aborted, failed or preempted)."""

from __future__ import annotations

import gc
import os
import types

import pytest
import torch

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
# On CPUs without native bf16 the engine packs fp32 linears for oneDNN, which moves results by
# fp32 rounding against the references (nn.Linear) the suite compares with: its engines, in this
# process and in the servers it starts, stay unpacked. tests/unit/test_prepack_fp32.py turns the
# packing back on to test it.
os.environ.setdefault("SPARSEKV_FP32_PREPACK", "0")
# Triton fixes interpretation when it is first imported (``tests/triton_kernels.py``); on CPU
# the Triton tests need the interpreter, whichever library imports triton first.
if os.environ.get("SPARSEKV_TEST_DEVICE", "cpu") == "cpu":
    os.environ.setdefault("TRITON_INTERPRET", "1")


@pytest.fixture(scope="session")
def smollm2_checkpoint():
    """SmolLM2-135M-Instruct weights in fp32 (loaded once per session)."""
    from sparsekv.loader import load_checkpoint

    return load_checkpoint("smollm2-135m-instruct", torch.float32)


@pytest.fixture(scope="session")
def smollm2_tokenizer(smollm2_checkpoint):
    """The SmolLM2 tokenizer (from the loader's metadata cache)."""
    return smollm2_checkpoint.tokenizer


def tiny_llama_config(num_heads: int = 4, num_kv_heads: int = 2, num_layers: int = 3, **kw):
    """A tiny random Llama config with the SmolLM2 vocabulary (so its tokenizer works)."""
    from transformers import LlamaConfig

    values = dict(
        vocab_size=49152,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=num_layers,
        num_attention_heads=num_heads,
        num_key_value_heads=num_kv_heads,
        max_position_embeddings=4096,
        tie_word_embeddings=False,
        eos_token_id=2,
        rms_norm_eps=1e-5,
    )
    values.update(kw)
    return LlamaConfig(**values)


def tiny_checkpoint(config, tokenizer, seed: int = 0):
    """(checkpoint namespace, HF reference model) for a random model of ``config``."""
    from transformers import AutoModelForCausalLM

    torch.manual_seed(seed)
    hf_model = AutoModelForCausalLM.from_config(config).eval()
    # Larger random weights make attention peakier, so evictions change outputs visibly.
    checkpoint = types.SimpleNamespace(
        name="tiny",
        path=None,
        hf_config=config,
        tokenizer=tokenizer,
        state_dict=hf_model.state_dict(),
    )
    return checkpoint, hf_model


class EngineRegistry:
    """Engines created during the session, checked for leaked pages after each test."""

    def __init__(self) -> None:
        self.engines: list = []
        self._checked_at: dict[int, int] = {}
        self._transient: set[int] = set()

    def add(self, engine, transient: bool = False):
        """Register ``engine``; a ``transient`` one (from ``make_engine``) is dropped after the
        test that made it has been checked, so its model and pool can be freed."""
        self.engines.append(engine)
        if transient:
            self._transient.add(id(engine))
        return engine

    def drop_transient(self) -> bool:
        """Forget the transient engines; True if there were any."""
        if not self._transient:
            return False
        self.engines = [e for e in self.engines if id(e) not in self._transient]
        for key in self._transient:
            self._checked_at.pop(key, None)
        self._transient.clear()
        return True

    def needs_check(self, engine) -> bool:
        """True once per batch of new work (the full ref-count check walks every page)."""
        mark = engine.stats.num_prompt_tokens
        if self._checked_at.get(id(engine)) == mark:
            return False
        self._checked_at[id(engine)] = mark
        return True


_REGISTRY = EngineRegistry()


@pytest.fixture(scope="session")
def engine_registry() -> EngineRegistry:
    return _REGISTRY


@pytest.fixture
def make_engine(smollm2_tokenizer):
    """Factory: ``make_engine(checkpoint, **settings) -> LLMEngine`` (registered for leak checks)."""
    from sparsekv.config import (
        CacheConfig,
        CompressionConfig,
        EngineConfig,
        ModelConfig,
        SchedulerConfig,
        SpeculativeConfig,
    )
    from sparsekv.engine.engine_setup import build_engine_parts
    from sparsekv.engine.llm_engine import LLMEngine

    def factory(
        checkpoint,
        compression=None,
        num_pages=None,
        block_size=16,
        prefix_caching=True,
        prefix_cache_uncompressed=False,
        kv_cache_dtype="auto",
        full_precision_layers=None,
        dtype="float32",
        weight_dtype="auto",
        speculative=None,
        **sched,
    ):
        sched.setdefault("watermark_pages", 0)
        cache = CacheConfig(
            kv_cache_memory=0.05,
            block_size=block_size,
            num_pages=num_pages,
            enable_prefix_caching=prefix_caching,
            prefix_cache_uncompressed=prefix_cache_uncompressed,
            kv_cache_dtype=kv_cache_dtype,
            kv_cache_full_precision_layers=full_precision_layers,
        )
        config = EngineConfig(
            model=ModelConfig(dtype=dtype, weight_dtype=weight_dtype),
            cache=cache,
            compression=compression or CompressionConfig(method="none"),
            scheduler=SchedulerConfig(**sched),
            speculative=speculative or SpeculativeConfig(),
        )
        engine = LLMEngine(config, build_engine_parts(config, checkpoint))
        return _REGISTRY.add(engine, transient=True)

    return factory


@pytest.fixture(autouse=True)
def no_page_leaks():
    """After every test, every engine's pool is back to its baseline and its ref counts hold.

    Baseline: with no live request every page is free or reclaimable (held by the prefix cache
    alone: cached pages stay cached across requests, which is not a leak).
    """
    yield
    try:
        for engine in _REGISTRY.engines:
            leftover = engine.num_unfinished_requests
            free, total = engine.kv.num_free_pages, engine.kv.num_total_pages
            for request_id in list(engine._groups):
                engine.abort_request(request_id)
            if _REGISTRY.needs_check(engine):
                engine.kv.check_invariants()
            assert leftover == 0, f"{leftover} requests left unfinished"
            assert free == total, f"page leak: {total - free} of {total} pages still held"
    finally:
        # Engines of one test are not kept for the session: a bf16 SmolLM2 engine holds
        # ~0.75 GB (weights, packed copies, pool); tests building dozens exhausted CI's RAM.
        if _REGISTRY.drop_transient():
            gc.collect()


def run_to_completion(engine, requests):
    """Add ``(request_id, prompt_ids, params[, compression])`` tuples and step until done.

    Returns:
        dict request_id -> final RequestOutput.
    """
    for item in requests:
        engine.add_request(*item)
    finished = {}
    while engine.has_unfinished_requests():
        for output in engine.step():
            if output.finished:
                finished[output.request_id] = output
    return finished


def record_selections(monkeypatch, cls, name="select", keep=None):
    """Patch ``cls.select`` (or ``cls.select_heads``) to record what every call returns.

    Returns:
        A list that fills, per call where ``keep(view, scores)`` holds (every call without
        ``keep``), with a copy of the ``[num_kv_heads, k]`` kept slots (``select``) or a list of
        per-head slot lists (``select_heads``).
    """
    chosen = []
    original = getattr(cls, name)

    def recording(self, view, budget, window, scores=None):
        kept = original(self, view, budget, window, scores)
        if keep is None or keep(view, scores):
            chosen.append(kept.clone() if name == "select" else [row.tolist() for row in kept])
        return kept

    monkeypatch.setattr(cls, name, recording)
    return chosen


# Kernel variants (tests/kernel_variants.py): the cases of variants this CPU cannot run are
# deselected and named as untested in a one-line summary at the end of the run.
def pytest_configure(config):
    config.addinivalue_line(
        "markers", "kernel_variant(family, variant=None): checks that native kernel variant"
    )


def pytest_collection_modifyitems(config, items):
    from tests import kernel_variants

    kernel_variants.select(config, items)


def pytest_runtest_logreport(report):
    from tests import kernel_variants

    kernel_variants.record(report)


def pytest_terminal_summary(terminalreporter):
    from tests import kernel_variants

    line = kernel_variants.summary()
    if line is not None:
        terminalreporter.write_line(line)
