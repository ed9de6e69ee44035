"""Native causal prefill attention (``prefill_ops.prefill_attention``) against
``torch_ref.attention_with_lse`` computed in fp32 from the same bf16 inputs, and the dispatch of
``CpuNativeBackend.prefill_attention`` (the kernel for bf16 and fp32, the PyTorch paths
otherwise). fp32 inputs: ``test_kernels_prefill_fp32.py``.

Variants: the full case set runs on this CPU's default variant (``avx512_amx`` on AMX CPUs,
``avx512_bf16`` on AVX512-BF16 ones such as AMD Zen 4, ...); every other variant the CPU runs
gets a few shapes through the same entry point (``isa=``) and through ``SPARSEKV_KERNEL_ISA``.
Variants the CPU cannot run are deselected and named in the run's summary line
(``tests/kernel_variants.py``); a failed build fails these tests.

Cases: GQA groups 1, 3 and 4; head_dim 64, 128 and 256 (96 too: any multiple of 32); whole
prompts (queries = keys) and chunks of a chunked prefill (the last queries of more keys);
lengths around the 16-row tiles and 64-key blocks, page-unaligned ones, and no query at all.

Tolerances (bf16): out rtol 1.6e-2 + atol 1e-2 (the bf16 kernels round the probabilities to
bf16 for the value product, as SDPA does); lse 1e-2 absolute, and 2e-4 in the precision tests
(it is computed in fp32 from fp32 logits: errors measured <= 8e-5).
"""

from __future__ import annotations

import pytest
import torch

from sparsekv.attention import torch_ref
from sparsekv.attention.backends.cpu_native import CpuNativeBackend
from sparsekv.attention.cpu import build, ops, prefill_ops
from tests import kernel_variants

backend = CpuNativeBackend()
OUT_TOL = {"atol": 1e-2, "rtol": 1.6e-2}
LSE_ATOL = 1e-2
LENGTHS = [1, 15, 16, 17, 100, 333]
GROUPS = pytest.mark.parametrize(
    "num_heads,num_kv_heads", [(2, 2), (6, 2), (8, 2)], ids=["g1", "g3", "g4"]
)
NATIVE = kernel_variants.native("prefill")
native_variant = pytest.mark.kernel_variant("prefill", NATIVE)
LOWER = [
    pytest.param(isa, marks=pytest.mark.kernel_variant("prefill", isa))
    for isa in kernel_variants.lower("prefill")
]


@pytest.fixture(scope="module")
def kernel() -> str:
    """The default prefill variant; fails (not skips) when the extension did not build."""
    assert not build.native_disabled(), "deselected when SPARSEKV_DISABLE_NATIVE is set"
    ext = build.load_extension()
    assert ext is not None, "the native extension failed to build"
    assert prefill_ops.prefill_isa() == NATIVE
    return NATIVE


def make_qkv(num_heads, num_kv_heads, num_queries, num_keys, head_dim, seed=0, std=1.0):
    gen = torch.Generator().manual_seed(seed)

    def rand(*shape):
        return (torch.randn(*shape, generator=gen) * std).to(torch.bfloat16)

    return (
        rand(num_heads, num_queries, head_dim),
        rand(num_kv_heads, num_keys, head_dim),
        rand(num_kv_heads, num_keys, head_dim),
    )


def check(query, key, value, out, lse, scale, sliding_window=None):
    ref_out, ref_lse = torch_ref.attention_with_lse(
        query.float(), key.float(), value.float(), scale, sliding_window
    )
    assert out.dtype == torch.bfloat16 and lse.dtype == torch.float32
    assert out.shape == query.shape and lse.shape == query.shape[:2]
    torch.testing.assert_close(out.float(), ref_out, **OUT_TOL)
    torch.testing.assert_close(lse, ref_lse, atol=LSE_ATOL, rtol=0)


def run_kernel(query, key, value, sliding_window=None, isa=None):
    scale = query.shape[-1] ** -0.5
    assert prefill_ops.supports_prefill(query, key, value)
    out, lse = prefill_ops.prefill_attention(query, key, value, scale, sliding_window, isa=isa)
    check(query, key, value, out, lse, scale, sliding_window)


@native_variant
@GROUPS
@pytest.mark.parametrize("head_dim", [64, 128, 256])
@pytest.mark.parametrize("length", LENGTHS)
def test_prefill_whole_prompt(kernel, num_heads, num_kv_heads, head_dim, length):
    run_kernel(*make_qkv(num_heads, num_kv_heads, length, length, head_dim, seed=length))


@native_variant
@GROUPS
@pytest.mark.parametrize("head_dim", [64, 128, 256])
@pytest.mark.parametrize("length", LENGTHS)
def test_prefill_chunk_after_earlier_keys(kernel, num_heads, num_kv_heads, head_dim, length):
    # The chunk's queries are the last `length` of `length + 77` keys (bottom-right causal).
    qkv = make_qkv(num_heads, num_kv_heads, length, length + 77, head_dim, seed=length)
    run_kernel(*qkv)


@pytest.mark.parametrize(
    "num_queries,num_keys", [(1, 333), (64, 64), (65, 130), (512, 1000), (1000, 1000)]
)
@native_variant
def test_prefill_block_boundaries_and_long(kernel, num_queries, num_keys):
    run_kernel(*make_qkv(9, 3, num_queries, num_keys, 64, seed=num_keys))


@native_variant
def test_prefill_head_dim_96_and_strided_query(kernel):
    query, key, value = make_qkv(4, 1, 50, 90, 96)
    run_kernel(query, key, value)
    # A transposed view, as the model's [tokens, heads, dim] projections give.
    strided = query.transpose(0, 1).contiguous().transpose(0, 1)
    assert not strided.is_contiguous()
    run_kernel(strided, key, value)
    # Every other element: copied by the binding first.
    spread = torch.stack((query, query), dim=-1).flatten(-2)[..., ::2]
    assert spread.stride(-1) == 2
    run_kernel(spread, key[:, 10:], value[:, 10:])


@native_variant
def test_prefill_large_logits_and_growing_max(kernel):
    # Large logits and key norms growing along the sequence: the running max moves at almost
    # every block, so the output is rescaled often; the lse must stay exact.
    query, key, value = make_qkv(6, 2, 300, 300, 64, std=3.0)
    growth = torch.linspace(0.2, 2.0, 300)[None, :, None]
    run_kernel(query, (key.float() * growth).bfloat16(), value)


# The kernel's exp2 (a degree-3 polynomial, 7.5e-5 relative error) and fp32 sums bound its lse
# error well below LSE_ATOL; this checks that bound, with margin for the fp32 reference.
LSE_TIGHT = 2e-4


@pytest.mark.parametrize(
    "num_queries,num_keys,std", [(500, 700, 1.0), (96, 96, 1.0), (300, 300, 3.0)]
)
@native_variant
def test_prefill_lse_precision(kernel, num_queries, num_keys, std):
    query, key, value = make_qkv(9, 3, num_queries, num_keys, 64, seed=num_keys, std=std)
    _, lse = prefill_ops.prefill_attention(query, key, value, 0.125)
    _, ref_lse = torch_ref.attention_with_lse(
        query.float(), key.float(), value.float(), 0.125, None
    )
    torch.testing.assert_close(lse, ref_lse, atol=LSE_TIGHT, rtol=0)


@native_variant
@pytest.mark.parametrize("rise", [0.0, 3.0, 20.0, 300.0])
@pytest.mark.parametrize("spike", [None, 40.0])
def test_prefill_lazy_max(kernel, rise, spike):
    # Logits rising linearly along the keys by `rise` (natural log units) over the sequence,
    # optionally with one late key `spike` above the rest: the kernel keeps a row's max while
    # a block's probabilities against it stay small (slow rises: probabilities above 1), and
    # moves it when they would not (fast rises, the spike); out and lse stay exact either way.
    num_queries, num_keys = 200, 300
    query, key, value = make_qkv(6, 2, num_queries, num_keys, 64, seed=7, std=0.3)
    query[..., 0] = 1.0
    key[..., 0] = torch.linspace(0.0, rise, num_keys).bfloat16()
    if spike is not None:
        key[:, 250, 0] = spike + rise
    out, lse = prefill_ops.prefill_attention(query, key, value, 1.0)
    check(query, key, value, out, lse, 1.0)
    _, ref_lse = torch_ref.attention_with_lse(query.float(), key.float(), value.float(), 1.0, None)
    torch.testing.assert_close(lse, ref_lse, atol=LSE_TIGHT * max(1.0, rise / 100), rtol=0)


def exact_attention(query, key, value, scale):
    """Causal attention of a whole prompt (queries = keys) in float64: out, lse, and each row's
    largest ``scale * sum |q_i k_i|`` over the keys it sees (what fp32 sums of the logits'
    products round against)."""
    group = query.shape[0] // key.shape[0]
    keys = key.double().repeat_interleave(group, 0).transpose(1, 2)
    n = query.shape[1]
    future = torch.ones(n, n, dtype=torch.bool).triu(1)
    logits = (query.double() @ keys * scale).masked_fill(future, float("-inf"))
    magnitude = (query.double().abs() @ keys.abs() * scale).masked_fill(future, 0).amax(-1)
    values = value.double().repeat_interleave(group, 0)
    return logits.softmax(-1) @ values, logits.logsumexp(-1), magnitude


def huge_logit_cases():
    cases = [(NATIVE, scale, spike) for scale in (1e5, 1e9) for spike in (False, True)]
    cases += [(isa, 1e9, True) for isa in kernel_variants.lower("prefill")]
    return [
        pytest.param(isa, scale, spike, marks=pytest.mark.kernel_variant("prefill", isa))
        for isa, scale, spike in cases
    ]


@pytest.mark.parametrize("isa,magnitude,spike", huge_logit_cases())
def test_prefill_huge_logits_stay_exact(isa, magnitude, spike):
    # Logits around `magnitude` (queries scaled up; with `spike`, one key 1e9 times the others
    # instead): the row max and the logits it is subtracted from must round alike. A fused
    # multiply-add against the rounded max moved the winning key's exponent by up to half a unit
    # in the max's last place: 2^-9 at 1e5, and past 1e9 inf / 0 probabilities and NaN rows.
    query, key, value = make_qkv(9, 3, 200, 200, 64, seed=3)
    if spike:
        key[:, 150] = (key[:, 150].float() * magnitude).bfloat16()
    else:
        query = (query.float() * magnitude).bfloat16()
    out, lse = prefill_ops.prefill_attention(query, key, value, 0.125, isa=isa)
    ref_out, ref_lse, magnitude = exact_attention(query, key, value, 0.125)
    assert not out.isnan().any() and not lse.isnan().any()
    torch.testing.assert_close(out.double(), ref_out, **OUT_TOL)
    # fp32 sums of 64 products: within a few units of 6e-8 of the products' magnitude (a
    # cancelling sum of 1e9-sized products loses its low digits in any fp32 order).
    assert ((lse.double() - ref_lse).abs() <= 1e-6 * magnitude + LSE_TIGHT).all()


@pytest.mark.parametrize("window", [1, 5, 16, 63, 64, 65, 100, 512])
@pytest.mark.parametrize(
    "num_queries,num_keys", [(1, 1), (17, 17), (200, 200), (333, 333), (100, 700), (513, 1000)]
)
@native_variant
def test_prefill_sliding_window(kernel, window, num_queries, num_keys):
    # Gemma 3's local layers (4 query heads over 1 KV head, head_dim 256): row i sees only its
    # `window` most recent keys; windows below, on and past the 64-key blocks and the 16-row
    # tiles, whole prompts and chunks whose first rows' windows start inside earlier keys.
    qkv = make_qkv(4, 1, num_queries, num_keys, 256, seed=window + num_keys)
    run_kernel(*qkv, sliding_window=window)


@native_variant
@GROUPS
def test_prefill_sliding_window_groups(kernel, num_heads, num_kv_heads):
    run_kernel(*make_qkv(num_heads, num_kv_heads, 150, 230, 64, std=3.0), sliding_window=40)


@native_variant
def test_prefill_window_of_every_key_is_no_window(kernel):
    query, key, value = make_qkv(6, 2, 90, 120, 64)
    plain = prefill_ops.prefill_attention(query, key, value, 0.125)
    for window in (120, 121, 10_000):
        windowed = prefill_ops.prefill_attention(query, key, value, 0.125, window)
        assert torch.equal(windowed[0], plain[0]) and torch.equal(windowed[1], plain[1])


@native_variant
def test_prefill_rejects_a_non_positive_window(kernel):
    with pytest.raises(ValueError, match="sliding_window"):
        prefill_ops.prefill_attention(*make_qkv(6, 2, 10, 10, 64), 0.125, 0)


@native_variant
def test_prefill_no_queries(kernel):
    query, key, value = make_qkv(6, 2, 0, 5, 64)
    out, lse = prefill_ops.prefill_attention(query, key, value, 0.125)
    assert out.shape == (6, 0, 64) and lse.shape == (6, 0)
    out, lse = backend.prefill_attention(query, key, value, 0.125)
    assert out.shape == (6, 0, 64) and lse.shape == (6, 0)


@native_variant
def test_prefill_rejects_bad_arguments(kernel):
    query, key, value = make_qkv(6, 2, 20, 10, 64)
    assert not prefill_ops.supports_prefill(query, key, value)  # more queries than keys
    with pytest.raises(RuntimeError, match="more queries"):
        prefill_ops.prefill_attention(query, key, value, 0.125)
    query, key, value = make_qkv(6, 4, 10, 10, 64)
    assert not prefill_ops.supports_prefill(query, key, value)  # 6 heads over 4 KV heads
    with pytest.raises(RuntimeError, match="multiple of num_kv_heads"):
        prefill_ops.prefill_attention(query, key, value, 0.125)
    query, key, value = make_qkv(6, 2, 10, 10, 48)
    assert not prefill_ops.supports_prefill(query, key, value)  # head_dim not a multiple of 32
    with pytest.raises(RuntimeError, match="multiple of 32"):
        prefill_ops.prefill_attention(query, key, value, 0.125)
    query, key, value = make_qkv(6, 2, 10, 10, 64)
    assert not prefill_ops.supports_prefill(query.float(), key, value)  # mixed dtypes
    with pytest.raises(RuntimeError, match="all bfloat16 or all float32"):
        prefill_ops.prefill_attention(query.float(), key, value, 0.125)
    for scale in (0.0, -0.125, float("nan"), float("inf")):  # a row's max must be its top logit
        with pytest.raises(ValueError, match="scale must be a positive finite number"):
            prefill_ops.prefill_attention(query, key, value, scale)


class _Spy:
    """Counts calls of ``prefill_ops.prefill_attention`` made through the backend."""

    def __init__(self, monkeypatch):
        self.calls = 0
        real = prefill_ops.prefill_attention

        def spy(*args, **kwargs):
            self.calls += 1
            return real(*args, **kwargs)

        monkeypatch.setattr(prefill_ops, "prefill_attention", spy)


@native_variant
def test_backend_picks_the_kernel_for_bf16(kernel, monkeypatch):
    spy = _Spy(monkeypatch)
    query, key, value = make_qkv(9, 3, 40, 100, 64)
    out, lse = backend.prefill_attention(query, key, value, 0.125)
    assert spy.calls == 1
    check(query, key, value, out, lse, 0.125)
    out, lse = backend.prefill_attention(query, key, value, 0.125, sliding_window=24)
    assert spy.calls == 2
    check(query, key, value, out, lse, 0.125, sliding_window=24)


def test_backend_falls_back_for_softcap_mixed_dtypes_and_head_dim(monkeypatch):
    # Runs on any CPU: none of these may reach the kernel.
    spy = _Spy(monkeypatch)
    query, key, value = make_qkv(6, 2, 30, 30, 64)
    out, lse = backend.prefill_attention(query.float(), key, value, 0.125)
    check(query, key, value, out.bfloat16(), lse, 0.125)
    backend.prefill_attention(query, key, value, 0.125, logit_softcap=30.0)
    backend.prefill_attention(query.float(), key.float(), value.float(), 0.125, None, 30.0)
    query, key, value = make_qkv(6, 2, 30, 30, 48)  # head_dim the kernel does not take
    out, lse = backend.prefill_attention(query, key, value, 48**-0.5)
    check(query, key, value, out, lse, 48**-0.5)
    assert spy.calls == 0


def test_backend_falls_back_when_native_is_disabled(monkeypatch):
    spy = _Spy(monkeypatch)
    monkeypatch.setenv("SPARSEKV_DISABLE_NATIVE", "1")
    assert not prefill_ops.supports_prefill(*make_qkv(6, 2, 30, 30, 64))
    query, key, value = make_qkv(6, 2, 30, 30, 64)
    out, lse = backend.prefill_attention(query, key, value, 0.125)
    check(query, key, value, out, lse, 0.125)
    assert spy.calls == 0


@native_variant
def test_backend_honours_a_forced_isa(kernel, monkeypatch):
    # A forced variant without a prefill kernel leaves prefill to PyTorch.
    spy = _Spy(monkeypatch)
    monkeypatch.setenv(ops.ISA_ENV, "avx2_w16")
    assert prefill_ops.prefill_isa() is None
    backend.prefill_attention(*make_qkv(6, 2, 30, 30, 64), 0.125)
    monkeypatch.setenv(ops.ISA_ENV, kernel)
    backend.prefill_attention(*make_qkv(6, 2, 30, 30, 64), 0.125)
    assert spy.calls == 1


LOWER_CASES = [(9, 3, 100, 100, 64, None), (6, 2, 17, 94, 128, None), (4, 1, 333, 333, 256, 65)]


@pytest.mark.parametrize("isa", LOWER)
@pytest.mark.parametrize(
    "num_heads,num_kv_heads,num_queries,num_keys,head_dim,window",
    LOWER_CASES,
    ids=["g3-prompt", "g3-chunk-d128", "g4-window-d256"],
)
def test_prefill_lower_variant(
    isa, num_heads, num_kv_heads, num_queries, num_keys, head_dim, window
):
    qkv = make_qkv(num_heads, num_kv_heads, num_queries, num_keys, head_dim, seed=num_keys)
    run_kernel(*qkv, sliding_window=window, isa=isa)


@pytest.mark.parametrize("isa", LOWER)
def test_prefill_lower_variant_forced_through_the_environment(isa, monkeypatch):
    spy = _Spy(monkeypatch)
    monkeypatch.setenv(ops.ISA_ENV, isa)
    assert prefill_ops.prefill_isa() == isa
    query, key, value = make_qkv(9, 3, 70, 150, 64, std=3.0)
    out, lse = backend.prefill_attention(query, key, value, 0.125, sliding_window=90)
    assert spy.calls == 1
    check(query, key, value, out, lse, 0.125, sliding_window=90)


def test_forcing_a_variant_this_cpu_lacks_warns_and_uses_the_default(monkeypatch):
    missing = [isa for isa in prefill_ops.PREFILL_VARIANTS if isa not in prefill_ops.prefill_isas()]
    if not missing:  # an AMX CPU runs every variant
        assert prefill_ops.prefill_isas() == prefill_ops.PREFILL_VARIANTS
        return
    monkeypatch.setenv(ops.ISA_ENV, missing[0])
    prefill_ops._warn_unusable_prefill_isa.cache_clear()
    with pytest.warns(RuntimeWarning, match=missing[0]):
        assert prefill_ops.prefill_isa() == (prefill_ops.prefill_isas() or (None,))[0]


def test_a_forced_variant_is_read_in_any_case_and_a_typo_keeps_the_default(monkeypatch):
    # Every family reads SPARSEKV_KERNEL_ISA the same way: "AVX2" is avx2; a name that is no
    # variant at all warns and keeps prefill on the fastest kernel (not PyTorch).
    from sparsekv.attention.cpu import window_fused
    from sparsekv.models.quant import ops as quant_ops

    monkeypatch.setenv(ops.ISA_ENV, " AVX2 ")
    assert prefill_ops.prefill_isa() == "avx2"
    assert window_fused.window_fused_isa() == "avx2"
    assert ops.pick_isa(64) == "avx2"
    assert quant_ops.kernel_isa() == "avx2"
    monkeypatch.setenv(ops.ISA_ENV, "avx-2")
    prefill_ops._warn_unusable_prefill_isa.cache_clear()
    with pytest.warns(RuntimeWarning, match="avx-2"):
        assert prefill_ops.prefill_isa() == prefill_ops.prefill_isas()[0]
