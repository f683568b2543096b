"""Sparse MoE block (spec §5): softmax router over all experts, top-k renormalised, routed experts + a shared expert
scaled by a per-token sigmoid gate.

TP split: expert parallel. Rank r owns a contiguous block of E/tp experts (fused [E, 2I, H] / [E, H, I] tensors are
sliced on dim 0) and adds the contributions of its experts only; entries routed to other ranks' experts are dropped
here. The router is replicated so every rank routes identically. The shared expert is split by its intermediate
dimension (an even share of its work on every rank). The caller's all-reduce sums the partial outputs.

The router and the shared-expert gate read the same input: their weights live in one [E + 1, H] tensor (fuse_rows),
so one GEMM gives the logits [T, E + 1] (column E is the shared gate's). Two implementations of the block
(layers/backend.py), bound once when the layer is built: moe_torch (the oracle) and moe_fast, made of these steps:

    route_torch / route_fast      softmax (fp32) over the logits rounded to the model dtype, top-k, renormalise
    align_torch / align           the sorted layout below
    experts_torch / experts_fast  routed experts + sigmoid(shared gate) * shared expert, in the model dtype
    front_torch / front_fast      (decode) router GEMM + route + the sorted layout, in one launch
    gate_up_gemv_torch / _fast    (decode) route + the gate|up GEMVs of each token's experts, no layout, in one launch
    down_combine_torch / _fast    (decode) the down GEMMs, routing weights and the per-token sum, in one launch

experts_torch is the oracle: one expert at a time, with host syncs (eager only). experts_fast is Triton launches
with no host sync and buffers sized from T alone, so CUDA graphs capture it:

    align            (token, slot) pairs of this rank's experts grouped by expert into a sorted layout (below): one
                     program (_align_kernel) up to ALIGN_SERIAL_MAX_T tokens; above, align_chunked's three launches
                     over chunks of pairs (_align_count_kernel, _align_offsets_kernel, _align_scatter_kernel), as one
                     program's serial loops over the T * k pairs took 0.41 ms per layer at T = 8192 (1x H200)
    _gate_up_kernel  grouped GEMM x @ [W_gate | W_up]^T with silu(gate) * up in the epilogue -> act [rows, I]
    _down_kernel     grouped GEMM act @ W_down^T times the routing weight in the epilogue -> y [rows, H]
    _combine_kernel  per token: the k routed rows in top-k order, then the shared row, summed in fp32 -> [T, H]

Prefill (T > FRONT_MAX_T) is the router GEMM, _route_kernel and these: 8 dependent launches per layer, where the
grouped kernels stream each expert's weights once for all its tokens. At decode sizes the launches, not the bytes,
are the cost (more so at TP=8, where a rank's expert bytes shrink 8x), so moe_decode_fast runs 3 on the GEMV path
(up to GEMV_MAX_T tokens without a table; the tuned table says per bucket), else 5 (or 6):

    router GEMM           logits [T, E + 1]: the GEMV kernel, or the skinny one (router_logits_fast)
    _gate_up_gemv_kernel  (GEMV path) per (token, N tile): the token's routing (_route_kernel's code: the same bits;
                          every program routes, one stores it), then its local experts' gate|up rows as one tile and
                          the shared expert's, in one software-pipelined H loop -> act: shared row t, pair p at row
                          T + p (other ranks' pairs: -1 in the pair -> row index, rows unwritten); then
                          _down_combine_kernel below, which reads both paths' act through that index
    _route_kernel         one program per token
    _align_kernel         one program: the sorted layout
    _gate_up_kernel       as above, on that layout
    _down_combine_kernel  (few tokens) per (token, N tile): the token's routed experts as one tile and the shared
                          expert's, in one software-pipelined K loop (every expert's loads in flight together),
                          each GEMV times its weight, summed in fp32 in a fixed order; else _down_kernel +
                          _combine_kernel as above. The tuned table says which, per power-of-two bucket of T and
                          rank shape (DOWN_COMBINE_MAX_T without a table)

Fewer launches measured slower (1x H200, 2026-11-24, python -m benchmarks.bench_moe --tp 1 --decode-only, in CUDA
graphs): routing and layout in one program (one launch less) took 26 us at T = 1..16 and 88 us at T = 64, where
_route_kernel + _align_kernel take 8-10 us, as one program's reductions over [16, 256] tiles serialise; the front
kernel, which would fold the router GEMM in too, ~32 us against 11-19 us for the three launches (USE_FRONT: off):

    _front_kernel  logits slices by many programs; the last program of each token block routes it; the last of
                   those builds the sorted layout

The choices depend on shapes only, at power-of-two boundaries: a decode batch padded for a CUDA graph never crosses
the next power of two, so the padded batch takes the same kernels and gives the same bits as the batch run eagerly.

Sorted layout: rows grouped in blocks of BLOCK_M rows that belong to one expert each. The shared expert is one
more expert (index num_local, its own weight pointers; its intermediate size may differ: 64 per rank at TP=8 vs the
routed experts' 512) and comes first: rows [0, S), S = T rounded up to BLOCK_M, row t = token t. Then each local
expert's pairs (pair p = t * k + slot), the group padded to a multiple of BLOCK_M with pair -1. Buffers are sized
by the worst case for T, so nothing depends on the routing on the host. A group holds its pairs in pair order
(align_torch's layout exactly) from every builder but _align_kernel, which places them by integer atomics, so
their order may vary between runs; no result depends on it (every output row is computed from its own input row,
and the combine sums each token's rows in a fixed order), so the output is bitwise deterministic: no
floating-point atomics anywhere.

The router GEMM, the kernels' tiles and the fp32 accumulation differ from the oracle's only in rounding; the fast
kernels round to the model dtype where the oracle does (GEMM outputs, silu, the products with the weights).
"""
from __future__ import annotations

import functools
import json
import os
from typing import NamedTuple

import torch
import torch.nn.functional as F
from torch import nn

from dist import parallel
from layers import backend
from layers.backend import empty_aligned, round_to, tl, triton
from layers.linear import (SKINNY_MAX_M, Linear, computed, even_split, fuse_rows, linear_fast, make_param,
                           skinny_gemm)
from layers.mlp import MLP, mlp_torch

CONFIG_FILE = os.path.join(os.path.dirname(os.path.abspath(__file__)), "moe_configs.json")


class ExpertWeights(NamedTuple):
    """This rank's expert weights: routed [num_local, 2I, H] / [num_local, H, I] for experts start.. and the shared
    expert's local shard [2 I_s, H] (gate rows then up rows) / [H, I_s]."""
    gate_up: torch.Tensor
    down: torch.Tensor
    start: int
    shared_gate_up: torch.Tensor
    shared_down: torch.Tensor


# ------------------------------------------------------------------------------------------------------ routing
def route_torch(logits: torch.Tensor, top_k: int):
    """logits [T, E + 1] (router | shared gate) in the model dtype -> ids [T, k] int64, weights [T, k] and
    sigmoid(shared gate) [T, 1] in the model dtype.

    Ties go to the lowest expert id (a stable sort): torch.topk leaves the order of equal values unspecified, and
    on the CPU it does not pick the lowest ids."""
    probs = torch.softmax(logits[:, :-1], dim=-1, dtype=torch.float32)
    weights, ids = probs.sort(dim=-1, descending=True, stable=True)
    weights, ids = weights[:, :top_k], ids[:, :top_k]
    weights = weights / weights.sum(dim=-1, keepdim=True)
    return ids, weights.to(logits.dtype), torch.sigmoid(logits[:, -1:])


ROUTER_PAD_ROWS = 8      # cuBLAS runs N = E + 1 = 257 on an unaligned kernel, several times slower than N = 264
ROUTER_GEMV_MAX_T = 4    # router_logits_fast: the GEMV kernel up to this many tokens


def router_logits(x: torch.Tensor, router: torch.Tensor) -> torch.Tensor:
    """F.linear(x, router): logits [T, E + 1] (router | shared gate). Where the router is the leading rows of a
    buffer padded to a multiple of ROUTER_PAD_ROWS rows (SparseMoE's, from fuse_rows), the GEMM runs over the padded
    rows and the extra columns are dropped as a view (row stride = padded rows): at N = 257 cuBLAS picked a
    cutlass align1 kernel that took 6.3 of 254 ms at 8 x 1024 prefill (1x H200 profile, 2026-11-24)."""
    rows, H = router.shape
    padded = -(-rows // ROUTER_PAD_ROWS) * ROUTER_PAD_ROWS
    if padded != rows and router.is_contiguous():
        room = router.untyped_storage().nbytes() // router.element_size() - router.storage_offset()
        if room >= padded * H:
            return F.linear(x, router.as_strided((padded, H), (H, 1)))[:, :rows]
    return F.linear(x, router)


def router_logits_fast(x: torch.Tensor, router: torch.Tensor) -> torch.Tensor:
    """router_logits for the decode kernels (layers/linear.py): the GEMV kernel up to ROUTER_GEMV_MAX_T tokens, the
    skinny GEMM up to SKINNY_MAX_M, where cuBLAS has one poor tile for the 257-wide output (1x H200, 2026-11-25, CUDA
    graphs, weights from HBM: 8.2-8.4 us at 4-8 tokens against GEMV 3.7 at 4 and skinny 4.3 at 8), cuBLAS above.
    The logits differ from cuBLAS's by the order of the fp32 sums only; a choice by T alone, so a padded graph batch
    takes the same path as the batch run eagerly."""
    T = x.shape[0]
    if T <= ROUTER_GEMV_MAX_T:
        return linear_fast(x, router, gemv_rows=ROUTER_GEMV_MAX_T)  # (computes a PendingNorm x in its prologue)
    x = computed(x)
    if T <= SKINNY_MAX_M:
        return skinny_gemm(x, router)
    return router_logits(x, router)


def route_fast(logits: torch.Tensor, top_k: int):
    """route_torch in one Triton kernel (one program per token); ids are int32."""
    T, num_experts = logits.shape[0], logits.shape[1] - 1
    ids = torch.empty(T, top_k, dtype=torch.int32, device=logits.device)
    weights = torch.empty(T, top_k, dtype=logits.dtype, device=logits.device)
    shared_gate = torch.empty(T, 1, dtype=logits.dtype, device=logits.device)
    if T:
        block = triton.next_power_of_2(num_experts)
        _route_kernel[(T,)](logits, ids, weights, shared_gate, num_experts, logits.stride(0), TOP_K=top_k,
                            K_POW2=triton.next_power_of_2(top_k), BLOCK_E=block, num_warps=max(1, min(4, block // 128)))
    return ids, weights, shared_gate


# ------------------------------------------------------------------------------------------------------ experts
def experts_torch(x: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor, shared_gate: torch.Tensor,
                  w: ExpertWeights) -> torch.Tensor:
    """Routed experts of this rank one at a time (needs the per-expert counts on the host), summed in fp32 in expert
    order, plus shared_gate * shared expert; cast to the model dtype. x: [T, H]; ids, weights: [T, k]."""
    T, k = ids.shape
    out = torch.zeros(T, x.shape[1], dtype=torch.float32, device=x.device)
    num_local = w.gate_up.shape[0]
    local = ids.flatten().long() - w.start
    entry = ((local >= 0) & (local < num_local)).nonzero().squeeze(1)
    experts = local[entry]
    order = torch.argsort(experts, stable=True)
    entry, experts = entry[order], experts[order]
    counts = torch.bincount(experts, minlength=num_local).tolist()
    tokens = entry // k
    entry_weights = weights.flatten()[entry]
    offset = 0
    for e, n in enumerate(counts):
        if n == 0:
            continue
        tok = tokens[offset: offset + n]
        y = mlp_torch(x[tok], w.gate_up[e], w.down[e]) * entry_weights[offset: offset + n, None]
        out.index_add_(0, tok, y.float())
        offset += n
    shared = shared_gate * mlp_torch(x, w.shared_gate_up, w.shared_down)
    return (out + shared.float()).to(x.dtype)


class Layout(NamedTuple):
    """The sorted layout of one call (see the module docstring); every tensor lives on the device."""
    sorted_pairs: torch.Tensor  # [rows] int32: pair t * k + slot per routed row, -1 for pad rows (shared rows unused)
    block_expert: torch.Tensor  # [rows // BLOCK_M] int32: local expert of each block, num_local for the shared one
    inverse: torch.Tensor       # [T * k] int32: row of each pair, -1 if another rank's expert
    total: torch.Tensor         # [1] int32: rows in use; blocks past it exit at once
    rows: int                   # worst-case rows for T (host int, from shapes only)
    block_m: int
    top_k: int


def max_rows(T: int, top_k: int, num_local: int, block_m: int) -> int:
    """Rows the sorted layout may need: the shared rows, every pair, and fewer than block_m pad rows per non-empty
    group (a multiple of block_m, so the bound rounds down)."""
    pairs = T * top_k
    routed = (pairs + min(num_local, pairs) * (block_m - 1)) // block_m * block_m
    return triton.cdiv(T, block_m) * block_m + routed


def _empty_layout(T: int, top_k: int, num_local: int, block_m: int, device: torch.device) -> Layout:
    """A layout's buffers, sized from T alone (max_rows) in one allocation, for a builder's kernels to fill."""
    rows = max_rows(T, top_k, num_local, block_m)
    sizes = [rows, rows // block_m, T * top_k, 1]
    buffers = empty_aligned(sizes, torch.int32, device)  # one allocation
    return Layout(*buffers, rows, block_m, top_k)


def align(ids: torch.Tensor, start: int, num_local: int, block_m: int) -> Layout:
    """The sorted layout for ids [T, k] (global expert ids) on a rank owning experts [start, start + num_local):
    align_serial (one launch) up to ALIGN_SERIAL_MAX_T tokens, align_chunked (three, over all SMs) above."""
    if ids.shape[0] <= ALIGN_SERIAL_MAX_T:
        return align_serial(ids, start, num_local, block_m)
    return align_chunked(ids, start, num_local, block_m)


def align_serial(ids: torch.Tensor, start: int, num_local: int, block_m: int) -> Layout:
    """The layout by one program (_align_kernel): cheapest for few pairs, one SM's serial loops for many."""
    T, k = ids.shape
    layout = _empty_layout(T, k, num_local, block_m, ids.device)
    bins = triton.next_power_of_2(num_local)
    scratch = torch.empty(2 * bins, dtype=torch.int32, device=ids.device)  # counts, then cursors, per local expert
    _align_kernel[(1,)](ids.contiguous(), layout.sorted_pairs, layout.block_expert, layout.inverse, layout.total,
                        scratch, T, start, num_local, TOP_K=k, BLOCK_M=block_m, BINS=bins,
                        CHUNK=min(1024, triton.next_power_of_2(T * k)), NB_CHUNK=16, num_warps=8)
    return layout


def align_chunked(ids: torch.Tensor, start: int, num_local: int, block_m: int, chunk: int | None = None) -> Layout:
    """The layout in three launches over chunks of `chunk` pairs (a power of two; ALIGN_CHUNK by default), equal to
    align_torch's entry for entry (a group's pairs in pair order) and with no atomics:

        _align_count_kernel    a program per chunk: its pairs per local expert -> counts [chunks, bins]
        _align_offsets_kernel  one program: the group offsets, and per (chunk, expert) where the chunk's pairs of
                               that expert start (a scan over the chunks); total, block table, pad rows
        _align_scatter_kernel  a program per chunk: its pairs sorted by (expert, pair); the j-th goes to row
                               offs[e] + base[chunk, e] + j

    The grid and the scratch ([chunks, bins] twice) follow from T alone. Fewer pairs than ALIGN_CHUNK make one
    chunk of their number rounded up to a power of two (at top-8 past ALIGN_SERIAL_MAX_T, ALIGN_CHUNK already)."""
    T, k = ids.shape
    chunk = chunk or min(ALIGN_CHUNK, triton.next_power_of_2(max(16, T * k)))
    layout = _empty_layout(T, k, num_local, block_m, ids.device)
    bins = max(2, triton.next_power_of_2(num_local))  # no scan over a length-1 axis (as in _front_layout)
    chunks = max(1, triton.cdiv(T * k, chunk))
    sizes = [chunks * bins, chunks * bins, bins]
    counts, base, offs = empty_aligned(sizes, torch.int32, ids.device)
    ids = ids.contiguous()
    _align_count_kernel[(chunks,)](ids, counts, T, start, num_local, TOP_K=k, BINS=bins, CHUNK=chunk, num_warps=4)
    _align_offsets_kernel[(1,)](counts, base, offs, layout.sorted_pairs, layout.block_expert, layout.total, T,
                                num_local, TOP_K=k, BLOCK_M=block_m, BINS=bins, CHUNK=chunk,
                                STEP=max(2, 4096 // bins), NB_CHUNK=16, num_warps=8)
    _align_scatter_kernel[(chunks,)](ids, layout.sorted_pairs, layout.inverse, base, offs, T, start, num_local,
                                     TOP_K=k, BINS=bins, CHUNK=chunk, num_warps=4)
    return layout


def align_torch(ids: torch.Tensor, start: int, num_local: int, block_m: int) -> Layout:
    """The sorted layout in torch (the oracle of every builder's): a group's pairs in pair order; blocks past
    `total` and the shared rows' sorted_pairs are -1 (the kernels leave them unwritten)."""
    T, k = ids.shape
    dev = ids.device
    rows = max_rows(T, k, num_local, block_m)
    local = ids.flatten().long() - start
    pairs = ((local >= 0) & (local < num_local)).nonzero().squeeze(1)
    pairs = pairs[torch.argsort(local[pairs], stable=True)]
    experts = local[pairs]
    counts = torch.bincount(experts, minlength=num_local)
    padded = (counts + block_m - 1) // block_m * block_m
    shared_rows = triton.cdiv(T, block_m) * block_m
    offs = torch.cumsum(padded, 0) - padded + shared_rows
    rank = torch.arange(len(pairs), device=dev) - (torch.cumsum(counts, 0) - counts)[experts]
    row = offs[experts] + rank
    sorted_pairs = torch.full((rows,), -1, dtype=torch.int32, device=dev)
    sorted_pairs[row] = pairs.int()
    inverse = torch.full((T * k,), -1, dtype=torch.int32, device=dev)
    inverse[pairs] = row.int()
    block_expert = torch.full((rows // block_m,), -1, dtype=torch.int32, device=dev)
    groups = torch.repeat_interleave(torch.arange(num_local, device=dev), padded // block_m)
    block_expert[: shared_rows // block_m] = num_local
    block_expert[shared_rows // block_m: shared_rows // block_m + len(groups)] = groups.int()
    total = (shared_rows + padded.sum()).int().view(1)
    return Layout(sorted_pairs, block_expert, inverse, total, rows, block_m, k)


def experts_fast(x: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor, shared_gate: torch.Tensor,
                 w: ExpertWeights) -> torch.Tensor:
    """experts_torch with no host sync: align, then the grouped kernels (see the module docstring)."""
    if x.shape[0] == 0:
        return torch.empty_like(x)
    cfg = _block_config(x, w)
    layout = align(ids, w.start, w.gate_up.shape[0], cfg["BLOCK_M"])
    return experts_on_layout(x.contiguous(), w, layout, ids, weights, shared_gate, cfg)


def _block_config(x: torch.Tensor, w: ExpertWeights) -> dict:
    """moe_config for this call's T and this rank's expert shapes."""
    return moe_config(x.shape[0], w.gate_up.shape[0], x.shape[1], w.down.shape[2], w.shared_down.shape[1], x.device)


def experts_on_layout(x: torch.Tensor, w: ExpertWeights, layout: Layout, ids: torch.Tensor, weights: torch.Tensor,
                      shared_gate: torch.Tensor, cfg: dict, down_combine: bool | None = None) -> torch.Tensor:
    """gate_up, then down + combine in one kernel or two: as down_combine forces, else one where the config has a
    down_combine tile (T <= FRONT_MAX_T only)."""
    T = x.shape[0]
    act = gate_up_fast(x, w, layout, cfg["gate_up"])
    if down_combine is None:
        down_combine = T <= FRONT_MAX_T and cfg["down_combine"] is not None
    if down_combine:
        return down_combine_fast(act, w, layout.inverse, ids, weights, shared_gate, cfg["down_combine"])
    return combine_fast(down_fast(act, w, layout, weights, shared_gate, cfg["down"]), layout, T)


def _precision(dtype: torch.dtype) -> str:
    """fp32 models multiply in full fp32 (Triton's default would be tf32); bf16/fp16 operands ignore the setting."""
    return "ieee" if dtype == torch.float32 else "tf32"


def gate_up_fast(x: torch.Tensor, w: ExpertWeights, layout: Layout, tile: dict) -> torch.Tensor:
    """act [rows, max(I, I_s)]: silu(x W_gate^T) * (x W_up^T) for every row of the layout (pad rows 0)."""
    num_local, two_i, H = w.gate_up.shape
    inter, shared_inter = two_i // 2, w.shared_gate_up.shape[0] // 2
    width = max(inter, shared_inter)
    act = torch.empty(layout.rows, width, dtype=x.dtype, device=x.device)
    grid = (layout.rows // layout.block_m, triton.cdiv(width, tile["BLOCK_N"]))
    _gate_up_kernel[grid](x, w.gate_up, w.shared_gate_up, act, layout.sorted_pairs, layout.block_expert,
                          layout.total, x.shape[0], H, inter, shared_inter, num_local, x.stride(0),
                          w.gate_up.stride(0), w.gate_up.stride(1), w.shared_gate_up.stride(0), act.stride(0),
                          TOP_K=layout.top_k, BLOCK_M=layout.block_m,
                          BLOCK_N=tile["BLOCK_N"], BLOCK_K=tile["BLOCK_K"], PRECISION=_precision(x.dtype),
                          num_warps=tile["num_warps"], num_stages=tile["num_stages"])
    return act


def down_fast(act: torch.Tensor, w: ExpertWeights, layout: Layout, weights: torch.Tensor,
              shared_gate: torch.Tensor, tile: dict) -> torch.Tensor:
    """y [rows, H]: (act W_down^T) * routing weight (sigmoid(shared gate) for the shared rows), model dtype."""
    num_local, H, inter = w.down.shape
    T, k = weights.shape
    y = torch.empty(layout.rows, H, dtype=act.dtype, device=act.device)
    # column blocks on axis 0, launched first: the programs of one row block run together and read its act rows
    # from HBM once (row blocks first re-read them once per column block: 511 against 466 us a layer at 8,192
    # tokens, 1x H200, 2026-11-25; 1-3% faster at decode sizes too)
    row_blocks = layout.rows // layout.block_m
    assert row_blocks < 65536, f"{row_blocks} row blocks exceed the grid's axis 1 (fewer tokens per step)"
    grid = (triton.cdiv(H, tile["BLOCK_N"]), row_blocks)
    _down_kernel[grid](act, w.down, w.shared_down, y, layout.sorted_pairs, layout.block_expert, layout.total,
                       weights, shared_gate, T, H, inter, w.shared_down.shape[1], num_local, act.stride(0),
                       w.down.stride(0), w.down.stride(1), w.shared_down.stride(0), y.stride(0), weights.stride(0),
                       shared_gate.stride(0), TOP_K=k, BLOCK_M=layout.block_m, BLOCK_N=tile["BLOCK_N"],
                       BLOCK_K=tile["BLOCK_K"], PRECISION=_precision(act.dtype), num_warps=tile["num_warps"],
                       num_stages=tile["num_stages"])
    return y


def combine_fast(y: torch.Tensor, layout: Layout, T: int) -> torch.Tensor:
    """out [T, H]: each token's routed rows of y in top-k order, then its shared row, summed in fp32."""
    H = y.shape[1]
    out = torch.empty(T, H, dtype=y.dtype, device=y.device)
    block_h = min(1024, triton.next_power_of_2(H))
    _combine_kernel[(T, triton.cdiv(H, block_h))](y, layout.inverse, out, H, y.stride(0), out.stride(0),
                                                  TOP_K=layout.top_k, BLOCK_H=block_h, num_warps=4)
    return out


# ----------------------------------------------------------------------------------------- decode (T <= 64)
# The front kernel measured slower than the three launches it replaces on 1x H200 (2026-11-23, python -m
# benchmarks.bench_moe --tp 1 --decode-only: ~32 us per layer at T = 1..64 against 11.7-18.5 us for router GEMM +
# route + align, all inside CUDA graphs), so decode keeps the router GEMM on cuBLAS, then _route_kernel and
# _align_kernel; down + combine in one kernel did pay at T <= 8 (6.8 against 9.0 us at T = 1).
USE_FRONT = False
FRONT_MAX_T = 64         # decode kernels at or below this many tokens; above, the grouped path
FRONT_BLOCK_T = 16       # tokens per front program (the GEMV tile's M, tl.dot's minimum) and per routing step
ALIGN_SERIAL_MAX_T = FRONT_MAX_T  # align: one program (_align_kernel) at or below, whose serial loops over the
                                  # pairs cost 0.41 ms at T = 8192 (1x H200); the chunked kernels above
ALIGN_CHUNK = 1024       # pairs per program of the chunked layout (untuned): fewer, larger chunks shorten the one
                         # program's scan over [chunks, experts]; more, smaller ones spread the sorts over more SMs
DOWN_COMBINE_TILE = dict(BLOCK_N=8, BLOCK_K=64, num_warps=4, num_stages=4)  # untuned default
DOWN_COMBINE_MAX_T = 8   # untuned default: down + combine in one kernel at or below. Above, re-reading an expert
                         # two tokens share (and the shared expert, T times) costs more than the launch it saves;
                         # how much depends on the rank's shape, so a tuned table decides per bucket (moe_config)
GEMV_TILE = dict(BLOCK_N=4, BLOCK_K=128, num_warps=4, num_stages=4)  # untuned default: 128 programs per token at
                                                                     # I = 512, so one token's experts fill the SMs
# (the H200 table holds tiles for the GEMV path's buckets at TP=1 from a sweep on 2026-11-25: gate_up_gemv 16.5 ->
# 12.1 us at T = 1 and 71.3 -> 67.0 at T = 8, down_combine 6.4 -> 5.6 and 35.9 -> 34.9, in CUDA graphs)
GEMV_MAX_T = 8           # untuned default: the GEMV path at or below (a power of two, as the buckets). Above, each
                         # token streams its experts' gate_up rows itself, where the grouped kernel reads an expert
                         # once for all its tokens; a tuned table decides per bucket (moe_config)


class Front(NamedTuple):
    """What the front step gives: the logits as rounded to the model dtype, the routing and the sorted layout."""
    logits: torch.Tensor       # [T, E + 1] model dtype (router | shared gate)
    ids: torch.Tensor          # [T, k] global expert ids (int32 from the kernel, int64 from torch)
    weights: torch.Tensor      # [T, k] model dtype
    shared_gate: torch.Tensor  # [T, 1] model dtype
    layout: Layout


def front_torch(x: torch.Tensor, router: torch.Tensor, top_k: int, start: int, num_local: int, block_m: int,
                tile: dict | None = None) -> Front:
    """Router GEMM, route_torch and align_torch (tile is the fast kernel's and unused here)."""
    logits = F.linear(x, router)
    ids, weights, shared_gate = route_torch(logits, top_k)
    return Front(logits, ids, weights, shared_gate, align_torch(ids, start, num_local, block_m))


_COUNTERS: dict[torch.device, torch.Tensor] = {}


def _counters(device: torch.device) -> torch.Tensor:
    """Arrival counters of the front kernel (one per token block, then one for all blocks), zero between launches:
    the last program to arrive resets its counter. One per device, shared by every layer (launches on one stream
    run one after another). Made eagerly: an allocation inside a CUDA-graph capture would belong to its pool."""
    counters = _COUNTERS.get(device)
    if counters is None:
        if device.type == "cuda" and torch.cuda.is_current_stream_capturing():
            raise RuntimeError("moe.front_fast: run the layer once eagerly before capturing a CUDA graph")
        counters = _COUNTERS[device] = torch.zeros(FRONT_MAX_T // FRONT_BLOCK_T + 1, dtype=torch.int32,
                                                   device=device)
    return counters


def front_fast(x: torch.Tensor, router: torch.Tensor, top_k: int, start: int, num_local: int, block_m: int,
               tile: dict | None = None) -> Front:
    """front_torch in one launch (x: [T, H], T <= FRONT_MAX_T; router: [E + 1, H]). Grid (column slices of the
    logits, token blocks of FRONT_BLOCK_T). Each program writes its slice of the logits; the last program of a token
    block to finish (an acq_rel integer counter: it sees the others' slices) routes those tokens and counts their
    pairs per local expert; the last of those builds the layout. Counters are reset by the programs that see them
    full, so every launch (eager or graph replay) starts from zero; no float atomics, so the bits never vary."""
    T, H = x.shape
    E = router.shape[0] - 1
    if T > FRONT_MAX_T:
        raise ValueError(f"moe.front_fast takes at most {FRONT_MAX_T} tokens; got {T}")
    if router.shape[1] != H or x.stride(1) != 1 or router.stride(1) != 1:
        raise ValueError(f"moe.front_fast: router {tuple(router.shape)} and x {tuple(x.shape)} must be row-major "
                         f"with the same hidden size")
    tile = _cap(tile or default_config(T)["front"], triton.next_power_of_2(E + 1), triton.next_power_of_2(H))
    logits = torch.empty(T, E + 1, dtype=x.dtype, device=x.device)
    f, counts, rank = _front_outputs(logits, top_k, num_local, block_m)
    if T:
        counters = _counters(x.device)
        block_e, nt = triton.next_power_of_2(E), triton.cdiv(T, FRONT_BLOCK_T)
        grid = (triton.cdiv(E + 1, tile["BLOCK_N"]), nt)
        _front_kernel[grid](x, router, logits, f.ids, f.weights, f.shared_gate, f.layout.sorted_pairs,
                            f.layout.block_expert, f.layout.inverse, f.layout.total, counts, rank, counters,
                            counters[-1:], T, H, E, start, num_local, x.stride(0), router.stride(0), TOP_K=top_k,
                            K_POW2=triton.next_power_of_2(top_k), BLOCK_M=block_m, BLOCK_T=FRONT_BLOCK_T,
                            NT_POW2=triton.next_power_of_2(nt), BLOCK_E=block_e, BLOCK_N=tile["BLOCK_N"],
                            BLOCK_K=tile["BLOCK_K"], PAIR_CHUNK=min(256, triton.next_power_of_2(T * top_k)),
                            NB_CHUNK=triton.cdiv(FRONT_MAX_T, block_m), PRECISION=_precision(x.dtype),
                            num_warps=tile["num_warps"], num_stages=tile["num_stages"])
    return f


def _front_outputs(logits: torch.Tensor, top_k: int, num_local: int, block_m: int):
    """The front step's outputs around `logits` (routing, layout) and its scratch: per token block the pairs per
    expert and each block's first rows (counts [2, blocks, BLOCK_E]), each token's place per expert (rank
    [T, BLOCK_E]). Every int32 buffer in one allocation."""
    T, E = logits.shape[0], logits.shape[1] - 1
    block_e, nt = triton.next_power_of_2(E), triton.cdiv(T, FRONT_BLOCK_T)
    rows = max_rows(T, top_k, num_local, block_m)
    sizes = [T * top_k, rows, rows // block_m, T * top_k, 1, 2 * nt * block_e, T * block_e]
    ids, sorted_pairs, block_expert, inverse, total, counts, rank = empty_aligned(sizes, torch.int32, logits.device)
    weights = torch.empty(T, top_k, dtype=logits.dtype, device=logits.device)
    shared_gate = torch.empty(T, 1, dtype=logits.dtype, device=logits.device)
    layout = Layout(sorted_pairs, block_expert, inverse, total, rows, block_m, top_k)
    return Front(logits, ids.view(T, top_k), weights, shared_gate, layout), counts, rank


def down_combine_torch(act: torch.Tensor, w: ExpertWeights, inverse: torch.Tensor, ids: torch.Tensor,
                       weights: torch.Tensor, shared_gate: torch.Tensor, tile: dict | None = None) -> torch.Tensor:
    """out [T, H]: per token, (act[row] W_down[e]^T) rounded to the model dtype times its routing weight (rounded),
    for its routed rows in top-k order, then the shared row times sigmoid(shared gate), summed in fp32. act [rows,
    max(I, I_s)]: token t's shared row is row t, pair p's row inverse[p] (-1: another rank's expert), as both
    gate_up_fast's layout and the GEMV path's give them; tile is the fast kernel's and unused here."""
    T, k = ids.shape
    inter, shared_inter = w.down.shape[2], w.shared_down.shape[1]
    out = torch.zeros(T, w.down.shape[1], dtype=torch.float32, device=act.device)
    pos = inverse.long().view(T, k)
    for j in range(k):
        mine = (pos[:, j] >= 0).nonzero().squeeze(1)
        expert = ids[mine, j].long() - w.start
        y = torch.bmm(w.down[expert], act[pos[mine, j], :inter].unsqueeze(2)).squeeze(2)
        out[mine] += (y * weights[mine, j:j + 1]).float()
    out += (shared_gate * F.linear(act[:T, :shared_inter], w.shared_down)).float()
    return out.to(act.dtype)


def down_combine_fast(act: torch.Tensor, w: ExpertWeights, inverse: torch.Tensor, ids: torch.Tensor,
                      weights: torch.Tensor, shared_gate: torch.Tensor, tile: dict | None = None) -> torch.Tensor:
    """down_combine_torch in one launch: a program per (token, N tile) reads the k + 1 expert tiles it needs, all
    at once. For few tokens only: an expert two tokens share, and the shared expert, are read once per token."""
    T, k = ids.shape
    num_local, H, inter = w.down.shape
    out = torch.empty(T, H, dtype=act.dtype, device=act.device)
    if T == 0:
        return out
    width = triton.next_power_of_2(max(inter, w.shared_down.shape[1]))
    tile = _cap(tile or DOWN_COMBINE_TILE, triton.next_power_of_2(H), width, least=4)
    _down_combine_kernel[(T, triton.cdiv(H, tile["BLOCK_N"]))](
        act, w.down, w.shared_down, out, ids, inverse, weights, shared_gate, H, inter, w.shared_down.shape[1],
        w.start, act.stride(0), w.down.stride(0), w.down.stride(1), w.shared_down.stride(0), out.stride(0),
        ids.stride(0), weights.stride(0), shared_gate.stride(0), TOP_K=k, K_POW2=triton.next_power_of_2(k),
        BLOCK_N=tile["BLOCK_N"], BLOCK_K=tile["BLOCK_K"], NUM_STAGES=tile["num_stages"], num_warps=tile["num_warps"])
    return out


class GemvAct(NamedTuple):
    """What the GEMV path's gate_up step gives: the routing and act, laid out per token (no sorted layout)."""
    act: torch.Tensor          # [T * (k + 1), max(I, I_s)]: shared rows [0, T), pair p = t * k + slot at row T + p
    ids: torch.Tensor          # [T, k] global expert ids (int32 from the kernel, int64 from torch)
    weights: torch.Tensor      # [T, k] model dtype
    shared_gate: torch.Tensor  # [T, 1] model dtype
    inverse: torch.Tensor      # [T * k] int32: row of each pair, -1 if another rank's expert (its row unwritten)


def _silu_mul_torch(h: torch.Tensor) -> torch.Tensor:
    """silu(gate half) * up half, rounded as mlp_torch rounds (after silu, after the product)."""
    gate, up = h.chunk(2, dim=-1)
    return F.silu(gate) * up


def gate_up_gemv_torch(x: torch.Tensor, logits: torch.Tensor, top_k: int, w: ExpertWeights,
                       tile: dict | None = None) -> GemvAct:
    """route_torch, then silu(x W_gate^T) * (x W_up^T) in the model dtype for every local pair and the shared
    expert, in GemvAct's rows (other ranks' rows 0 here). tile is the fast kernel's and unused here."""
    T = x.shape[0]
    ids, weights, shared_gate = route_torch(logits, top_k)
    num_local, two_i, _ = w.gate_up.shape
    inter, shared_inter = two_i // 2, w.shared_gate_up.shape[0] // 2
    local = ids - w.start
    mine = (local >= 0) & (local < num_local)
    rows = T + torch.arange(T * top_k, device=x.device).view(T, top_k)
    act = torch.zeros(T * (top_k + 1), max(inter, shared_inter), dtype=x.dtype, device=x.device)
    act[:T, :shared_inter] = _silu_mul_torch(F.linear(x, w.shared_gate_up))
    tok, slot = mine.nonzero(as_tuple=True)
    h = torch.bmm(w.gate_up[local[tok, slot]], x[tok].unsqueeze(2)).squeeze(2)
    act[rows[tok, slot], :inter] = _silu_mul_torch(h)
    return GemvAct(act, ids, weights, shared_gate, torch.where(mine, rows, -1).flatten().int())


def gate_up_gemv_fast(x: torch.Tensor, logits: torch.Tensor, top_k: int, w: ExpertWeights,
                      tile: dict | None = None) -> GemvAct:
    """gate_up_gemv_torch in one launch, a program per (token, N tile of max(I, I_s)): each routes its token
    (route_fast's kernel code, so the same bits) and streams that token's local experts' and the shared expert's
    gate|up rows. x [T, H] and logits [T, E + 1] with unit column stride."""
    T, H = x.shape
    E = logits.shape[1] - 1
    num_local, two_i, _ = w.gate_up.shape
    inter, shared_inter = two_i // 2, w.shared_gate_up.shape[0] // 2
    width = max(inter, shared_inter)
    ids, inverse = torch.empty(2, T, top_k, dtype=torch.int32, device=x.device)  # one allocation
    weights = torch.empty(T, top_k, dtype=logits.dtype, device=x.device)
    shared_gate = torch.empty(T, 1, dtype=logits.dtype, device=x.device)
    act = torch.empty(T * (top_k + 1), width, dtype=x.dtype, device=x.device)
    if T:
        tile = _cap(tile or GEMV_TILE, triton.next_power_of_2(width), triton.next_power_of_2(H), least=2)
        _gate_up_gemv_kernel[(T, triton.cdiv(width, tile["BLOCK_N"]))](
            x, logits, w.gate_up, w.shared_gate_up, act, ids, inverse, weights, shared_gate, T, H, E, inter,
            shared_inter, w.start, num_local, x.stride(0), logits.stride(0), w.gate_up.stride(0),
            w.gate_up.stride(1), w.shared_gate_up.stride(0), act.stride(0), TOP_K=top_k,
            K_POW2=triton.next_power_of_2(top_k), BLOCK_E=triton.next_power_of_2(E), BLOCK_N=tile["BLOCK_N"],
            BLOCK_K=tile["BLOCK_K"], NUM_STAGES=tile["num_stages"], num_warps=tile["num_warps"])
    return GemvAct(act, ids, weights, shared_gate, inverse.view(-1))


# -------------------------------------------------------------------------------------------------- the block
def moe_torch(x: torch.Tensor, router: torch.Tensor, top_k: int, w: ExpertWeights) -> torch.Tensor:
    """The block's oracle: router GEMM (model dtype, as the reference rounds the logits), route_torch, experts_torch."""
    return experts_torch(x, *route_torch(F.linear(x, router), top_k), w)


def moe_fast(x: torch.Tensor, router: torch.Tensor, top_k: int, w: ExpertWeights) -> torch.Tensor:
    """moe_torch without host syncs: the decode path up to FRONT_MAX_T tokens, else the router GEMM, route_fast and
    experts_fast (the chunked layout and the grouped kernels)."""
    if x.shape[0] <= FRONT_MAX_T:
        return moe_decode_fast(x, router, top_k, w)
    x = computed(x)
    return experts_fast(x, *route_fast(router_logits(x, router), top_k), w)


def moe_decode_fast(x: torch.Tensor, router: torch.Tensor, top_k: int, w: ExpertWeights,
                    down_combine: bool | None = None, front: bool | None = None,
                    gemv: bool | None = None) -> torch.Tensor:
    """The GEMV path (gemv; by default where the config has a gemv tile): router GEMM, gate_up_gemv_fast,
    down_combine_fast. Else routing and layout by the front kernel (front, default USE_FRONT) or by the router GEMM,
    route_fast and align; then experts_on_layout, down + combine as down_combine forces or the config says
    (benchmarks/bench_moe.py times every choice)."""
    if x.shape[0] == 0:
        return torch.empty_like(computed(x))
    num_local = w.gate_up.shape[0]
    cfg = _block_config(x, w)
    if cfg["gemv"] is not None if gemv is None else gemv:
        logits = router_logits_fast(x, router)  # first: its GEMV computes a PendingNorm x, which gate_up reads
        g = gate_up_gemv_fast(computed(x).contiguous(), logits, top_k, w, cfg["gemv"])
        return down_combine_fast(g.act, w, g.inverse, g.ids, g.weights, g.shared_gate, cfg["down_combine"])
    x = computed(x).contiguous()
    if (USE_FRONT if front is None else front):
        f = front_fast(x, router, top_k, w.start, num_local, cfg["BLOCK_M"], cfg["front"])
        return experts_on_layout(x, w, f.layout, f.ids, f.weights, f.shared_gate, cfg, down_combine)
    ids, weights, shared_gate = route_fast(router_logits_fast(x, router), top_k)
    layout = align(ids, w.start, num_local, cfg["BLOCK_M"])
    return experts_on_layout(x, w, layout, ids, weights, shared_gate, cfg, down_combine)


# ------------------------------------------------------------------------------------------------- tile configs
def _pow2_bucket(T: int) -> int:
    """Configs are keyed by T rounded up to a power of two: a decode batch padded for a CUDA graph (qwen35/
    cuda_graphs.py pads to 1, 2, 4, 8 or a multiple of 8, never past the next power of two) gets the same tiles as
    the same batch run eagerly, so both give identical outputs."""
    return triton.next_power_of_2(max(1, T))


def config_key(num_local: int, hidden: int, inter: int) -> str:
    return f"E{num_local}_H{hidden}_I{inter}"


@functools.lru_cache(maxsize=None)
def _table(device_index: int) -> dict:
    """The tuned configs for this GPU model (benchmarks/tune_moe.py writes them), {} when there are none."""
    try:
        with open(CONFIG_FILE) as f:
            return json.load(f).get(torch.cuda.get_device_name(device_index), {})
    except FileNotFoundError:
        return {}


def default_config(T: int) -> dict:
    """Tiles when the table has no entry. Decode (few rows per expert): BLOCK_M 16, one row block per expert, so
    each weight tile is read once; narrow N tiles so that the few active experts still spread over all SMs.
    Prefill: larger tiles that reuse each weight tile over many rows. front (router columns per program, H step),
    down_combine (its tile, or None: down and combine in two kernels) and gemv (gate_up_gemv_fast's tile, or None:
    the sorted layout's path) serve T <= FRONT_MAX_T only; tables tuned before them lack the keys."""
    small = {"front": dict(BLOCK_N=16, BLOCK_K=128, num_warps=4, num_stages=3),
             "down_combine": DOWN_COMBINE_TILE if T <= DOWN_COMBINE_MAX_T else None,
             "gemv": GEMV_TILE if T <= GEMV_MAX_T else None}
    if T <= 128:
        return {"BLOCK_M": 16, "gate_up": dict(BLOCK_N=32, BLOCK_K=128, num_warps=4, num_stages=4),
                "down": dict(BLOCK_N=64, BLOCK_K=128, num_warps=4, num_stages=4), **small}
    block_m = 32 if T <= 1024 else 64
    return {"BLOCK_M": block_m, "gate_up": dict(BLOCK_N=64, BLOCK_K=64, num_warps=4, num_stages=3),
            "down": dict(BLOCK_N=128, BLOCK_K=64, num_warps=8, num_stages=3), **small}


def moe_config(T: int, num_local: int, hidden: int, inter: int, shared_inter: int, device: torch.device) -> dict:
    """Tiles for T tokens: the table's entry for the smallest tuned bucket >= T's bucket (else the largest), else
    default_config; N/K tiles capped at the (power-of-two rounded) matrix sizes so that tiny models work too
    (front_fast, down_combine_fast and gate_up_gemv_fast cap their own tiles: they know their GEMVs' sizes)."""
    cfg = default_config(T)
    if device.type == "cuda":
        entries = _table(device.index if device.index is not None else torch.cuda.current_device()).get(
            config_key(num_local, hidden, inter), {})
        if entries:
            buckets = sorted(int(b) for b in entries)
            bucket = next((b for b in buckets if b >= _pow2_bucket(T)), buckets[-1])
            cfg = {**cfg, **entries[str(bucket)]}
    width = triton.next_power_of_2(max(inter, shared_inter))
    return {"BLOCK_M": cfg["BLOCK_M"],
            "gate_up": _cap(cfg["gate_up"], width, triton.next_power_of_2(hidden)),
            "down": _cap(cfg["down"], triton.next_power_of_2(hidden), width),
            "front": cfg["front"], "down_combine": cfg["down_combine"], "gemv": cfg["gemv"]}


def _cap(tile: dict, n: int, k: int, least: int = 16) -> dict:
    """N and K tiles no larger than the (power-of-two) matrix, no smaller than tl.dot's 16 (a GEMV's: least)."""
    return dict(tile, BLOCK_N=max(least, min(tile["BLOCK_N"], n)), BLOCK_K=max(least, min(tile["BLOCK_K"], k)))


# ------------------------------------------------------------------------------------------------ Triton kernels
if triton is not None:
    @triton.jit
    def _route_kernel(logits_ptr, ids_ptr, w_ptr, sg_ptr, E, sl, TOP_K: tl.constexpr, K_POW2: tl.constexpr,
                      BLOCK_E: tl.constexpr):
        """One token's routing (_route_token)."""
        _route_token(logits_ptr, ids_ptr, w_ptr, sg_ptr, tl.program_id(0).to(tl.int64), E, sl, True, TOP_K, K_POW2,
                     BLOCK_E)

    @triton.jit
    def _route_token(logits_ptr, ids_ptr, w_ptr, sg_ptr, t, E, sl, store, TOP_K: tl.constexpr,
                     K_POW2: tl.constexpr, BLOCK_E: tl.constexpr):
        """route_torch for token t (its logits row sl apart), the one implementation of route_fast's and of the GEMV
        path's routing: softmax in fp32, top-k on int64 keys (the probability's bits, then the column reversed: one
        max per slot takes the largest probability, among ties the lowest id), renormalised, rounded to the model
        dtype; sigmoid of the shared gate's logit (column E). Sums by _exact_sum, so every kernel that calls this
        gives the same bits whatever its warps. Stored where `store`; returns the ids [K_POW2] (slots past TOP_K:
        0)."""
        cols = tl.arange(0, BLOCK_E)
        row = logits_ptr + t * sl
        logit = tl.load(row + cols, mask=cols < E, other=float("-inf")).to(tl.float32)
        num = tl.exp(logit - tl.max(logit, 0))
        p = num / _exact_sum(num)
        key = (p.to(tl.int32, bitcast=True).to(tl.int64) << 32) | (BLOCK_E - 1 - cols).to(tl.int64)
        key = tl.where(cols < E, key, -1)  # below every probability's key
        slot = tl.arange(0, K_POW2)
        ids = tl.zeros([K_POW2], dtype=tl.int32)
        vals = tl.zeros([K_POW2], dtype=tl.float32)
        for j in tl.static_range(TOP_K):
            best = tl.max(key, 0)
            key = tl.where(key == best, -1, key)
            ids = tl.where(slot == j, (BLOCK_E - 1 - (best & (BLOCK_E - 1))).to(tl.int32), ids)
            vals = tl.where(slot == j, (best >> 32).to(tl.int32).to(tl.float32, bitcast=True), vals)
        smask = slot < tl.where(store, TOP_K, 0)
        tl.store(ids_ptr + t * TOP_K + slot, ids, mask=smask)
        tl.store(w_ptr + t * TOP_K + slot, (vals / _exact_sum(vals)).to(w_ptr.dtype.element_ty), mask=smask)
        g = tl.load(row + E).to(tl.float32)
        tl.store(sg_ptr + t, tl.sigmoid(g).to(sg_ptr.dtype.element_ty), mask=store)
        return ids

    @triton.jit
    def _exact_sum(v):
        """Sum of a vector of values in [0, 1], in 2^-48 fixed point: integer adds give the same bits in any reduction
        order (a float tl.sum's tree follows the layout, so the kernel's num_warps). The sum stays below 2^63 for
        fewer than 2^15 values; dropping what lies below 2^-48 moves a sum >= 2^-8 by < 2^-24 relative while it
        holds fewer than 2^16 values (softmax denominators are >= 1, top-k sums >= k / E)."""
        return tl.sum((v * 281474976710656.0).to(tl.int64), 0).to(tl.float32) * (1.0 / 281474976710656.0)

    @triton.jit
    def _local_expert(ids_ptr, p, n, start, num_local):
        """(local expert, mine) of pairs p: mine is False past n and for other ranks' experts (expert then 0)."""
        e = tl.load(ids_ptr + p, mask=p < n, other=-1).to(tl.int32) - start
        mine = (p < n) & (e >= 0) & (e < num_local)
        return tl.where(mine, e, 0), mine

    @triton.jit(do_not_specialize=["T"])  # one compile for every batch size
    def _align_kernel(ids_ptr, sorted_ptr, block_expert_ptr, inv_ptr, total_ptr, scratch_ptr, T, start, num_local,
                      TOP_K: tl.constexpr, BLOCK_M: tl.constexpr, BINS: tl.constexpr, CHUNK: tl.constexpr,
                      NB_CHUNK: tl.constexpr):
        """One program. Counts per local expert (integer atomics), padded group offsets after the shared rows,
        then a row per pair from per-expert cursors; the block table and pad rows; the number of rows in use.
        Scratch is read back with volatile loads (past L1), after a barrier."""
        n = T * TOP_K
        bins = tl.arange(0, BINS)
        tl.store(scratch_ptr + bins, tl.zeros([BINS], dtype=tl.int32))
        tl.debug_barrier()
        for c0 in range(0, n, CHUNK):
            e, mine = _local_expert(ids_ptr, c0 + tl.arange(0, CHUNK), n, start, num_local)
            tl.atomic_add(scratch_ptr + e, 1, mask=mine)
        tl.debug_barrier()
        counts = tl.load(scratch_ptr + bins, volatile=True)
        padded = (counts + BLOCK_M - 1) // BLOCK_M * BLOCK_M
        shared_rows = (T + BLOCK_M - 1) // BLOCK_M * BLOCK_M
        offs = tl.cumsum(padded, 0) - padded + shared_rows
        tl.store(scratch_ptr + BINS + bins, offs)
        tl.debug_barrier()
        for c0 in range(0, n, CHUNK):
            p = c0 + tl.arange(0, CHUNK)
            e, mine = _local_expert(ids_ptr, p, n, start, num_local)
            pos = tl.atomic_add(scratch_ptr + BINS + e, 1, mask=mine)
            tl.store(sorted_ptr + pos, p, mask=mine)
            tl.store(inv_ptr + p, tl.where(mine, pos, -1), mask=p < n)
        _layout_tail(sorted_ptr, block_expert_ptr, total_ptr, counts, padded, offs, bins, T, num_local, BLOCK_M,
                     NB_CHUNK)

    @triton.jit(do_not_specialize=["T"])  # one compile for every batch size
    def _align_count_kernel(ids_ptr, counts_ptr, T, start, num_local, TOP_K: tl.constexpr, BINS: tl.constexpr,
                            CHUNK: tl.constexpr):
        """counts[c, e]: pairs of chunk c on local expert e (a histogram in registers: no atomics, no zeroing)."""
        c = tl.program_id(0)
        e, mine = _local_expert(ids_ptr, c * CHUNK + tl.arange(0, CHUNK), T * TOP_K, start, num_local)
        tl.store(counts_ptr + c * BINS + tl.arange(0, BINS), tl.histogram(e, BINS, mask=mine))

    @triton.jit(do_not_specialize=["T"])  # one compile for every batch size
    def _align_offsets_kernel(counts_ptr, base_ptr, offs_ptr, sorted_ptr, block_expert_ptr, total_ptr, T, num_local,
                              TOP_K: tl.constexpr, BLOCK_M: tl.constexpr, BINS: tl.constexpr, CHUNK: tl.constexpr,
                              STEP: tl.constexpr, NB_CHUNK: tl.constexpr):
        """One program, STEP chunks at a time: base[c, e] = (e's pairs in chunks before c) - (chunk c's pairs on
        experts below e), so that the chunk's j-th pair in (expert, pair) order, of expert e, belongs at row
        offs[e] + base[c, e] + j. Then the group offsets (as _align_kernel's) and the rest of the layout."""
        chunks = tl.cdiv(T * TOP_K, CHUNK)
        bins = tl.arange(0, BINS)
        seen = tl.zeros([BINS], dtype=tl.int32)  # pairs per expert in the chunks done
        for c0 in range(0, chunks, STEP):
            c = c0 + tl.arange(0, STEP)[:, None]
            cell = c * BINS + bins[None, :]
            cnt = tl.load(counts_ptr + cell, mask=c < chunks, other=0)
            before = seen[None, :] + tl.cumsum(cnt, 0) - cnt
            below = tl.cumsum(cnt, 1) - cnt
            tl.store(base_ptr + cell, before - below, mask=c < chunks)
            seen += tl.sum(cnt, 0)
        padded = (seen + BLOCK_M - 1) // BLOCK_M * BLOCK_M
        offs = tl.cumsum(padded, 0) - padded + (T + BLOCK_M - 1) // BLOCK_M * BLOCK_M
        tl.store(offs_ptr + bins, offs)
        _layout_tail(sorted_ptr, block_expert_ptr, total_ptr, seen, padded, offs, bins, T, num_local, BLOCK_M,
                     NB_CHUNK)

    @triton.jit(do_not_specialize=["T"])  # one compile for every batch size
    def _align_scatter_kernel(ids_ptr, sorted_ptr, inv_ptr, base_ptr, offs_ptr, T, start, num_local,
                              TOP_K: tl.constexpr, BINS: tl.constexpr, CHUNK: tl.constexpr):
        """Chunk c's pairs placed: sorted by the key (expert, place in the chunk), other ranks' pairs last (expert
        BINS), the j-th local one goes to row offs[e] + base[c, e] + j (see _align_offsets_kernel)."""
        c = tl.program_id(0)
        j = tl.arange(0, CHUNK)
        p = c * CHUNK + j
        e, mine = _local_expert(ids_ptr, p, T * TOP_K, start, num_local)
        tl.store(inv_ptr + p, tl.full([CHUNK], -1, tl.int32), mask=(p < T * TOP_K) & ~mine)
        key = tl.sort(tl.where(mine, e, BINS) * CHUNK + j)
        e, p = key // CHUNK, c * CHUNK + key % CHUNK
        mine = e < BINS
        row = tl.load(offs_ptr + e, mask=mine, other=0) + tl.load(base_ptr + c * BINS + e, mask=mine, other=0) + j
        tl.store(sorted_ptr + row, p, mask=mine)
        tl.store(inv_ptr + p, row, mask=mine)

    @triton.jit
    def _layout_tail(sorted_ptr, block_expert_ptr, total_ptr, counts, padded, offs, experts, T, num_local,
                     BLOCK_M: tl.constexpr, NB_CHUNK: tl.constexpr):
        """The rest of a layout once the routed rows are placed, from per-bin vectors (pairs, padded size, first
        row, local expert; a bin outside this rank has no pairs): the rows in use, the block table (the shared
        expert's blocks, then each group's padded / BLOCK_M blocks) and the pad rows (-1)."""
        shared_rows = (T + BLOCK_M - 1) // BLOCK_M * BLOCK_M
        tl.store(total_ptr, shared_rows + tl.sum(padded, 0))
        for b0 in range(0, shared_rows // BLOCK_M, NB_CHUNK):
            b = b0 + tl.arange(0, NB_CHUNK)
            tl.store(block_expert_ptr + b, tl.zeros([NB_CHUNK], dtype=tl.int32) + num_local,
                     mask=b < shared_rows // BLOCK_M)
        first, nblocks = offs // BLOCK_M, padded // BLOCK_M
        for j0 in range(0, tl.max(nblocks, 0), NB_CHUNK):
            j = j0 + tl.arange(0, NB_CHUNK)
            tl.store(block_expert_ptr + first[:, None] + j[None, :],
                     experts[:, None] + tl.zeros([NB_CHUNK], dtype=tl.int32)[None, :],
                     mask=j[None, :] < nblocks[:, None])
        pad = (offs + counts)[:, None] + tl.arange(0, BLOCK_M)[None, :]
        tl.store(sorted_ptr + pad, tl.zeros_like(pad) - 1, mask=pad < (offs + padded)[:, None])

    @triton.jit(do_not_specialize=["T"])  # one compile for every batch size (and NT_POW2: 1, 2 or 4 ones)
    def _front_kernel(x_ptr, r_ptr, logits_ptr, ids_ptr, rw_ptr, sg_ptr, sorted_ptr, block_expert_ptr, inv_ptr,
                      total_ptr, counts_ptr, rank_ptr, block_counter_ptr, all_counter_ptr, T, H, E, start, num_local,
                      sx, sr, TOP_K: tl.constexpr, K_POW2: tl.constexpr, BLOCK_M: tl.constexpr,
                      BLOCK_T: tl.constexpr, NT_POW2: tl.constexpr, BLOCK_E: tl.constexpr, BLOCK_N: tl.constexpr,
                      BLOCK_K: tl.constexpr, PAIR_CHUNK: tl.constexpr, NB_CHUNK: tl.constexpr,
                      PRECISION: tl.constexpr):
        """Program (column slice n, token block b). Three phases, each run by the last program to finish the one
        before: 1. every program: logits[b, n] = x W_router^T (fp32 accumulation, rounded to the model dtype);
        2. the last program of block b: route its tokens; 3. the last of those: the layout. A program signals with
        an acq_rel atomic after a barrier (every thread's stores first); the one that sees the count full resets
        it and reads the others' results with volatile loads (from L2, past its own L1)."""
        pid_n, pid_b = tl.program_id(0), tl.program_id(1)
        toks = pid_b * BLOCK_T + tl.arange(0, BLOCK_T)
        cols = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
        ks = tl.arange(0, BLOCK_K)
        tmask, cmask = toks < T, cols < E + 1
        xp = x_ptr + toks.to(tl.int64)[:, None] * sx + ks[None, :]
        wp = r_ptr + cols.to(tl.int64)[None, :] * sr + ks[:, None]
        acc = tl.zeros([BLOCK_T, BLOCK_N], dtype=tl.float32)
        for k0 in range(0, H, BLOCK_K):
            kmask = k0 + ks < H
            a = tl.load(xp + k0, mask=tmask[:, None] & kmask[None, :], other=0.0)
            acc = tl.dot(a, tl.load(wp + k0, mask=kmask[:, None] & cmask[None, :], other=0.0), acc,
                         input_precision=PRECISION)
        tl.store(logits_ptr + toks.to(tl.int64)[:, None] * (E + 1) + cols[None, :],
                 acc.to(logits_ptr.dtype.element_ty), mask=tmask[:, None] & cmask[None, :])
        tl.debug_barrier()
        if tl.atomic_add(block_counter_ptr + pid_b, 1, sem="acq_rel", scope="gpu") != tl.num_programs(0) - 1:
            return
        tl.store(block_counter_ptr + pid_b, 0)  # for the next launch
        _route_block(logits_ptr, ids_ptr, rw_ptr, sg_ptr, counts_ptr, rank_ptr, pid_b, T, E, E + 1, start,
                     num_local, TOP_K, K_POW2, BLOCK_T, BLOCK_E)
        tl.debug_barrier()
        if tl.atomic_add(all_counter_ptr, 1, sem="acq_rel", scope="gpu") != tl.num_programs(1) - 1:
            return
        tl.store(all_counter_ptr, 0)
        _front_layout(ids_ptr, sorted_ptr, block_expert_ptr, inv_ptr, total_ptr, counts_ptr, rank_ptr, T, start,
                      num_local, tl.num_programs(1), TOP_K, BLOCK_M, BLOCK_T, NT_POW2, BLOCK_E, PAIR_CHUNK, NB_CHUNK)

    @triton.jit
    def _route_block(logits_ptr, ids_ptr, rw_ptr, sg_ptr, counts_ptr, rank_ptr, b, T, E, sl, start, num_local,
                     TOP_K: tl.constexpr, K_POW2: tl.constexpr, BLOCK_T: tl.constexpr, BLOCK_E: tl.constexpr):
        """_route_kernel's routing for the tokens of block b, a row each (logits' rows sl apart). Top-k on int64
        keys (probability bits, then the column reversed: one max per slot takes the largest probability, among ties
        the lowest id). Then, for this rank's experts: counts[b, e] = the block's pairs on e, rank[t, e] = token t's place among
        them (a cumsum over the block's rows, so pairs keep their order)."""
        rows = b * BLOCK_T + tl.arange(0, BLOCK_T)
        rmask = rows < T
        cols = tl.arange(0, BLOCK_E)
        emask = cols < E
        lp = logits_ptr + rows.to(tl.int64) * sl
        logit = tl.load(lp[:, None] + cols[None, :], mask=rmask[:, None] & emask[None, :], other=float("-inf"),
                        volatile=True).to(tl.float32)
        logit = tl.where(rmask[:, None], logit, 0.0)  # rows past T: finite, never stored
        num = tl.exp(logit - tl.max(logit, 1)[:, None])
        p = num / tl.sum(num, 1)[:, None]
        key = (p.to(tl.int32, bitcast=True).to(tl.int64) << 32) | (BLOCK_E - 1 - cols).to(tl.int64)[None, :]
        key = tl.where(emask[None, :], key, -1)
        slot = tl.arange(0, K_POW2)[None, :]
        ids = tl.zeros([BLOCK_T, K_POW2], dtype=tl.int32)
        vals = tl.zeros([BLOCK_T, K_POW2], dtype=tl.float32)
        for j in tl.static_range(TOP_K):
            best = tl.max(key, 1)
            key = tl.where(key == best[:, None], -1, key)  # taken: -1, as the columns past E
            ids = tl.where(slot == j, (BLOCK_E - 1 - (best & (BLOCK_E - 1))).to(tl.int32)[:, None], ids)
            vals = tl.where(slot == j, (best >> 32).to(tl.int32).to(tl.float32, bitcast=True)[:, None], vals)
        w = vals / tl.sum(vals, 1)[:, None]
        out = rows.to(tl.int64)[:, None] * TOP_K + slot
        smask = rmask[:, None] & (slot < TOP_K)
        tl.store(ids_ptr + out, ids, mask=smask)
        tl.store(rw_ptr + out, w.to(rw_ptr.dtype.element_ty), mask=smask)
        g = tl.load(lp + E, mask=rmask, other=0.0, volatile=True).to(tl.float32)
        tl.store(sg_ptr + rows, tl.sigmoid(g).to(sg_ptr.dtype.element_ty), mask=rmask)
        local = emask & (cols >= start) & (cols < start + num_local)
        mine = (rmask[:, None] & local[None, :] & (key == -1)).to(tl.int32)
        tl.store(counts_ptr + b * BLOCK_E + cols, tl.sum(mine, 0))
        tl.store(rank_ptr + rows.to(tl.int64)[:, None] * BLOCK_E + cols[None, :], tl.cumsum(mine, 0) - mine,
                 mask=mine > 0)

    @triton.jit
    def _front_layout(ids_ptr, sorted_ptr, block_expert_ptr, inv_ptr, total_ptr, counts_ptr, rank_ptr, T, start,
                      num_local, NT, TOP_K: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_T: tl.constexpr,
                      NT_POW2: tl.constexpr, BLOCK_E: tl.constexpr, PAIR_CHUNK: tl.constexpr,
                      NB_CHUNK: tl.constexpr):
        """The sorted layout from the NT token blocks' counts (bins: global expert ids): group offsets as in
        _align_kernel, then pair p (token t, expert e) at row offs[e] + (e's pairs in earlier blocks) + rank[t, e].
        A group holds its pairs in pair order, the same on every run (align_torch's layout exactly)."""
        cols = tl.arange(0, BLOCK_E)
        blk = tl.arange(0, NT_POW2)[:, None]
        cell = blk * BLOCK_E + cols[None, :]
        per_block = tl.load(counts_ptr + cell, mask=blk < NT, other=0, volatile=True)
        counts = tl.sum(per_block, 0)
        padded = (counts + BLOCK_M - 1) // BLOCK_M * BLOCK_M
        offs = tl.cumsum(padded, 0) - padded + (T + BLOCK_M - 1) // BLOCK_M * BLOCK_M
        if NT_POW2 == 1:  # no scan over a length-1 axis
            before = tl.zeros_like(per_block)
        else:
            before = tl.cumsum(per_block, 0) - per_block
        base_ptr = counts_ptr + NT * BLOCK_E  # first row of each (block, expert): the second half of the scratch
        tl.store(base_ptr + cell, offs[None, :] + before, mask=blk < NT)
        tl.debug_barrier()
        n = T * TOP_K
        for p0 in range(0, n, PAIR_CHUNK):
            p = p0 + tl.arange(0, PAIR_CHUNK)
            e = tl.load(ids_ptr + p, mask=p < n, other=-1, volatile=True)
            mine = (p < n) & (e >= start) & (e < start + num_local)
            e = tl.where(mine, e, 0)
            t = p // TOP_K
            row = tl.load(base_ptr + (t // BLOCK_T) * BLOCK_E + e, mask=mine, other=0, volatile=True) + \
                tl.load(rank_ptr + t.to(tl.int64) * BLOCK_E + e, mask=mine, other=0, volatile=True)
            tl.store(sorted_ptr + row, p, mask=mine)
            tl.store(inv_ptr + p, tl.where(mine, row, -1), mask=p < n)
        _layout_tail(sorted_ptr, block_expert_ptr, total_ptr, counts, padded, offs, cols - start, T, num_local,
                     BLOCK_M, NB_CHUNK)

    @triton.jit(do_not_specialize=["T"])  # one compile for every batch size
    def _gate_up_kernel(x_ptr, w_ptr, sw_ptr, act_ptr, sorted_ptr, block_expert_ptr, total_ptr, T, H, I, I_s,
                        num_local, sx, swe, swn, sswn, sa, TOP_K: tl.constexpr, BLOCK_M: tl.constexpr,
                        BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, PRECISION: tl.constexpr):
        """Columns [n, n + BLOCK_N) of silu(x W_gate^T) * (x W_up^T) for one block of rows of one expert; gate and
        up of those columns are rows n.. and n + inter.. of the expert's [2 inter, H] weight."""
        pid_m, pid_n = tl.program_id(0), tl.program_id(1)
        e = tl.load(block_expert_ptr + pid_m)
        shared = e == num_local
        inter = tl.where(shared, I_s, I)
        if (pid_m * BLOCK_M >= tl.load(total_ptr)) | (pid_n * BLOCK_N >= inter):
            return
        rows = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
        if shared:
            tok = rows
            valid = rows < T
            w = sw_ptr
            wn = sswn
        else:
            pair = tl.load(sorted_ptr + rows)
            tok = pair // TOP_K
            valid = pair >= 0
            w = w_ptr + e.to(tl.int64) * swe
            wn = swn
        cols = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
        cmask = cols < inter
        ks = tl.arange(0, BLOCK_K)
        xp = x_ptr + tok.to(tl.int64)[:, None] * sx + ks[None, :]
        gp = w + cols.to(tl.int64)[None, :] * wn + ks[:, None]
        up = gp + inter.to(tl.int64) * wn
        acc_g = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
        acc_u = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
        for k0 in range(0, H, BLOCK_K):
            kmask = k0 + ks < H
            a = tl.load(xp + k0, mask=valid[:, None] & kmask[None, :], other=0.0)
            wmask = kmask[:, None] & cmask[None, :]
            acc_g = tl.dot(a, tl.load(gp + k0, mask=wmask, other=0.0), acc_g, input_precision=PRECISION)
            acc_u = tl.dot(a, tl.load(up + k0, mask=wmask, other=0.0), acc_u, input_precision=PRECISION)
        out = _silu_mul(acc_g, acc_u, act_ptr.dtype.element_ty)  # pad rows: silu(0) * 0 = 0
        tl.store(act_ptr + rows.to(tl.int64)[:, None] * sa + cols[None, :], out, mask=cmask[None, :])

    @triton.jit
    def _silu_mul(acc_g, acc_u, DTYPE: tl.constexpr):
        """silu(gate) * up in DTYPE from fp32 sums, rounded where the oracle rounds: the GEMM outputs, silu, the
        product."""
        g = round_to(acc_g, DTYPE)
        s = round_to(g * tl.sigmoid(g), DTYPE)
        return (s * round_to(acc_u, DTYPE)).to(DTYPE)

    @triton.jit(do_not_specialize=["T"])  # one compile for every batch size
    def _gate_up_gemv_kernel(x_ptr, logits_ptr, w_ptr, sw_ptr, act_ptr, ids_ptr, inv_ptr, rw_ptr, sg_ptr, T, H, E, I,
                             I_s, start, num_local, sx, sl, swe, swn, sswn, sa, TOP_K: tl.constexpr,
                             K_POW2: tl.constexpr, BLOCK_E: tl.constexpr, BLOCK_N: tl.constexpr,
                             BLOCK_K: tl.constexpr, NUM_STAGES: tl.constexpr):
        """Program (token t, N tile): t's routing (_route_token; every program routes, the pid_n == 0 one stores it
        and each pair's act row for the down step), then columns [n, n + BLOCK_N) of silu(x W_gate^T) * (x W_up^T)
        of its local slots as one [K_POW2, BLOCK_N, BLOCK_K] tile per H step (gate and up halves) and of the shared
        expert as another, in one loop that Triton software-pipelines (as _down_combine_kernel). Other ranks'
        slots are masked: they read and write nothing. Rows: shared t, pair p = t * TOP_K + slot at T + p."""
        t = tl.program_id(0).to(tl.int64)
        pid_n = tl.program_id(1)
        ids = _route_token(logits_ptr, ids_ptr, rw_ptr, sg_ptr, t, E, sl, pid_n == 0, TOP_K, K_POW2, BLOCK_E)
        s = tl.arange(0, K_POW2)
        e = ids - start
        local = (s < TOP_K) & (e >= 0) & (e < num_local)
        row = T + t * TOP_K + s
        first = s < tl.where(pid_n == 0, TOP_K, 0)  # one program per token stores the rows, as the routing
        tl.store(inv_ptr + t * TOP_K + s, tl.where(local, row, -1).to(tl.int32), mask=first)
        if (tl.max(local.to(tl.int32), 0) == 0) & (pid_n * BLOCK_N >= I_s):
            return  # no weight of this rank in these columns
        cols = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
        rmask = local[:, None] & (cols < I)[None, :]
        smask = cols < I_s
        ks = tl.arange(0, BLOCK_K)
        wp = w_ptr + tl.where(local, e, 0).to(tl.int64)[:, None, None] * swe + ks[None, None, :]
        gp = wp + cols.to(tl.int64)[None, :, None] * swn
        up = wp + (cols + I).to(tl.int64)[None, :, None] * swn
        sgp = sw_ptr + cols.to(tl.int64)[:, None] * sswn + ks[None, :]
        sup = sw_ptr + (cols + I_s).to(tl.int64)[:, None] * sswn + ks[None, :]
        xp = x_ptr + t * sx + ks
        acc_g = tl.zeros([K_POW2, BLOCK_N], dtype=tl.float32)
        acc_u = tl.zeros([K_POW2, BLOCK_N], dtype=tl.float32)
        acc_sg = tl.zeros([BLOCK_N], dtype=tl.float32)
        acc_su = tl.zeros([BLOCK_N], dtype=tl.float32)
        for k0 in tl.range(0, H, BLOCK_K, num_stages=NUM_STAGES):
            kmask = k0 + ks < H
            a = tl.load(xp + k0, mask=kmask, other=0.0).to(tl.float32)
            m = rmask[:, :, None] & kmask[None, None, :]
            acc_g += tl.sum(tl.load(gp + k0, mask=m, other=0.0).to(tl.float32) * a[None, None, :], 2)
            acc_u += tl.sum(tl.load(up + k0, mask=m, other=0.0).to(tl.float32) * a[None, None, :], 2)
            m = smask[:, None] & kmask[None, :]
            acc_sg += tl.sum(tl.load(sgp + k0, mask=m, other=0.0).to(tl.float32) * a[None, :], 1)
            acc_su += tl.sum(tl.load(sup + k0, mask=m, other=0.0).to(tl.float32) * a[None, :], 1)
        dt = act_ptr.dtype.element_ty
        tl.store(act_ptr + row.to(tl.int64)[:, None] * sa + cols[None, :], _silu_mul(acc_g, acc_u, dt), mask=rmask)
        tl.store(act_ptr + t * sa + cols, _silu_mul(acc_sg, acc_su, dt), mask=smask)

    @triton.jit(do_not_specialize=["T"])  # one compile for every batch size
    def _down_kernel(act_ptr, w_ptr, sw_ptr, y_ptr, sorted_ptr, block_expert_ptr, total_ptr, rw_ptr, sg_ptr,
                     T, H, I, I_s, num_local, sa, swe, swh, sswh, sy, srw, ssg, TOP_K: tl.constexpr,
                     BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, PRECISION: tl.constexpr):
        """Columns [n, n + BLOCK_N) of (act W_down^T) * routing weight for one block of rows of one expert."""
        pid_n, pid_m = tl.program_id(0), tl.program_id(1)
        if pid_m * BLOCK_M >= tl.load(total_ptr):
            return
        e = tl.load(block_expert_ptr + pid_m)
        rows = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
        if e == num_local:
            valid = rows < T
            rw = tl.load(sg_ptr + rows * ssg, mask=valid, other=0.0).to(tl.float32)
            w = sw_ptr
            wh = sswh
            inter = I_s
        else:
            pair = tl.load(sorted_ptr + rows)
            valid = pair >= 0
            rw = tl.load(rw_ptr + (pair // TOP_K).to(tl.int64) * srw + pair % TOP_K, mask=valid,
                         other=0.0).to(tl.float32)
            w = w_ptr + e.to(tl.int64) * swe
            wh = swh
            inter = I
        cols = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
        cmask = cols < H
        ks = tl.arange(0, BLOCK_K)
        ap = act_ptr + rows.to(tl.int64)[:, None] * sa + ks[None, :]
        wp = w + cols.to(tl.int64)[None, :] * wh + ks[:, None]
        acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
        for k0 in range(0, inter, BLOCK_K):
            kmask = k0 + ks < inter
            a = tl.load(ap + k0, mask=kmask[None, :], other=0.0)
            acc = tl.dot(a, tl.load(wp + k0, mask=kmask[:, None] & cmask[None, :], other=0.0), acc,
                         input_precision=PRECISION)
        dt = y_ptr.dtype.element_ty
        y = (round_to(acc, dt) * rw[:, None]).to(dt)
        tl.store(y_ptr + rows.to(tl.int64)[:, None] * sy + cols[None, :], y, mask=valid[:, None] & cmask[None, :])

    @triton.jit
    def _down_combine_kernel(act_ptr, w_ptr, sw_ptr, out_ptr, ids_ptr, inv_ptr, rw_ptr, sg_ptr, H, I, I_s, start,
                             sa, swe, swh, sswh, so, sid, srw, ssg, TOP_K: tl.constexpr, K_POW2: tl.constexpr,
                             BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, NUM_STAGES: tl.constexpr):
        """Columns [n, n + BLOCK_N) of token t's output: its k routed rows (other ranks' experts masked) as one
        [K_POW2, BLOCK_N, BLOCK_K] weight tile per K step and its shared row (row t) as another, in one loop that
        Triton software-pipelines (tl.range num_stages: NUM_STAGES - 1 steps of every expert's loads in flight;
        a plain loop here, with no tl.dot, would wait for memory once per step). Each GEMV is rounded, times its
        weight, rounded (_down_kernel's epilogue); the routed ones are summed in a fixed order, then the shared
        one, in fp32: no atomics, the same bits on every run."""
        t = tl.program_id(0).to(tl.int64)
        cols = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
        cmask = cols < H
        s = tl.arange(0, K_POW2)
        row = tl.load(inv_ptr + t * TOP_K + s, mask=s < TOP_K, other=-1)
        valid = row >= 0
        e = tl.load(ids_ptr + t * sid + s, mask=valid, other=0).to(tl.int64) - start
        e = tl.where(valid, e, 0)
        rw = tl.load(rw_ptr + t * srw + s, mask=valid, other=0.0).to(tl.float32)
        ks = tl.arange(0, BLOCK_K)
        ap = act_ptr + tl.where(valid, row, 0).to(tl.int64)[:, None] * sa + ks[None, :]
        wp = w_ptr + e[:, None, None] * swe + cols.to(tl.int64)[None, :, None] * swh + ks[None, None, :]
        sap = act_ptr + t * sa + ks
        swp = sw_ptr + cols.to(tl.int64)[:, None] * sswh + ks[None, :]
        acc = tl.zeros([K_POW2, BLOCK_N], dtype=tl.float32)
        acc_s = tl.zeros([BLOCK_N], dtype=tl.float32)
        for k0 in tl.range(0, tl.maximum(I, I_s), BLOCK_K, num_stages=NUM_STAGES):
            kr = valid[:, None] & (k0 + ks < I)[None, :]
            a = tl.load(ap + k0, mask=kr, other=0.0).to(tl.float32)
            w = tl.load(wp + k0, mask=kr[:, None, :] & cmask[None, :, None], other=0.0).to(tl.float32)
            acc += tl.sum(w * a[:, None, :], 2)
            ksh = k0 + ks < I_s
            a = tl.load(sap + k0, mask=ksh, other=0.0).to(tl.float32)
            w = tl.load(swp + k0, mask=cmask[:, None] & ksh[None, :], other=0.0).to(tl.float32)
            acc_s += tl.sum(w * a[None, :], 1)
        dt = out_ptr.dtype.element_ty
        y = tl.sum(round_to(round_to(acc, dt) * rw[:, None], dt), 0)  # invalid slots add 0
        y += round_to(round_to(acc_s, dt) * tl.load(sg_ptr + t * ssg).to(tl.float32), dt)
        tl.store(out_ptr + t * so + cols, y.to(dt), mask=cmask)

    @triton.jit
    def _combine_kernel(y_ptr, inv_ptr, out_ptr, H, sy, so, TOP_K: tl.constexpr, BLOCK_H: tl.constexpr):
        """out[t] = sum of token t's routed rows in top-k order, then its shared row (row t), in fp32: a fixed
        order, so no atomics and the same bits on every run."""
        t = tl.program_id(0).to(tl.int64)
        cols = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)
        mask = cols < H
        acc = tl.zeros([BLOCK_H], dtype=tl.float32)
        for j in tl.static_range(TOP_K):
            pos = tl.load(inv_ptr + t * TOP_K + j).to(tl.int64)
            hit = cols < tl.where(pos >= 0, H, 0)  # pairs of other ranks' experts add nothing
            acc += tl.load(y_ptr + pos * sy + cols, mask=hit, other=0.0).to(tl.float32)
        acc += tl.load(y_ptr + t * sy + cols, mask=mask, other=0.0).to(tl.float32)
        tl.store(out_ptr + t * so + cols, acc.to(out_ptr.dtype.element_ty), mask=mask)


# ------------------------------------------------------------------------------------------------------ modules
class Experts(nn.Module):
    """This rank's routed experts: parameters and per-expert loading.

    sync_free: True with the fast kernels (SparseMoE binds moe_fast, which never waits for the host), so CUDA graphs
    may capture it; the torch oracle reads per-expert counts on the host."""

    def __init__(self, num_experts: int, hidden: int, intermediate: int, dtype=None, device=None):
        super().__init__()
        self.start, self.num_local = even_split(num_experts, parallel.tp_rank(), parallel.tp_size())
        self.intermediate = intermediate
        local = [(self.start, self.num_local)]
        self.gate_up_proj = make_param((num_experts, 2 * intermediate, hidden), [local, None, None], dtype, device)
        self.down_proj = make_param((num_experts, hidden, intermediate), [local, None, None], dtype, device)
        self.sync_free = backend.use_fast()

    def load_expert(self, src, expert: int, proj: str) -> bool:
        """Load one per-expert tensor (`experts.{e}.{gate,up,down}_proj.weight`); False if not this rank's expert."""
        e = expert - self.start
        if not 0 <= e < self.num_local:
            return False
        I = self.intermediate
        if proj == "down_proj":
            target = self.down_proj.data[e]
        else:
            target = self.gate_up_proj.data[e, :I] if proj == "gate_proj" else self.gate_up_proj.data[e, I:]
        if tuple(src.shape) != tuple(target.shape):
            raise ValueError(f"tensor {src.name!r} in {src.file}: shape {tuple(src.shape)}, expected {tuple(target.shape)}")
        target.copy_(src.read((slice(None), slice(None))))
        return True

    def weights(self, shared: MLP) -> ExpertWeights:
        """This rank's experts with the shared expert's shard (it shares their launches)."""
        return ExpertWeights(self.gate_up_proj, self.down_proj, self.start, shared.gate_up, shared.down_proj.weight)


class SparseMoE(nn.Module):
    def __init__(self, cfg, dtype=None, device=None):
        super().__init__()
        H = cfg.hidden_size
        self.top_k = cfg.num_experts_per_tok
        self.gate = Linear(H, cfg.num_experts, dtype=dtype, device=device)          # router, replicated
        self.experts = Experts(cfg.num_experts, H, cfg.moe_intermediate_size, dtype=dtype, device=device)
        self.shared_expert = MLP(H, cfg.shared_expert_intermediate_size, dtype=dtype, device=device)
        self.shared_expert_gate = Linear(H, 1, dtype=dtype, device=device)           # replicated
        self.router = fuse_rows(self.gate, self.shared_expert_gate,                 # [E + 1, H]: one GEMM
                                pad_rows_to=ROUTER_PAD_ROWS)
        self.sync_free = self.experts.sync_free
        self._moe = moe_fast if backend.use_fast() else moe_torch

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """Routed experts + sigmoid(shared gate) * shared expert, in the model dtype."""
        return self._moe(x, self.router, self.top_k, self.experts.weights(self.shared_expert))
