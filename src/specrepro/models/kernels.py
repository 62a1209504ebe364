"""CPU matmul kernel choice for every `nn.Linear` (`hardware.linear_kernel`).

On x86 CPUs torch's fp32 `F.linear` calls MKL, whose small-batch GEMM is slow on AMD processors: a
2..8-token forward of SmolLM2-135M costs 1.6-1.8x a 1-token forward at one thread, although both read the
same weights once. A verification pass is such a forward, so that cost divides the speedup of every
draft-then-verify method. oneDNN with its weights reordered once ("prepacked", what inductor's CPU backend
and IPEX use) streams the weights at memory speed for any small batch: a 1-token forward is ~1.5x faster
and a 5-token one costs ~1.15x a 1-token one (`experiments/bench_kernels.py` measures both). Its kernels for
one or two rows stream the weights more slowly than those for 4-6, so inputs of fewer than
`hardware.linear_min_rows` rows (default 5) are zero-padded to that many: fp32 `ar` 1.12-1.15x faster here,
token-identical (`experiments/bench_kernels.py --min-rows 5`).

`set_linear_kernel("onednn")` routes `nn.Linear.forward` through `torch.ops.mkldnn._linear_pointwise`
with a packed copy of each weight, kept per module and repacked when the weight changes in place
(`_version`, bumped by optimizer steps and `load_state_dict`). It applies only where it computes the same
function: CPU tensors of float32 or bfloat16, input and weight of one dtype, no autograd through the
layer, no autocast. Everything else (CUDA, training steps, fp16) takes torch's own path. Both arms of a
comparison run in the same process with the same setting, so `ar` gets the faster kernel too.
"""

from __future__ import annotations

import logging
import weakref

import torch
import torch.nn.functional as F

from specrepro.errors import SpecReproError

log = logging.getLogger(__name__)

KERNELS = ("onednn", "torch")
_PACKABLE = (torch.float32, torch.bfloat16)
_torch_linear_forward = torch.nn.Linear.forward
_packed: "weakref.WeakKeyDictionary[torch.nn.Linear, tuple[int, torch.Tensor]]" = weakref.WeakKeyDictionary()
_min_rows = 1  # inputs of fewer rows are zero-padded to this many (set_linear_min_rows)
_row_invariant = False  # one-row inputs go through the many-row kernel (set_row_invariant_linear)


def _onednn_applies(layer: torch.nn.Linear, x: torch.Tensor) -> bool:
    w = layer.weight
    return (x.device.type == "cpu" and w.device.type == "cpu" and x.dtype == w.dtype and w.dtype in _PACKABLE
            and not w.is_inference()  # no version counter, so a packed copy could not tell it went stale
            and not (torch.is_grad_enabled() and (w.requires_grad or x.requires_grad))
            and not torch.is_autocast_enabled("cpu"))


def _onednn_linear_forward(self: torch.nn.Linear, x: torch.Tensor) -> torch.Tensor:
    if not _onednn_applies(self, x):
        return _torch_linear_forward(self, x)
    entry = _packed.get(self)
    if entry is None or entry[0] != self.weight._version:
        entry = (self.weight._version, torch.ops.mkldnn._reorder_linear_weight(self.weight.detach()))
        _packed[self] = entry
    rows, min_rows = x.numel() // x.shape[-1], max(_min_rows, 2 if _row_invariant else 1)
    if rows < min_rows:  # padded: oneDNN's kernels for few rows stream the weights slower (module docstring)
        flat = x.reshape(rows, x.shape[-1])
        flat = torch.cat([flat, flat.new_zeros(min_rows - rows, flat.shape[1])])
        out = torch.ops.mkldnn._linear_pointwise(flat, entry[1], self.bias, "none", [], "")
        return out[:rows].reshape(*x.shape[:-1], -1)
    return torch.ops.mkldnn._linear_pointwise(x, entry[1], self.bias, "none", [], "")


def onednn_available() -> bool:
    """Whether this torch build runs the prepacked oneDNN linear (checked on a tiny layer)."""
    if not torch.backends.mkldnn.is_available():
        return False
    try:
        w, x = torch.randn(8, 4), torch.randn(2, 4)
        out = torch.ops.mkldnn._linear_pointwise(x, torch.ops.mkldnn._reorder_linear_weight(w), None, "none", [], "")
        return torch.allclose(out, F.linear(x, w), atol=1e-5)
    except (RuntimeError, AttributeError):
        return False


def set_linear_kernel(kernel: str) -> str:
    """Make every `nn.Linear` in this process use `kernel`; returns the kernel in force (oneDNN falls back to
    torch, with a warning, on a build without it)."""
    if kernel not in KERNELS:
        raise SpecReproError(f"hardware.linear_kernel={kernel} is not one of {', '.join(KERNELS)}")
    if kernel == "onednn" and not onednn_available():
        log.warning("this torch build has no usable oneDNN linear; hardware.linear_kernel=onednn falls back to torch")
        kernel = "torch"
    torch.nn.Linear.forward = _onednn_linear_forward if kernel == "onednn" else _torch_linear_forward
    if kernel == "torch":
        _packed.clear()
    return kernel


def set_linear_min_rows(rows: int) -> None:
    """Zero-pad every oneDNN linear input of fewer than `rows` rows to `rows` rows (1: no padding)."""
    global _min_rows
    if rows < 1:
        raise SpecReproError(f"hardware.linear_min_rows must be >= 1, got {rows}")
    _min_rows = rows


def set_row_invariant_linear(enabled: bool) -> None:
    """Compute a one-row input as a row of a two-row product, so that it rounds exactly like a row of a
    verification pass (the oneDNN kernel only; see models/attention.py)."""
    global _row_invariant
    _row_invariant = enabled


def linear_kernel() -> str:
    """The kernel `nn.Linear` uses now."""
    return "onednn" if torch.nn.Linear.forward is _onednn_linear_forward else "torch"
