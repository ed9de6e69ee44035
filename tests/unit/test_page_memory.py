"""KV page pools: allocated zeroed, and on Linux CPUs advised for transparent huge pages before
their first touch (every storage format, every CPU backend)."""

from __future__ import annotations

import pathlib
import sys

import pytest
import torch

from sparsekv.attention.backends.cpu_native import CpuNativeBackend
from sparsekv.attention.backends.torch_backend import TorchBackend
from sparsekv.attention.cpu import memory
from sparsekv.attention.cpu.memory import huge_page_setting
from sparsekv.bench.kernels import variants
from sparsekv.kv_cache.storage import make_storage

THP_SETTING = pathlib.Path(memory.THP_SETTING)


def vm_flags(address: int) -> list[str]:
    """The VmFlags of the mapping of this process that holds ``address`` (/proc/self/smaps)."""
    inside = False
    for line in pathlib.Path("/proc/self/smaps").read_text().splitlines():
        head = line.split(maxsplit=1)[0]
        if "-" in head and not head.endswith(":"):
            start, end = (int(x, 16) for x in head.split("-"))
            inside = start <= address < end
        elif inside and head == "VmFlags:":
            return line.split()[1:]
    raise AssertionError(f"no mapping holds {address:#x}")


@pytest.mark.parametrize("backend", [CpuNativeBackend, TorchBackend])
@pytest.mark.parametrize("kv_cache_dtype", ["auto", "int8", "fp8", "int4"])
def test_every_pool_tensor_is_advised_before_it_is_zeroed(kv_cache_dtype, backend, monkeypatch):
    advised = []

    def advise(tensor: torch.Tensor) -> bool:  # dirty the memory: the zeroing must come after
        tensor.view(torch.uint8).fill_(1)
        advised.append(tensor.data_ptr())
        return True

    monkeypatch.setattr("sparsekv.attention.backends.base.advise_huge_pages", advise)
    storage = make_storage(kv_cache_dtype, 64, 0, 4, 16, 64, torch.bfloat16, backend=backend())
    assert [t.data_ptr() for t in storage.tensors] == advised
    for tensor in storage.tensors:
        assert tensor.device.type == "cpu" and tensor.is_contiguous()
        assert not tensor.view(torch.uint8).any()


@pytest.mark.parametrize("backend", [CpuNativeBackend, TorchBackend])
def test_a_pool_sized_tensor_gets_huge_pages(backend):
    if not sys.platform.startswith("linux") or not THP_SETTING.exists():
        pytest.skip("no transparent huge pages on this kernel")
    # 64 MiB: past glibc's mmap threshold even once the engine tunes it (32 MiB), so a fresh
    # mapping that only the advice can have flagged
    pool = backend().allocate_pages((2048, 2, 4, 16, 64), torch.bfloat16, "cpu")
    middle = pool.data_ptr() + pool.numel() * pool.element_size() // 2
    assert "hg" in vm_flags(middle)  # MADV_HUGEPAGE took
    assert not pool.any()


def test_accelerator_pools_are_plain_zeros(monkeypatch):
    calls = []
    monkeypatch.setattr(
        "sparsekv.attention.backends.base.advise_huge_pages", lambda t: calls.append(t)
    )
    pool = TorchBackend().allocate_pages((4, 2, 1, 16, 8), torch.float32, torch.device("meta"))
    assert pool.device.type == "meta" and tuple(pool.shape) == (4, 2, 1, 16, 8)
    assert calls == []
    TorchBackend().allocate_pages((4, 2, 1, 16, 8), torch.float32, torch.device("cpu"))
    assert len(calls) == 1


@pytest.mark.parametrize(
    ("text", "mode"),
    [
        ("always [madvise] never\n", "madvise"),
        ("[always] madvise never\n", "always"),
        ("always madvise [never]\n", "never"),
        ("garbage\n", None),
    ],
)
def test_huge_page_setting_reads_the_bracketed_mode(tmp_path, text, mode):
    path = tmp_path / "enabled"
    path.write_text(text)
    assert huge_page_setting(str(path)) == mode
    assert huge_page_setting(str(tmp_path / "missing")) is None


@pytest.mark.parametrize(
    ("mode", "line"),
    [
        ("madvise", "kv pages     2 MiB pages (transparent huge pages: madvise)"),
        ("always", "kv pages     2 MiB pages (transparent huge pages: always)"),
        (None, "kv pages     4 KiB pages (no transparent huge pages on this system)"),
    ],
)
def test_kernel_list_says_whether_pools_get_huge_pages(monkeypatch, mode, line):
    monkeypatch.setattr(variants, "huge_page_setting", lambda: mode)
    assert variants.variant_lines()[-1] == line


def test_kernel_list_tells_how_to_enable_huge_pages(monkeypatch):
    monkeypatch.setattr(variants, "huge_page_setting", lambda: "never")
    last = variants.variant_lines()[-1]
    assert last.startswith("kv pages     4 KiB pages (transparent huge pages: never;")
    assert "/sys/kernel/mm/transparent_hugepage/enabled" in last
    assert huge_page_setting() == (
        THP_SETTING.read_text().split("[")[1].split("]")[0] if THP_SETTING.exists() else None
    )
