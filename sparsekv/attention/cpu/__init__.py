"""Native CPU attention kernels (C++ in ``csrc/``, built by ``build.py``, wrapped by ``ops.py``).

The kernels read K/V pages in place (no gathered copy): paged decode attention and the
window-score pass of compression. The engine reaches them through
``attention.backends.CpuNativeBackend``, which falls back to the PyTorch reference when the
extension cannot be built or a kernel does not take the tensors.
"""
