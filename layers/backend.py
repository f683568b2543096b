"""Which kernels the layers run, chosen once before the model is built.

    torch  the reference path: plain torch ops, the oracle every fast kernel is tested against (default on the CPU)
    fast   fused Triton kernels (default on CUDA; on the CPU they run through Triton's interpreter when the
           environment sets TRITON_INTERPRET=1, which is how CI checks them at tiny shapes)

The choice comes from the runner (`--kernels`) or the environment variable QWEN35_KERNELS. Every layer file names
its two implementations of an operation the same way: `<op>_torch(...)` and `<op>_fast(...)`, same signature, same
result within the stated tolerances; a layer binds one of them when it is constructed, so the forward never asks.
"""
from __future__ import annotations

import functools
import os
from typing import Callable

import torch

from dist import parallel

try:  # Triton comes with CUDA builds of torch and installs on the CPU (interpreter); the torch path never needs it
    import triton
    import triton.language as tl
except ImportError:  # pragma: no cover - environments without triton run the torch path only
    triton = None
    tl = None

_INTERPRET = os.environ.get("TRITON_INTERPRET") == "1"
try:  # grid dependency control (Triton >= 3.4), compiled for the GPU only: the interpreter has no such calls
    from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait
except ImportError:  # pragma: no cover
    gdc_launch_dependents = gdc_wait = None

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


@functools.lru_cache(maxsize=None)
def sm_count(device: torch.device | str) -> int:
    """The device's streaming multiprocessors, which launch sizes follow; 4 on the CPU (the interpreter: any small
    number; tests pick launch sizes explicitly)."""
    device = torch.device(device)
    return torch.cuda.get_device_properties(device).multi_processor_count if device.type == "cuda" else 4


class use_kernels:
    """Context manager for tests and tools that build layers with a given kernel set: `with use_kernels("fast"):`."""

    def __init__(self, name: str):
        self.name, self.prev = name, None

    def __enter__(self):
        self.prev = kernels()
        set_kernels(self.name)

    def __exit__(self, *exc):
        set_kernels(self.prev)


ALIGN_BYTES = 16  # Triton specialises a pointer argument on 16-byte alignment

# Programmatic dependent launch (PDL, sm_90+). A kernel launched with **pdl() may start as the kernel before it in
# the stream drains: its programs load what no kernel writes (weights: the GEMV's tile), then prior_done()
# (griddepcontrol.wait: the kernels before it have finished and their writes are visible) before they read or write
# anything else. So its launch, its programs' start and its weight loads overlap the last one's tail and memory
# flush. A kernel lets the next launch early (griddepcontrol.launch_dependents, next_may_start) only where
# early_launch says: a kernel launched while the one before still ran placed its programs on the SMs free at that
# moment, and the MoE kernels at 8 tokens ran 2-3x longer (TP=4 batch 8 2.99 -> 3.45 ms); launched as the last
# programs exit, it costs nothing anywhere. One 2x H200 call (2026-11-28): TP=2 2.03 / 2.41 -> 1.94 / 2.32 ms at
# batch 1 / 2, TP=1 2.60 / 3.29 -> 2.44 / 3.15, batch 4-16 unchanged
# (`results/2026-11-28_record_h200x2_tp{1,2}_pdl*.json`). Every Triton kernel of layers/ follows the rule (dist/'s
# run in plain stream order); the interpreter runs prior_done and next_may_start as no-ops. QWEN35_PDL=0 launches
# without it.
PDL_ENV = "QWEN35_PDL"


def early_launch(rows: int) -> bool:
    """Whether a kernel of `rows` rows whose next kernel is a GEMV (the DeltaNet and attention decode, the MoE's
    down + combine, the GEMV that pushes a boundary) lets that GEMV launch as soon as its own programs have waited
    (next_may_start), so the GEMV's programs load their weights while this kernel runs: at one row and TP > 1. The
    GEMV's input comes from a peer's push there, and its weights stream while its pull waits: TP=2 1.936 / 2.317 /
    2.888 -> 1.860 / 2.317 / 2.886 ms at batch 1 / 2 / 4 with this rule (one 2x H200 call, 2026-11-30,
    `results/2026-11-30_record_h200x2_tp2_early_b1{,_base}.json`). Triggering at every batch lost 1-3% at batch 2-16
    (the MoE's grids take every SM) and at TP=1 (nothing to wait for; 2026-11-29, `results/archive/`)."""
    return rows == 1 and bool(pdl()) and parallel.tp_size() > 1


@functools.lru_cache(maxsize=None)
def pdl() -> dict:
    """The launch option of programmatic dependent launch where this process's GPU has it (sm_90+), else none."""
    if os.environ.get(PDL_ENV, "1") == "0" or not torch.cuda.is_available() or _INTERPRET:
        return {}
    return {"launch_pdl": True} if torch.cuda.get_device_capability()[0] >= 9 else {}


# Kernel scratch that CUDA graphs hold by address: one buffer per device and kind, zeroed when made, grown (outside
# graph capture only: a warm-up run makes it), never shrunk or freed (a captured graph keeps the address it was
# captured with; an outgrown buffer is kept alive here).
_OUTGROWN: list[torch.Tensor] = []


def dot_precision(dtype: torch.dtype) -> str:
    """tl.dot's input_precision for operands of this dtype: fp32 models multiply in full fp32 (Triton's default would
    be tf32); bf16/fp16 operands ignore the setting."""
    return "ieee" if dtype == torch.float32 else "tf32"


def graph_scratch(store: dict, what: str, n: int, device: torch.device, dtype: torch.dtype, least: int,
                  row: tuple[int, ...] = ()) -> torch.Tensor:
    """`store`'s buffer for `device`, of at least n rows of shape `row` (least rows when made)."""
    buf = store.get(device)
    if buf is None or buf.shape[0] < n:
        if device.type == "cuda" and torch.cuda.is_current_stream_capturing():
            raise RuntimeError(f"a kernel needs {n} {what} while a CUDA graph is being captured; run the same batch "
                               "once outside the graph first (a warm-up) so that they exist")
        if buf is not None:
            _OUTGROWN.append(buf)
        buf = torch.zeros(max(n, least), *row, dtype=dtype, device=device)
        store[device] = buf
    return buf


# Arrival counters (int32, zero between launches) for kernels whose programs count themselves in and whose last
# program to arrive finishes the group's work (DeltaNet decode and verify: the gated norm; the verify commit: the q/k
# tails; attention decode: the merge of the splits; speculative sampling's passes: the merge of a row's blocks),
# resetting its counter. One buffer per device, shared by every such kernel (they run one after another on one
# stream).
_COUNTERS: dict[torch.device, torch.Tensor] = {}


def arrival_counters(n: int, device: torch.device) -> torch.Tensor:
    """At least n zeroed counters on `device` (graph_scratch)."""
    return graph_scratch(_COUNTERS, "arrival counters", n, device, torch.int32, 4096)


def aligned_sizes(sizes: list[int], dtype: torch.dtype) -> list[int]:
    """`sizes` (elements) rounded up so that parts laid end to end each start on ALIGN_BYTES."""
    per = max(1, ALIGN_BYTES // dtype.itemsize)
    return [-(-n // per) * per for n in sizes]


def empty_aligned(sizes: list[int], dtype: torch.dtype, device: torch.device | str) -> list[torch.Tensor]:
    """Buffers of `sizes` elements from one allocation, each 16-byte aligned. Parts of one allocation laid end to
    end start wherever the sizes before them end: a kernel that takes them would see a pointer aligned or not
    depending on the step's token count, and Triton compiles a kernel per alignment (~1 s mid-serving)."""
    padded = aligned_sizes(sizes, dtype)
    parts = torch.empty(sum(padded), dtype=dtype, device=device).split(padded)
    return [part[:n] for part, n in zip(parts, sizes)]


def on_compile(callback: Callable[[str], None]) -> Callable[[], None]:
    """From now on call `callback(kernel)` (Triton's description of it: name, options, argument types and
    specialisations) each time Triton compiles a kernel, i.e. meets a kernel or specialisation this process has not
    run yet (Triton's disk cache may still make it quick); returns a function that stops it. The engine uses it to
    log compiles after its start-up warm-up (each one ~1 s in the middle of serving); tests and benchmarks count
    them. A no-op where Triton has no compile hook (the interpreter never compiles)."""
    knobs = getattr(triton, "knobs", None)
    if knobs is None or not hasattr(knobs.runtime, "jit_cache_hook"):
        return lambda: None
    previous = knobs.runtime.jit_cache_hook

    def hook(*args, **kwargs):
        callback(kwargs.get("repr", "?"))
        return previous(*args, **kwargs) if previous else None  # a true value would skip the compile

    knobs.runtime.jit_cache_hook = hook

    def stop():
        if knobs.runtime.jit_cache_hook is hook:
            knobs.runtime.jit_cache_hook = previous
    return stop


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

    @triton.jit
    def rms_norm_row(s, res_ptr, res_out_ptr, w_ptr, out_ptr, cols, mask, store, n, eps,
                     HAS_RESIDUAL: tl.constexpr, PLAIN: tl.constexpr):
        """One row of the layer norm (layers/norm.py), shared by the norm kernel and the GEMV that folds it in
        (layers/linear.py), so that both give the same bits: s (the row of x, loaded) + the residual row, rounded to
        the model dtype once (stored at res_out_ptr where `store`); then s / rms(s) * (1 + w), or with PLAIN
        round(s / rms(s)) * w (the oracle's two roundings), rounded to out's dtype, stored at out_ptr where `store`
        and returned."""
        w = tl.load(w_ptr + cols, mask=mask, other=0.0).to(tl.float32)  # first: in flight with the others
        if HAS_RESIDUAL:
            r = tl.load(res_ptr + cols, mask=mask, other=0.0)
            s = round_to(s.to(tl.float32) + r.to(tl.float32), r.dtype)  # the reference's add, rounded once
            tl.store(res_out_ptr + cols, s.to(r.dtype), mask=store)
        s = s.to(tl.float32)
        inv = tl.rsqrt(tl.sum(s * s, 0) / n + eps)
        dt = out_ptr.dtype.element_ty
        if PLAIN:
            y = round_to(s * inv, dt) * w
        else:
            y = s * inv * (1.0 + w)
        y = y.to(dt)
        tl.store(out_ptr + cols, y, mask=store)
        return y

    if _INTERPRET or gdc_wait is None:
        @triton.jit
        def prior_done():
            """(the interpreter runs launches one after another: nothing to wait for)"""
            pass

        @triton.jit
        def next_may_start():
            """(likewise: nothing to launch early)"""
            pass
    else:
        @triton.jit
        def prior_done():
            """Wait until the kernels before this one in the stream have finished, their writes visible (pdl())."""
            gdc_wait()

        @triton.jit
        def next_may_start():
            """Let the kernel after this one launch now (early_launch); its programs wait in prior_done until this
            one has finished."""
            gdc_launch_dependents()

else:  # pragma: no cover
    round_to = rms_norm_row = prior_done = next_may_start = None
