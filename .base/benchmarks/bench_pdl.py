"""What programmatic dependent launch (PDL) buys a chain of dependent decode kernels (GPU, sm_90+).

    python -m benchmarks.bench_pdl [--layers 80] [--rows 1] [--shapes 2048x1024,1024x2048]

A chain of GEMVs y = W_i x, each reading the one before it (distinct weights, bf16, more bytes than L2 holds, as a
decode step's layers), replayed from a CUDA graph, in four ways:
- plain: every kernel waits for the one before it to finish (stream order);
- pdl: launched with PDL, gdc_wait first thing (the launch and the programs' start overlap the last kernel's tail);
- pdl+prefetch: the weight tile loaded before gdc_wait, the input after (the weight stream overlaps too);
- pdl+prefetch+trigger: as above, and each kernel lets the next one launch at its start (gdc_launch_dependents).
Prints us per kernel and the bytes floor at the copy rate measured in the same run.
"""
from __future__ import annotations

import argparse

import torch
import triton
import triton.language as tl
from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait

from qwen35.bench.step_timing import copy_rate, graph_ms


@triton.jit
def _gemv(x_ptr, w_ptr, y_ptr, K, N, R: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
          MODE: tl.constexpr):
    """y[r, n] = sum_k W[n, k] x[r, k] for BLOCK_N rows n of W, whole rows loaded at once. MODE 0: no PDL; 1: wait
    first; 2: weights before the wait; 3: as 2, and trigger the next kernel first."""
    if MODE == 3:
        gdc_launch_dependents()
    if MODE == 1:
        gdc_wait()
    n = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    k = tl.arange(0, BLOCK_K)
    m = (n < N)[:, None] & (k < K)[None, :]
    w = tl.load(w_ptr + n[:, None] * K + k[None, :], mask=m, other=0.0).to(tl.float32)
    if MODE >= 2:
        gdc_wait()
    for r in tl.static_range(R):
        x = tl.load(x_ptr + r * K + k, mask=k < K, other=0.0).to(tl.float32)
        tl.store(y_ptr + r * N + n, tl.sum(w * x[None, :], 1).to(y_ptr.dtype.element_ty), mask=n < N)


def chain(weights, xs, mode: int, rows: int) -> None:
    for w, x, y in zip(weights, xs, xs[1:]):
        N, K = w.shape
        block_n = max(1, 16384 // triton.next_power_of_2(K))
        _gemv[(triton.cdiv(N, block_n),)](x, w, y, K, N, R=rows, BLOCK_N=block_n,
                                          BLOCK_K=triton.next_power_of_2(K), MODE=mode, num_warps=4,
                                          launch_pdl=mode > 0)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--layers", type=int, default=80)
    ap.add_argument("--rows", type=int, default=1)
    ap.add_argument("--shapes", default="2048x1024,1024x2048", help="NxK of the GEMVs, repeated along the chain")
    args = ap.parse_args()
    shapes = [tuple(int(v) for v in s.split("x")) for s in args.shapes.split(",")]
    gen = torch.Generator(device="cuda").manual_seed(0)
    weights = [(torch.randn(*shapes[i % len(shapes)], generator=gen, device="cuda") * 0.02).to(torch.bfloat16)
               for i in range(args.layers)]
    xs = [torch.randn(args.rows, weights[0].shape[1], device="cuda", dtype=torch.bfloat16)]
    xs += [torch.empty(args.rows, w.shape[0], device="cuda", dtype=torch.bfloat16) for w in weights]
    nbytes = sum(w.numel() * 2 for w in weights)
    floor = nbytes / copy_rate("cuda") * 1e6 / args.layers
    ref = None
    print(f"{torch.cuda.get_device_name()}: {args.layers} GEMVs {args.shapes}, {args.rows} row(s), "
          f"{nbytes / 2**20:.0f} MB; floor {floor:.2f} us a kernel")
    for mode, name in enumerate(["plain", "pdl", "pdl+prefetch", "pdl+prefetch+trigger"]):
        chain(weights, xs, mode, args.rows)
        torch.cuda.synchronize()
        if ref is None:
            ref = xs[-1].clone()
        assert torch.equal(xs[-1], ref), name  # same bits every way
        ms = graph_ms(lambda: chain(weights, xs, mode, args.rows))
        print(f"  {name:22s} {1e3 * ms / args.layers:6.2f} us a kernel", flush=True)


if __name__ == "__main__":
    main()
