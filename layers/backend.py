"""Which kernels the layers run, chosen once before the model is built.

    torch  the reference path: plain torch ops, the oracle every fast kernel is tested against (default on the CPU)
    fast   fused Triton kernels (default on CUDA; on the CPU they run through Triton's interpreter when the
           environment sets TRITON_INTERPRET=1, which is how CI checks them at tiny shapes)

The choice comes from the runner (`--kernels`) or the environment variable QWEN35_KERNELS. Every layer file names
its two implementations of an operation the same way: `<op>_torch(...)` and `<op>_fast(...)`, same signature, same
result within the stated tolerances; a layer binds one of them when it is constructed, so the forward never asks.
"""
from __future__ import annotations

import os

import torch

try:  # Triton comes with CUDA builds of torch and installs on the CPU (interpreter); the torch path never needs it
    import triton
    import triton.language as tl
except ImportError:  # pragma: no cover - environments without triton run the torch path only
    triton = None
    tl = None

KERNELS = ("torch", "fast")
ENV = "QWEN35_KERNELS"
_current = "torch"


def resolve(name: str | None, device: torch.device | str) -> str:
    """The kernel set for `device`: `name`, else $QWEN35_KERNELS, else fast on CUDA and torch on the CPU."""
    name = name or os.environ.get(ENV) or ("fast" if torch.device(device).type == "cuda" else "torch")
    if name not in KERNELS:
        raise ValueError(f"kernels must be one of {', '.join(KERNELS)}; got {name!r}")
    if name == "fast":
        if triton is None:
            raise RuntimeError("kernels 'fast' need the triton package (pip install triton)")
        if torch.device(device).type == "cpu" and os.environ.get("TRITON_INTERPRET") != "1":
            raise RuntimeError("kernels 'fast' on the CPU run through Triton's interpreter: set TRITON_INTERPRET=1 "
                               "before starting Python, or use --kernels torch")
    return name


def set_kernels(name: str) -> None:
    global _current
    if name not in KERNELS:
        raise ValueError(f"kernels must be one of {', '.join(KERNELS)}; got {name!r}")
    _current = name


def kernels() -> str:
    return _current


def use_fast() -> bool:
    return _current == "fast"


class use_kernels:
    """Context manager for tests and tools that build layers with a given kernel set: `with use_kernels("fast"):`."""

    def __init__(self, name: str):
        self.name, self.prev = name, None

    def __enter__(self):
        self.prev = kernels()
        set_kernels(self.name)

    def __exit__(self, *exc):
        set_kernels(self.prev)


if triton is not None:
    @triton.jit
    def round_to(x, DTYPE: tl.constexpr):
        """fp32 x rounded to nearest-even in DTYPE, returned as fp32: the reference rounds intermediates to the model
        dtype, and kernels that promise its results round at the same points. bf16 is rounded on the bits, because
        a plain x.to(bf16).to(fp32) round trip did not reproduce torch's rounding in a compiled kernel (H200,
        triton 3.6: the intermediate rounding was lost) and the interpreter truncates instead."""
        if DTYPE == tl.bfloat16:
            bits = x.to(tl.uint32, bitcast=True)
            bits = (bits + 0x7FFF + ((bits >> 16) & 1)) & 0xFFFF0000
            return bits.to(tl.float32, bitcast=True)
        elif DTYPE == tl.float32:
            return x
        else:
            return x.to(DTYPE).to(tl.float32)
else:  # pragma: no cover
    round_to = None
