"""Attention backend dispatcher (temporary: torch reference only)."""

from __future__ import annotations

from sparsekv.attention.torch_ref import attention_with_lse, paged_decode_attention

decode_attention = paged_decode_attention
prefill_attention = attention_with_lse
