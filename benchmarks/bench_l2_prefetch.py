"""What asking L2 for the next kernel's weights buys a chain of decode GEMVs (GPU, sm_90+).

    python -m benchmarks.bench_l2_prefetch [--layers 40] [--shapes 3088x2048,2048x1024,2304x2048,2048x1152]
                                           [--spin-us 0]

A chain of GEMVs y = W_i x (distinct bf16 weights, more bytes than L2 holds, as a decode step's layers), launched
with PDL, weights loaded before the wait (as layers/linear.py's GEMV), replayed from a CUDA graph, in ways:
- none: no prefetch;
- bulk next / bulk next 2: each kernel's programs first ask L2 for the next (two) kernel(s)' weights, one
  cp.async.bulk.prefetch.L2 per thread (the TMA unit fetches; nothing waits for it);
- lines next: the same with prefetch.global.L2 per 128-byte line.
With --spin-us a one-program kernel that waits that long sits after every GEMV: a latency-bound kernel (the DeltaNet
recurrence, attention decode) during which the memory is idle and a prefetch has time to land.
Prints us per GEMV (spin excluded) and the bytes floor at the copy rate measured in the same run.
"""
from __future__ import annotations

import argparse

import torch
import triton
import triton.language as tl
from triton.language.extra.cuda import gdc_wait

from qwen35.bench.step_timing import copy_rate, graph_ms


@triton.jit
def _bulk(ptr, nbytes, part, parts, THREADS: tl.constexpr):
    per = tl.cdiv(tl.cdiv(nbytes, parts * THREADS), 16) * 16
    start = (part * THREADS + tl.arange(0, THREADS)).to(tl.int64) * per
    size = tl.minimum(per, tl.maximum(nbytes - start, 0)).to(tl.int32)
    addr = ptr.to(tl.pointer_type(tl.int8)) + start
    tl.inline_asm_elementwise("{ .reg .pred p; setp.gt.s32 p, $2, 0; @p cp.async.bulk.prefetch.L2.global [$1], $2; "
                              "mov.u32 $0, 0; }", "=r,l,r", [addr, size], dtype=tl.int32, is_pure=False, pack=1)


@triton.jit
def _lines(ptr, nbytes, part, parts, THREADS: tl.constexpr):
    per = tl.cdiv(tl.cdiv(nbytes, parts * THREADS), 128) * 128
    t = part * THREADS + tl.arange(0, THREADS)
    base = ptr.to(tl.pointer_type(tl.int8))
    for j in range(0, per, 128):
        off = t.to(tl.int64) * per + j
        tl.inline_asm_elementwise("{ .reg .pred p; setp.lt.s64 p, $2, $3; @p prefetch.global.L2 [$1]; "
                                  "mov.u32 $0, 0; }", "=r,l,l,l", [base + off, off, nbytes + 0 * off],
                                  dtype=tl.int32, is_pure=False, pack=1)


@triton.jit
def _gemv(x_ptr, w_ptr, y_ptr, K, N, p1_ptr, p1_bytes, p2_ptr, p2_bytes, BLOCK_N: tl.constexpr,
          BLOCK_K: tl.constexpr, MODE: tl.constexpr):
    pid = tl.program_id(0)
    if MODE == 1 or MODE == 2:
        _bulk(p1_ptr, p1_bytes, pid, tl.num_programs(0), 256)
    if MODE == 2:
        _bulk(p2_ptr, p2_bytes, pid, tl.num_programs(0), 256)
    if MODE == 3:
        _lines(p1_ptr, p1_bytes, pid, tl.num_programs(0), 256)
    n = pid * BLOCK_N + tl.arange(0, BLOCK_N)
    k = tl.arange(0, BLOCK_K)
    m = (n < N)[:, None] & (k < K)[None, :]
    w = tl.load(w_ptr + n[:, None] * K + k[None, :], mask=m, other=0.0).to(tl.float32)
    gdc_wait()
    x = tl.load(x_ptr + k, mask=k < K, other=0.0).to(tl.float32)
    tl.store(y_ptr + n, tl.sum(w * x[None, :], 1).to(y_ptr.dtype.element_ty), mask=n < N)


@triton.jit
def _spin(ns):
    gdc_wait()
    t0 = tl.inline_asm_elementwise("mov.u64 $0, %globaltimer;", "=l", [], dtype=tl.int64, is_pure=False, pack=1)
    t = t0
    while t - t0 < ns:
        t = tl.inline_asm_elementwise("mov.u64 $0, %globaltimer;", "=l", [], dtype=tl.int64, is_pure=False, pack=1)


def chain(weights, xs, mode: int, spin_ns: int) -> None:
    n = len(weights)
    for i, (w, x, y) in enumerate(zip(weights, xs, xs[1:])):
        N, K = w.shape
        block_n = max(1, 16384 // triton.next_power_of_2(K))
        while block_n > 1 and triton.cdiv(N, block_n) < 2 * 132:
            block_n //= 2
        p1, p2 = weights[(i + 1) % n], weights[(i + 2) % n]
        _gemv[(triton.cdiv(N, block_n),)](x, w, y, K, N, p1, p1.numel() * 2, p2, p2.numel() * 2, BLOCK_N=block_n,
                                          BLOCK_K=triton.next_power_of_2(K), MODE=mode, num_warps=8,
                                          launch_pdl=True)
        if spin_ns:
            _spin[(1,)](spin_ns, num_warps=1, launch_pdl=True)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--layers", type=int, default=40)
    ap.add_argument("--shapes", default="3088x2048,2048x1024,2304x2048,2048x1152",
                    help="NxK of the GEMVs, repeated along the chain (default: a TP=4 rank's DeltaNet layer)")
    ap.add_argument("--distinct", type=int, default=0, help="distinct layers of weights (0: --layers; 1: the chain "
                    "rereads one layer's weights, hot in L2)")
    ap.add_argument("--spin-us", default="0,3", help="latency-bound kernel after each GEMV, us (a list: each run)")
    args = ap.parse_args()
    shapes = [tuple(int(v) for v in s.split("x")) for s in args.shapes.split(",")]
    gen = torch.Generator(device="cuda").manual_seed(0)
    weights = [(torch.randn(*s, generator=gen, device="cuda") * 0.02).to(torch.bfloat16)
               for _ in range(args.distinct or args.layers) for s in shapes]
    weights = [weights[i % len(weights)] for i in range(args.layers * len(shapes))]
    # a chain reads each output as the next input: pad the vectors to the widest
    width = max(max(w.shape) for w in weights)
    xs = [torch.randn(width, device="cuda", dtype=torch.bfloat16)]
    xs += [torch.zeros(width, device="cuda", dtype=torch.bfloat16) for _ in weights]
    nbytes = sum(w.numel() * 2 for w in weights)  # (as streamed: rereads counted)
    floor = nbytes / copy_rate("cuda") * 1e6 / len(weights)
    print(f"{torch.cuda.get_device_name()}: {len(weights)} GEMVs {args.shapes}, {nbytes / 2**20:.0f} MB; floor "
          f"{floor:.2f} us a GEMV")
    for spin in [float(s) for s in args.spin_us.split(",")]:
        spin_ns = int(spin * 1e3)
        base = None
        if spin_ns:
            only = graph_ms(lambda: [_spin[(1,)](spin_ns, num_warps=1, launch_pdl=True) for _ in weights])
        for mode, name in enumerate(["none", "bulk next", "bulk next 2", "lines next"]):
            chain(weights, xs, mode, spin_ns)
            torch.cuda.synchronize()
            ref = xs[-1].clone() if mode == 0 else ref
            assert torch.equal(xs[-1], ref), name
            ms = graph_ms(lambda: chain(weights, xs, mode, spin_ns))
            us = 1e3 * (ms - (only if spin_ns else 0)) / len(weights)
            base = base or us
            print(f"  spin {spin:3.1f} us  {name:12s} {us:6.2f} us a GEMV  ({us / base:.2f}x)", flush=True)


if __name__ == "__main__":
    main()
