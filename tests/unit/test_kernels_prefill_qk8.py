"""The prefill kernel with int8 Q·K^T (``prefill_ops.prefill_attention(..., qk_int8=True)``,
``csrc/prefill_qk8.h``) against a PyTorch reference of the same arithmetic, and against exact
attention; the backend's and the config's ``prefill_qk_dtype``.

The kernel runs on the ``avx512_bf16`` variant (AVX512-BF16 + AVX512-VNNI), so these cases run
on every CPU that runs that variant (AMD Zen 4, and Intel AMX CPUs through ``isa=``); elsewhere
they are deselected and named untested (``tests/kernel_variants.py``).

The reference (:func:`int8_reference`): keys minus their channel means over all keys, keys and
queries quantized per row to ``round(x * 127 / max|x|)``, products summed exactly, scaled by
both rows' ``max|x| / 127``, plus ``scale * q·mean`` (which the kernel adds to the lse only: a
shift shared by a row's logits). Tolerances: the kernel still rounds the probabilities to bf16
for the value product (out: rtol 1.6e-2 + atol 1e-2, as the bf16 tests); its lse is fp32 from
the same integer products, off only by its exp2 polynomial and fp32 sums (measured <= 7.6e-5
against the reference; one flipped code would move a logit by ~2e-3, so the bound catches it).
"""

from __future__ import annotations

import pytest
import torch

from sparsekv.attention import torch_ref
from sparsekv.attention.backends import create_backend
from sparsekv.attention.backends.cpu_native import CpuNativeBackend
from sparsekv.attention.cpu import build, prefill_ops
from sparsekv.config import ModelConfig

ISA = "avx512_bf16"
pytestmark = pytest.mark.kernel_variant("prefill", ISA)
OUT_TOL = {"atol": 1e-2, "rtol": 1.6e-2}
LSE_ATOL = 3e-4


@pytest.fixture(scope="module", autouse=True)
def kernel() -> None:
    """Fails (not skips) when the extension did not build or lacks the int8 kernel."""
    assert build.load_extension() is not None, "the native extension failed to build"
    assert prefill_ops.prefill_qk_int8_status() == "ok"


def make_qkv(num_heads, num_kv_heads, num_queries, num_keys, head_dim, seed=0, bias=0.0):
    """bf16 q, k, v of std 1; ``bias`` adds a per-channel offset of that std to every key (the
    channel outliers that smoothing removes)."""
    gen = torch.Generator().manual_seed(seed)

    def rand(*shape):
        return torch.randn(*shape, generator=gen)

    key = rand(num_kv_heads, num_keys, head_dim) + bias * rand(1, 1, head_dim)
    return (
        rand(num_heads, num_queries, head_dim).bfloat16(),
        key.bfloat16(),
        rand(num_kv_heads, num_keys, head_dim).bfloat16(),
    )


def quantize_rows(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Symmetric per-row int8 of fp32 ``x [..., d]``: (codes as fp32, scales ``[..., 1]``)."""
    amax = x.abs().amax(-1, keepdim=True)
    # 127 / amax as a true division (``127 / tensor`` is 127 * reciprocal, an ulp off).
    inverse = torch.div(torch.full_like(amax, 127.0), amax)
    codes = torch.where(amax > 0, torch.round(x * inverse), torch.zeros_like(x))
    return codes, amax / 127


def int8_reference(query, key, value, scale, sliding_window=None, smooth=True):
    """(out, lse) of attention with the kernel's int8 logits (module docstring), fp32."""
    group = query.shape[0] // key.shape[0]
    keys = key.float()
    # The kernel's mean: a sequential fp32 sum times 1 / n (a mean rounded otherwise flips a
    # few codes by one, which moves a logit by ~2e-3).
    mean = torch.zeros_like(keys[:, :1])
    if smooth:
        for j in range(keys.shape[1]):
            mean += keys[:, j : j + 1]
        mean *= torch.tensor(1.0 / keys.shape[1], dtype=torch.float32)
    q_codes, q_scale = quantize_rows(query.float())
    k_codes, k_scale = quantize_rows(keys - mean)
    k_codes, k_scale = k_codes.repeat_interleave(group, 0), k_scale.repeat_interleave(group, 0)
    logits = (q_codes @ k_codes.transpose(1, 2)) * q_scale * k_scale.transpose(1, 2)
    logits = (logits + query.float() @ mean.repeat_interleave(group, 0).transpose(1, 2)) * scale
    num_queries, num_keys = query.shape[1], key.shape[1]
    rows = torch.arange(num_queries)[:, None] + num_keys - num_queries
    cols = torch.arange(num_keys)[None, :]
    visible = cols <= rows
    if sliding_window is not None:
        visible &= cols > rows - sliding_window
    logits = logits.masked_fill(~visible, float("-inf"))
    out = logits.softmax(-1) @ value.float().repeat_interleave(group, 0)
    return out, torch.logsumexp(logits, -1)


def run_int8(query, key, value, sliding_window=None):
    scale = query.shape[-1] ** -0.5
    out, lse = prefill_ops.prefill_attention(
        query, key, value, scale, sliding_window, isa=ISA, qk_int8=True
    )
    assert out.dtype == torch.bfloat16 and out.shape == query.shape
    assert lse.dtype == torch.float32 and lse.shape == query.shape[:2]
    return out, lse, scale


def check_reference(query, key, value, sliding_window=None):
    out, lse, scale = run_int8(query, key, value, sliding_window)
    ref_out, ref_lse = int8_reference(query, key, value, scale, sliding_window)
    torch.testing.assert_close(out.float(), ref_out, **OUT_TOL)
    torch.testing.assert_close(lse, ref_lse, atol=LSE_ATOL, rtol=0)


@pytest.mark.parametrize("num_heads,num_kv_heads", [(2, 2), (9, 3), (8, 2)], ids=["g1", "g3", "g4"])
@pytest.mark.parametrize("head_dim", [32, 64, 128, 256])
@pytest.mark.parametrize("num_queries,num_keys", [(1, 1), (17, 17), (100, 100), (333, 410)])
def test_int8_logits_match_the_reference(num_heads, num_kv_heads, head_dim, num_queries, num_keys):
    seed = num_keys + head_dim
    check_reference(*make_qkv(num_heads, num_kv_heads, num_queries, num_keys, head_dim, seed))


@pytest.mark.parametrize("window", [1, 24, 100])
def test_int8_logits_with_a_sliding_window(window):
    check_reference(*make_qkv(8, 2, 150, 200, 64, seed=window), sliding_window=window)


def test_int8_logits_with_strided_queries_and_keys_and_a_long_prompt():
    query, key, value = make_qkv(9, 3, 1000, 1000, 64, seed=5, bias=2.0)

    def token_major(x):  # [heads, n, d] viewed from a [n, heads, d] tensor, as the model's
        return x.transpose(0, 1).contiguous().transpose(0, 1)

    assert token_major(key).stride() == (64, 3 * 64, 1)
    check_reference(token_major(query), token_major(key), token_major(value))


def test_lse_keeps_the_smoothing_shift_and_matches_exact_attention():
    # Keys with a channel offset 4x their spread: the shift q·mean is large, and the kernel's lse
    # must still be the lse of the unsmoothed logits, as the bf16 kernel's is (chunked prefill
    # merges partial results by it).
    query, key, value = make_qkv(6, 2, 200, 260, 64, seed=3, bias=4.0)
    out, lse, scale = run_int8(query, key, value)
    exact_out, exact_lse = torch_ref.attention_with_lse(
        query.float(), key.float(), value.float(), scale
    )
    bf16_out, bf16_lse = prefill_ops.prefill_attention(query, key, value, scale, isa=ISA)
    shift = (query.float() @ key.float().mean(1, keepdim=True).repeat_interleave(3, 0).mT) * scale
    assert shift.abs().max() > 3.0  # the case means something
    assert (lse - exact_lse).abs().max() < 0.03
    assert (out.float() - exact_out).abs().max() < 0.05
    # No worse than twice the bf16 kernel's own distance from exact attention, plus rounding.
    assert (out.float() - exact_out).abs().mean() < 2 * (
        bf16_out.float() - exact_out
    ).abs().mean() + 2e-3


def test_smoothing_beats_per_key_quantization_alone():
    # A channel offset 8x the spread: without subtracting the mean, each key's scale is set by
    # the offset and the other channels lose their resolution.
    query, key, value = make_qkv(2, 2, 128, 128, 64, seed=4, bias=8.0)
    out, _, scale = run_int8(query, key, value)
    exact, _ = torch_ref.attention_with_lse(query.float(), key.float(), value.float(), scale)
    unsmoothed, _ = int8_reference(query, key, value, scale, smooth=False)
    kernel_error = (out.float() - exact).abs().mean().item()
    assert kernel_error < 0.5 * (unsmoothed - exact).abs().mean().item()


def test_zero_rows_and_a_non_finite_key():
    query, key, value = make_qkv(4, 2, 100, 100, 64, seed=6)
    query[:, 10] = 0.0  # a zero query row: codes and scale 0, uniform attention
    zero_keys = key.clone()
    zero_keys[1] = 0.0  # every key of KV head 1 zero: its key scales are 0
    check_reference(query, zero_keys, value)
    out, _, _ = run_int8(query, zero_keys, value)
    running_mean = value[1].float().cumsum(0) / torch.arange(1, 101)[:, None]
    for head in (2, 3):  # the query heads of KV head 1 attend uniformly
        torch.testing.assert_close(out[head].float(), running_mean, **OUT_TOL)
    check_reference(query, key, value)
    bad = key.clone()
    bad[0, 50, 7] = float("nan")
    out, lse, _ = run_int8(query, bad, value)
    clean_out, clean_lse, _ = run_int8(query, key, value)
    # Rows of KV head 0's queries (heads 0, 1) from key 50 on are NaN; earlier rows, and every
    # row of head 1's queries, stay finite. The NaN channel is not smoothed there, so the earlier
    # rows' codes differ from the clean run's (a flipped code moves a logit by ~3e-3).
    assert torch.isnan(out[:2, 50:]).all() and torch.isnan(lse[:2, 50:]).all()
    assert torch.isfinite(out[:2, :50]).all() and torch.isfinite(out[2:]).all()
    torch.testing.assert_close(out[2:], clean_out[2:], rtol=0, atol=0)
    torch.testing.assert_close(out[:2, :50].float(), clean_out[:2, :50].float(), **OUT_TOL)
    torch.testing.assert_close(lse[:2, :50], clean_lse[:2, :50], atol=1e-2, rtol=0)


def test_head_dim_over_256_and_fp32_run_the_exact_kernels():
    query, key, value = make_qkv(2, 1, 40, 40, 288, seed=7)
    plain = prefill_ops.prefill_attention(query, key, value, 0.06, isa=ISA)
    flagged = prefill_ops.prefill_attention(query, key, value, 0.06, isa=ISA, qk_int8=True)
    assert all(torch.equal(a, b) for a, b in zip(plain, flagged))
    f32 = [t.float() for t in make_qkv(2, 1, 40, 40, 64, seed=8)]
    plain = prefill_ops.prefill_attention(*f32, 0.125)
    flagged = prefill_ops.prefill_attention(*f32, 0.125, qk_int8=True)
    assert all(torch.equal(a, b) for a, b in zip(plain, flagged))
    assert not prefill_ops.prefill_qk_int8_runs(torch.float32)
    assert not prefill_ops.prefill_qk_int8_runs(torch.bfloat16, "avx512")
    assert not prefill_ops.prefill_qk_int8_runs(torch.bfloat16, ISA, 288)
    assert prefill_ops.prefill_qk_int8_runs(torch.bfloat16, ISA, 256)
    assert prefill_ops.prefill_qk_int8_runs(torch.bfloat16, ISA)


def test_the_op_refuses_int8_on_another_variant():
    ext = build.load_extension()
    query, key, value = make_qkv(2, 1, 8, 8, 64)
    with pytest.raises(RuntimeError, match="int8 Q·K\\^T runs on the avx512_bf16 prefill kernel"):
        ext.prefill_attention(query, key, value, 0.125, 0, "generic", True)
    big = make_qkv(1, 1, 4, 4, 288)
    with pytest.raises(RuntimeError, match="int8 Q·K\\^T takes head_dim <= 256, got 288"):
        ext.prefill_attention(*big, 0.06, 0, ISA, True)


def test_backend_and_config_carry_the_flag(monkeypatch):
    monkeypatch.setenv("SPARSEKV_KERNEL_ISA", ISA)
    query, key, value = make_qkv(9, 3, 60, 90, 64, seed=9, bias=1.0)
    backend = create_backend("cpu", "cpu", "int8")
    assert isinstance(backend, CpuNativeBackend) and backend.prefill_qk_int8
    assert backend.prefill_qk_int8_runs(torch.bfloat16, 64)
    assert not backend.prefill_qk_int8_runs(torch.bfloat16, 512)
    out, lse = backend.prefill_attention(query, key, value, 0.125)
    expected = prefill_ops.prefill_attention(query, key, value, 0.125, isa=ISA, qk_int8=True)
    assert torch.equal(out, expected[0]) and torch.equal(lse, expected[1])
    plain = create_backend("cpu", "cpu")
    assert not plain.prefill_qk_int8
    plain_out, plain_lse = plain.prefill_attention(query, key, value, 0.125)
    bf16 = prefill_ops.prefill_attention(query, key, value, 0.125, isa=ISA)
    assert torch.equal(plain_out, bf16[0]) and torch.equal(plain_lse, bf16[1])
    assert not torch.equal(lse, plain_lse)  # the flag did change the logits
    assert not create_backend("torch", "cpu", "int8").prefill_qk_int8_runs(torch.bfloat16, 64)
    with pytest.raises(ValueError, match="prefill_qk_dtype must be one of auto, int8, got 'fp8'"):
        create_backend("cpu", "cpu", "fp8")
    with pytest.raises(ValueError, match="prefill_qk_dtype must be one of auto, int8, got 'fp8'"):
        ModelConfig(prefill_qk_dtype="fp8").validate()
