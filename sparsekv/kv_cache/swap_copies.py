"""Copies of swapped pages between the device and host memory (preemption by swapping).

On CUDA the copies run on a side stream through pinned host buffers, so they overlap the
compute stream's queued work: a swap-out gathers the pages on the compute stream, copies them
device to host on the side stream and waits on the host for that copy only; a swap-in copies
host to device on the side stream and makes the compute stream wait for it (no host sync).
Elsewhere the same functions are plain copies.
"""

from __future__ import annotations

import torch

_side_streams: dict[torch.device, torch.cuda.Stream] = {}


def _side_stream(device: torch.device) -> torch.cuda.Stream:
    if device not in _side_streams:
        _side_streams[device] = torch.cuda.Stream(device)
    return _side_streams[device]


def to_host(gathered: list[torch.Tensor]) -> tuple[torch.Tensor, ...]:
    """Host copies of freshly gathered device tensors (the tensors themselves on CPU).

    Args:
        gathered: tensors no one else writes (e.g. ``index_select`` results), all on one
            device.

    Returns:
        Bit-exact host tensors (pinned on CUDA), complete when this returns.
    """
    if not gathered or gathered[0].device.type != "cuda":
        return tuple(gathered)
    device = gathered[0].device
    stream = _side_stream(device)
    stream.wait_stream(torch.cuda.current_stream(device))
    host = []
    with torch.cuda.stream(stream):
        for tensor in gathered:
            staged = torch.empty(tensor.shape, dtype=tensor.dtype, pin_memory=True)
            staged.copy_(tensor, non_blocking=True)
            tensor.record_stream(stream)
            host.append(staged)
    stream.synchronize()
    return tuple(host)


def to_device(saved: tuple[torch.Tensor, ...], device: torch.device) -> list[torch.Tensor]:
    """Device copies of ``to_host`` tensors, ready for the current stream's next kernels.

    Args:
        saved: host tensors (pinned on CUDA).
        device: the target device.
    """
    if device.type != "cuda":
        return [tensor.to(device) for tensor in saved]
    stream = _side_stream(device)
    current = torch.cuda.current_stream(device)
    with torch.cuda.stream(stream):
        copies = [tensor.to(device, non_blocking=True) for tensor in saved]
    current.wait_stream(stream)
    for copy in copies:
        copy.record_stream(current)
    return copies
