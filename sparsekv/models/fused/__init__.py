"""Fused elementwise ops of the decoder layers (RMSNorm, residual add + RMSNorm, SwiGLU / GeGLU,
in-place RoPE): small native CPU kernels with an eager-PyTorch fallback.

``ops`` is the interface (native where it applies, else eager), ``reference`` the eager code,
``build`` compiles and loads ``csrc/``, ``bench`` times both.
"""
