"""CPU matmul kernel for the `nn.Linear` modules of a loaded model (`hardware.linear_kernel`).

On x86 CPUs torch's fp32 `F.linear` calls MKL, whose small-batch GEMM is slow on AMD processors: a
2..8-token forward of SmolLM2-135M costs 1.6-1.8x a 1-token forward at one thread, although both read the
same weights once. A verification pass is such a forward, so that cost divides the speedup of every
draft-then-verify method. oneDNN with its weights reordered once ("prepacked", what inductor's CPU backend
and IPEX use) streams the weights at memory speed for any small batch: a 1-token forward is ~1.5x faster
and a 5-token one costs ~1.15x a 1-token one (`experiments/bench_kernels.py` measures both). Its kernels for
one or two rows stream the weights more slowly than those for 4-6, so inputs of fewer than
`hardware.linear_min_rows` rows (default 5) are zero-padded to that many: fp32 `ar` 1.12-1.15x faster here,
token-identical (`experiments/bench_kernels.py --min-rows 5`).

`set_linear_kernel(model, "onednn")` replaces the `nn.Linear` modules of that model, and of no other, with
`PackedLinear`: the same parameters (so ties, `.weight` readers and `state_dict` are unchanged), run through
`torch.ops.mkldnn._linear_pointwise` with a packed copy of the weight. It applies only where it computes the
same function: CPU tensors of float32 or bfloat16, input and weight of one dtype, no autograd through the
layer, no autocast, and a dtype this CPU has the kernel for (bfloat16 needs AVX-512 or AVX-NE-CONVERT; an AVX2-only
CPU packs float32 alone). Everything else (CUDA, training steps, fp16) takes torch's own path. Both arms of a
comparison run on models loaded with the same setting, so `ar` gets the faster kernel too.
"""

from __future__ import annotations

import contextvars
import functools
import logging
from contextlib import contextmanager

import torch
import torch.nn.functional as F

from specrepro.errors import SpecReproError

log = logging.getLogger(__name__)

KERNELS = ("onednn", "torch")
_PACKABLE = (torch.float32, torch.bfloat16)


_TORCH_LINEARS = contextvars.ContextVar("torch_linears", default=False)


@contextmanager
def torch_linears():
    """Within it, every `PackedLinear` computes with torch's own `F.linear` on its parameters: `ar` timed on torch's
    kernels beside `ar` on oneDNN's, on one model (`timing.torch_ar`)."""
    token = _TORCH_LINEARS.set(True)
    try:
        yield
    finally:
        _TORCH_LINEARS.reset(token)


class PackedLinear(torch.nn.Linear):
    """An `nn.Linear` that computes on oneDNN with a packed copy of its weight where that is exact (module
    docstring); inputs of fewer than `min_rows` rows are zero-padded to that many.

    The packed copy is not state: it is made on first use, remade when the weight changes in place (`_version`,
    bumped by optimizer steps and `load_state_dict`) or is replaced, and dropped on `train()` / `eval()` (PEFT's
    merge writes through `.data`, which bumps no version), on device and dtype moves, and on copies."""

    def __init__(self, linear: torch.nn.Linear, min_rows: int = 1):
        torch.nn.Module.__init__(self)
        self.in_features, self.out_features, self.min_rows = linear.in_features, linear.out_features, min_rows
        self.weight = linear.weight
        self.register_parameter("bias", linear.bias)
        self.training, self._packed = linear.training, None

    def _onednn_applies(self, x: torch.Tensor) -> bool:
        w = self.weight
        return (
            x.device.type == "cpu"
            and w.device.type == "cpu"
            and x.dtype == w.dtype
            and w.dtype in onednn_dtypes()
            and not w.is_inference()  # no version counter, so a packed copy could not tell it went stale
            and not (torch.is_grad_enabled() and (w.requires_grad or x.requires_grad))
            and not torch.is_autocast_enabled("cpu")
            and not _TORCH_LINEARS.get()
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if not self._onednn_applies(x):
            return F.linear(x, self.weight, self.bias)
        key = (self.weight.data_ptr(), self.weight._version)
        if self._packed is None or self._packed[0] != key:
            self._packed = (key, torch.ops.mkldnn._reorder_linear_weight(self.weight.detach()))
        packed = self._packed[1]
        rows = x.numel() // x.shape[-1]
        if rows < self.min_rows:  # padded: oneDNN's kernels for few rows stream the weights slower (module docstring)
            flat = x.reshape(rows, x.shape[-1])
            flat = torch.cat([flat, flat.new_zeros(self.min_rows - rows, flat.shape[1])])
            out = torch.ops.mkldnn._linear_pointwise(flat, packed, self.bias, "none", [], "")
            return out[:rows].reshape(*x.shape[:-1], -1)
        return torch.ops.mkldnn._linear_pointwise(x, packed, self.bias, "none", [], "")

    def train(self, mode: bool = True) -> "PackedLinear":
        self._packed = None
        return super().train(mode)

    def _apply(self, fn, recurse: bool = True):
        self._packed = None
        return super()._apply(fn, recurse)

    def __getstate__(self) -> dict:
        return {**self.__dict__, "_packed": None}  # a oneDNN tensor can be neither copied nor pickled

    def to_linear(self) -> torch.nn.Linear:
        """A plain `nn.Linear` holding the same parameters."""
        linear = torch.nn.Linear(self.in_features, self.out_features, bias=self.bias is not None, device="meta")
        linear.weight, linear.bias = self.weight, self.bias
        return linear.train(self.training)

    def extra_repr(self) -> str:
        return f"{super().extra_repr()}, min_rows={self.min_rows}"


@functools.cache
def onednn_dtypes() -> frozenset[torch.dtype]:
    """The dtypes in which this torch build and CPU run the prepacked oneDNN linear, each checked on a tiny layer
    (oneDNN's bfloat16 path refuses a CPU without AVX-512 or AVX-NE-CONVERT)."""
    if not torch.backends.mkldnn.is_available():
        return frozenset()
    found = set()
    for dtype in _PACKABLE:
        try:
            w, x = torch.randn(8, 4).to(dtype), torch.randn(2, 4).to(dtype)
            out = torch.ops.mkldnn._linear_pointwise(
                x, torch.ops.mkldnn._reorder_linear_weight(w), None, "none", [], ""
            )
        except (RuntimeError, AttributeError):
            continue
        if torch.allclose(out.float(), F.linear(x, w).float(), atol=1e-5 if dtype == torch.float32 else 2e-2):
            found.add(dtype)
    return frozenset(found)


def onednn_available(dtype: torch.dtype = torch.float32) -> bool:
    """Whether this torch build and CPU run the prepacked oneDNN linear in `dtype`."""
    return dtype in onednn_dtypes()


def native_bf16() -> bool:
    """Whether this CPU computes in bfloat16 in hardware (AVX512-BF16 or AMX). oneDNN runs a bfloat16 linear on
    AVX-512 without them too (`onednn_available`), by converting to float32, and slower than float32: a 460-token
    prefill of the embedded model took 3.7 s in bf16 autocast against 1.4 s in fp32 (one thread, an AVX-512 Ice
    Lake Xeon without AVX512-BF16)."""
    return torch.cpu._is_avx512_bf16_supported() or torch.cpu._is_amx_tile_supported()


def warn_if_bf16_is_slow(what: str) -> None:
    """One warning when `what` computes in bfloat16 on a CPU without native bfloat16, where it runs several times
    slower than float32 (a CLLM training step: 75 s in bf16 autocast against 5 s in fp32 on a 2-core AVX2 EPYC;
    `native_bf16` for AVX-512 without it)."""
    if not native_bf16():
        log.warning(
            "%s runs in bfloat16 on a CPU without native bfloat16 (AVX512-BF16 or AMX), several times slower "
            "than float32 here",
            what,
        )


def check_kernel(kernel: str, min_rows: int = 1) -> None:
    """SpecReproError for an unknown `hardware.linear_kernel` or a `hardware.linear_min_rows` below 1."""
    if kernel not in KERNELS:
        raise SpecReproError(f"hardware.linear_kernel={kernel} is not one of {', '.join(KERNELS)}")
    if min_rows < 1:
        raise SpecReproError(f"hardware.linear_min_rows must be >= 1, got {min_rows}")


def set_linear_kernel(
    model: torch.nn.Module, kernel: str, min_rows: int = 1, row_invariant: bool = False
) -> torch.nn.Module:
    """Make the linear modules inside `model` use `kernel`, in place, and return `model`: "onednn" swaps each
    `nn.Linear` for a `PackedLinear` padding to `min_rows` rows, "torch" swaps them back. `row_invariant`
    computes a one-row input as a row of a two-row product, so that it rounds exactly like a row of a
    verification pass (see models/attention.py). oneDNN falls back to torch, with a warning, on a build
    without it."""
    check_kernel(kernel, min_rows)
    if kernel == "onednn" and not onednn_dtypes():
        log.warning("this torch build has no usable oneDNN linear; hardware.linear_kernel=onednn falls back to torch")
        kernel = "torch"
    dtypes = {p.dtype for p in model.parameters() if p.device.type == "cpu" and p.dtype in _PACKABLE}
    if kernel == "onednn" and dtypes - onednn_dtypes():
        log.warning(
            "this CPU has no oneDNN linear for %s (bfloat16 needs AVX-512 or AVX-NE-CONVERT); those layers use torch's",
            ", ".join(sorted(str(d).removeprefix("torch.") for d in dtypes - onednn_dtypes())),
        )
    rows = max(min_rows, 2 if row_invariant else 1)
    for parent in list(model.modules()):
        for name, child in list(parent.named_children()):
            if isinstance(child, PackedLinear):
                if kernel == "onednn":
                    child.min_rows = rows
                else:
                    setattr(parent, name, child.to_linear())
            elif type(child) is torch.nn.Linear and kernel == "onednn":
                setattr(parent, name, PackedLinear(child, rows))
    return model
