"""What programmatic dependent launch (PDL) buys a chain of dependent decode kernels (GPU, sm_90+).

    python -m benchmarks.bench_pdl [--layers 80] [--rows 1] [--shapes 2048x1024,1024x2048]

A chain of GEMVs y = W_i x, each reading the one before it (distinct weights, bf16, more bytes than L2 holds, as a
decode step's layers), replayed from a CUDA graph, in four ways:
- plain: every kernel waits for the one before it to finish (stream order);
- pdl: launched with PDL, gdc_wait first thing (the launch and the programs' start overlap the last kernel's tail);
- pdl+prefetch: the weight tile loaded before gdc_wait, the input after (the weight stream overlaps too);
- pdl+prefetch+trigger: as above, and each kernel lets the next one launch at its start (gdc_launch_dependents);
- persistent: one launch for the whole chain (issue #26's end state in miniature): a program per column block, all
  resident at once, each loading its block of GEMV i's weights, then waiting until every program has stored its
  part of GEMV i-1 (a counter per GEMV in global memory: release after the stores, acquire before the loads), then
  reading the input from L2 and storing its outputs. The counters are zeroed in the graph before the launch.
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


SPIN_LIMIT = tl.constexpr(1 << 24)  # polls before a program gives up (a wrong result, not a hang, if programs were not resident)


@triton.jit
def _weights(w_ptr, w_offs, Ns, Ks, i, valid, n, k):
    """Program's block of GEMV i's weights (bf16, nothing where not valid). The hints give the loads _gemv's 16-byte
    vectors, and so its layout and order of sums: the same bits."""
    N = tl.multiple_of(tl.load(Ns + i), 16)
    K = tl.multiple_of(tl.load(Ks + i), 16)
    m = (n < N)[:, None] & (k < K)[None, :] & valid
    return tl.load(w_ptr + tl.multiple_of(tl.load(w_offs + i), 16) + n[:, None] * K + k[None, :], mask=m, other=0.0)


@triton.jit
def _persistent_chain(x_ptr, w_ptr, counts, w_offs, x_offs, Ns, Ks, L, R: tl.constexpr, BLOCK_N: tl.constexpr,
                      BLOCK_K: tl.constexpr, POLL: tl.constexpr, DEPTH: tl.constexpr):
    """The whole chain in one launch: program p computes rows [p*BLOCK_N, (p+1)*BLOCK_N) of every GEMV (whole rows
    of W loaded at once, as _gemv's). GEMV i's weights are loaded before the wait for GEMV i-1's outputs (DEPTH 1),
    or GEMV i+1's too (DEPTH 2: two tiles in flight, bf16 in registers), so they stream while the slowest program
    of i-1 finishes. POLL 0: poll with acquire atomics; 1: with volatile loads, then one acquire."""
    pid = tl.program_id(0)
    P = tl.num_programs(0)
    k = tl.arange(0, BLOCK_K)
    n = pid * BLOCK_N + tl.arange(0, BLOCK_N)
    w = _weights(w_ptr, w_offs, Ns, Ks, 0, True, n, k)
    for i in range(L):
        if DEPTH == 2:
            w_next = _weights(w_ptr, w_offs, Ns, Ks, tl.minimum(i + 1, L - 1), i + 1 < L, n, k)
        if i > 0:
            spins = 0
            if POLL == 0:
                c = tl.atomic_add(counts + i - 1, 0, sem="acquire")
                while (c < P) & (spins < SPIN_LIMIT):
                    c = tl.atomic_add(counts + i - 1, 0, sem="acquire")
                    spins += 1
            else:
                c = tl.load(counts + i - 1, volatile=True)
                while (c < P) & (spins < SPIN_LIMIT):
                    c = tl.load(counts + i - 1, volatile=True)
                    spins += 1
                c = tl.atomic_add(counts + i - 1, 0, sem="acquire")
        N = tl.load(Ns + i)
        K = tl.load(Ks + i)
        xo = tl.multiple_of(tl.load(x_offs + i), 16)
        yo = tl.multiple_of(tl.load(x_offs + i + 1), 16)
        for r in tl.static_range(R):
            x = tl.load(x_ptr + xo + r * K + k, mask=k < K, other=0.0, cache_modifier=".cg").to(tl.float32)
            y = tl.sum(w.to(tl.float32) * x[None, :], 1)
            tl.store(x_ptr + yo + r * N + n, y.to(x_ptr.dtype.element_ty), mask=n < N)
        tl.debug_barrier()  # every thread's stores before the one-thread release
        tl.atomic_add(counts + i, 1, sem="release")
        if DEPTH == 2:
            w = w_next
        elif i + 1 < L:
            w = _weights(w_ptr, w_offs, Ns, Ks, i + 1, True, n, k)


def persistent(flat_w, flat_x, table, counts, rows: int, poll: int, depth: int) -> None:
    w_offs, x_offs, Ns, Ks, block_n, block_k, programs = table
    counts.zero_()
    _persistent_chain[(programs,)](flat_x, flat_w, counts, w_offs, x_offs, Ns, Ks, Ns.numel(), R=rows,
                                   BLOCK_N=block_n, BLOCK_K=block_k, POLL=poll, DEPTH=depth, num_warps=4)


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
    ap.add_argument("--persistent-tile", type=int, default=16384,
                    help="weight elements per program of the persistent kernel (fewer: more programs)")
    args = ap.parse_args()
    shapes = [tuple(int(v) for v in s.split("x")) for s in args.shapes.split(",")]
    gen = torch.Generator(device="cuda").manual_seed(0)
    dims = [shapes[i % len(shapes)] for i in range(args.layers)]
    # one buffer for the weights and one for the activations (the persistent kernel takes offsets into them)
    w_offs = [0]
    for N, K in dims:
        w_offs.append(w_offs[-1] + N * K)
    flat_w = (torch.randn(w_offs[-1], generator=gen, device="cuda") * 0.02).to(torch.bfloat16)
    weights = [flat_w[o:o + N * K].view(N, K) for o, (N, K) in zip(w_offs, dims)]
    x_offs = [0, args.rows * dims[0][1]]
    for N, _ in dims:
        x_offs.append(x_offs[-1] + args.rows * N)
    flat_x = torch.zeros(x_offs[-1], device="cuda", dtype=torch.bfloat16)
    flat_x[:x_offs[1]].normal_()
    xs = [flat_x[x_offs[0]:x_offs[1]].view(args.rows, dims[0][1])]
    xs += [flat_x[x_offs[i + 1]:x_offs[i + 2]].view(args.rows, N) for i, (N, _) in enumerate(dims)]
    block_k = triton.next_power_of_2(max(K for _, K in dims))
    block_n = max(1, args.persistent_tile // block_k)
    programs = max(triton.cdiv(N, block_n) for N, _ in dims)
    as_t = lambda v: torch.tensor(v, dtype=torch.int64, device="cuda")
    table = (as_t(w_offs[:-1]), as_t(x_offs), as_t([N for N, _ in dims]), as_t([K for _, K in dims]), block_n,
             block_k, programs)
    counts = torch.zeros(args.layers, dtype=torch.int32, device="cuda")
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
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    for poll, depth in ((0, 1), (1, 1), (0, 2), (1, 2)):
        name = f"persistent {('atomic', 'volatile')[poll]} poll, {depth} deep"
        xs[-1].zero_()
        persistent(flat_w, flat_x, table, counts, args.rows, poll, depth)
        torch.cuda.synchronize()
        ok = torch.equal(xs[-1], ref)
        ms = graph_ms(lambda: persistent(flat_w, flat_x, table, counts, args.rows, poll, depth))
        ok = ok and torch.equal(xs[-1], ref)
        diff = (xs[-1].float() - ref.float()).abs().max().item() / ref.float().abs().max().item()
        print(f"  {name:22s} {1e3 * ms / args.layers:6.2f} us a kernel ({table[-1]} programs on {sms} SMs, "
              f"{'same bits' if ok else f'other bits: max diff {diff:.1e} of max'})", flush=True)


if __name__ == "__main__":
    main()
