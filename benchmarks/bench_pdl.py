"""Does programmatic dependent launch (PDL) pay for a decode step's chain of small kernels? (issue #8, batch 1)

    python -m benchmarks.bench_pdl [--layers 40] [--reps 20]

A stand-in for batch-1 decode: per layer a one-program norm-like kernel, then two GEMVs shaped like a DeltaNet
layer's in projection ([1 x 2048] @ [2048 x 12288]) and out projection ([1 x 4096] @ [4096 x 2048]), each reading
the previous kernel's output. Timed in a CUDA graph, per variant: cuBLAS (F.linear), a Triton GEMV launched plainly,
the same launched with PDL (each program waits for the previous kernel first), and with PDL where each program
loads its weights before that wait (they do not depend on the previous kernel), so that the weight stream of the
next GEMV starts while the previous kernel drains. Prints us per layer and per kernel boundary saved.
"""
from __future__ import annotations

import argparse

import torch
import torch.nn.functional as F
import triton
import triton.language as tl

try:
    from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait
except ImportError:  # older Triton
    gdc_wait = gdc_launch_dependents = None


@triton.jit
def _gemv(x_ptr, w_ptr, y_ptr, K: tl.constexpr, BLOCK_N: tl.constexpr, PDL: tl.constexpr,
          PREFETCH: tl.constexpr):
    # y[n] = sum_k w[n, k] x[k] for this program's BLOCK_N rows, the whole K of each in registers
    rn = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    rk = tl.arange(0, K)
    if PREFETCH:
        w = tl.load(w_ptr + rn[:, None] * K + rk[None, :])
    if PDL:
        gdc_wait()
        gdc_launch_dependents()
    if not PREFETCH:
        w = tl.load(w_ptr + rn[:, None] * K + rk[None, :])
    x = tl.load(x_ptr + rk).to(tl.float32)
    y = tl.sum(w.to(tl.float32) * x[None, :], 1)
    tl.store(y_ptr + rn, y.to(y_ptr.dtype.element_ty))


@triton.jit
def _norm(x_ptr, w_ptr, y_ptr, H: tl.constexpr, PDL: tl.constexpr):
    r = tl.arange(0, H)
    w = tl.load(w_ptr + r).to(tl.float32)
    if PDL:
        gdc_wait()
        gdc_launch_dependents()
    x = tl.load(x_ptr + r).to(tl.float32)
    y = x * tl.rsqrt(tl.sum(x * x, 0) / H + 1e-6) * w
    tl.store(y_ptr + r, y.to(y_ptr.dtype.element_ty))


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--layers", type=int, default=40)
    ap.add_argument("--reps", type=int, default=20)
    ap.add_argument("--hidden", type=int, default=2048)
    ap.add_argument("--inner", type=int, default=4096)
    ap.add_argument("--in-out", type=int, default=12288)
    args = ap.parse_args()
    h, inner, n_in = args.hidden, args.inner, args.in_out
    dev, dt = "cuda", torch.bfloat16
    layers = [(torch.randn(h, device=dev, dtype=dt), torch.randn(n_in, h, device=dev, dtype=dt) / 50,
               torch.randn(h, inner, device=dev, dtype=dt) / 50) for _ in range(args.layers)]
    x0 = torch.randn(h, device=dev, dtype=dt)
    xn = torch.empty(h, device=dev, dtype=dt)
    mid = torch.empty(n_in, device=dev, dtype=dt)
    out = torch.empty(h, device=dev, dtype=dt)

    def chain(kind: str):
        pdl = kind in ("pdl", "prefetch")
        pre = kind == "prefetch"
        extra = {"launch_pdl": True} if pdl else {}
        x = x0
        for nw, w_in, w_out in layers:
            _norm[(1,)](x, nw, xn, H=h, PDL=pdl, num_warps=4, **extra)
            if kind == "cublas":
                torch.matmul(w_in, xn, out=mid)
                torch.matmul(w_out, mid[:inner], out=out)
            else:
                _gemv[(n_in // 4,)](xn, w_in, mid, K=h, BLOCK_N=4, PDL=pdl, PREFETCH=pre, num_warps=4, **extra)
                _gemv[(h // 2,)](mid, w_out, out, K=inner, BLOCK_N=2, PDL=pdl, PREFETCH=pre, num_warps=4,
                                 **extra)
            x = out
        return out

    ref = None
    results = {}
    for kind in ("cublas", "plain", "pdl", "prefetch"):
        try:
            y = chain(kind).float().clone()
            torch.cuda.synchronize()
            if ref is None:
                ref = y
            err = ((y - ref).abs().max() / ref.abs().max()).item()
            g = torch.cuda.CUDAGraph()
            with torch.cuda.graph(g):
                chain(kind)
            g.replay()
            torch.cuda.synchronize()
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            for _ in range(args.reps):
                g.replay()
            end.record()
            torch.cuda.synchronize()
            us = start.elapsed_time(end) * 1e3 / args.reps
            g.replay()
            torch.cuda.synchronize()
            err2 = ((out.float() - ref).abs().max() / ref.abs().max()).item()
            results[kind] = us
            print(f"{kind:9s} {us:9.1f} us/step {us / args.layers:7.2f} us/layer  rel err eager {err:.1e} "
                  f"graph {err2:.1e}")
        except Exception as e:  # report and go on: the point is the table
            print(f"{kind:9s} failed: {type(e).__name__}: {str(e)[:300]}")
    bytes_ = args.layers * 2 * (n_in * h + h * inner)
    print(f"weights {bytes_ / 1e9:.3f} GB: at 4.25 TB/s {bytes_ / 4.25e6:.1f} us/step")
    if "plain" in results and "prefetch" in results:
        saved = (results["plain"] - results["prefetch"]) / (3 * args.layers)
        print(f"PDL + prefetch saves {saved:.2f} us per kernel boundary")


if __name__ == "__main__":
    main()
