"""What the decoding loops do with an asynchronous device: wait for it where a timing must, and copy host values to it
without waiting where nothing must."""

from __future__ import annotations

import torch


def device_sync(device: torch.device) -> None:
    """Wait for queued kernels so wall-clock timings are honest on asynchronous devices."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    elif device.type == "mps":
        torch.mps.synchronize()


def upload(values, device: torch.device, dtype: torch.dtype = torch.long) -> torch.Tensor:
    """Host `values` (a list or a CPU tensor) on `device` without waiting for the kernels queued there: a copy from
    pageable memory to a GPU waits for them all; one staged in pinned memory is queued behind them (the caching
    host allocator keeps the staging block until the copy has run)."""
    tensor = torch.as_tensor(values, dtype=None if torch.is_tensor(values) else dtype)
    if device.type != "cuda":
        return tensor.to(device)
    return tensor.pin_memory().to(device, non_blocking=True)
