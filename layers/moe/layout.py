"""The sorted layout of the grouped MoE kernels (layers/moe/grouped.py).

    align_torch / align_fast  the layout for ids [T, k] on a rank owning experts [start, start + num_local)

align_fast takes one program (align_serial: _align_kernel) up to ALIGN_SERIAL_MAX_T tokens, align_chunked's three
launches over chunks of pairs above (_align_count_kernel, _align_offsets_kernel, _align_scatter_kernel), as one
program's serial loops over the T * k pairs took 0.41 ms per layer at T = 8192 (1x H200).

Rows grouped in blocks of BLOCK_M rows that belong to one expert each. The shared expert is one more expert (index
num_local, its own weight pointers; its intermediate size may differ: 64 per rank at TP=8 vs the routed experts'
512) and comes first: rows [0, S), S = T rounded up to BLOCK_M, row t = token t. Then each local expert's pairs
(pair p = t * k + slot), the group padded to a multiple of BLOCK_M with pair -1. Buffers are sized by the worst case
for T, so nothing depends on the routing on the host. A group holds its pairs in pair order (align_torch's layout
exactly) from align_chunked; _align_kernel places them by integer atomics, so their order may vary between runs. No
result depends on it: every output row is computed from its own input row, and the combine sums each token's rows
in a fixed order.
"""
from __future__ import annotations

from typing import NamedTuple

import torch

from layers.backend import empty_aligned, pdl, prior_done, tl, triton
from layers.moe.tiles import DECODE_MAX_T

ALIGN_SERIAL_MAX_T = DECODE_MAX_T  # align_fast: one program (_align_kernel) at or below, whose serial loops over the
                                   # pairs cost 0.41 ms at T = 8192 (1x H200); the chunked kernels above
# Pairs per program of the chunked layout, by the call's pairs: (at most this many pairs, chunk). Fewer, larger
# chunks shorten the one program's scan over [chunks, experts]; more, smaller ones spread the sorts over more SMs.
# From `python -m benchmarks.bench_moe --layout-only` (1x and 2x H200, TP=1 and 2, 2026-11-30): 8-16 chunks are
# best to 1,024 tokens at top-8, 32-128 beyond; with 1,024-pair chunks everywhere a verify step of 128-256 tokens
# paid 12.7 us a layer against 6.4-6.9 at 128 (`2026-11-30_layout_h200x2.json`).
ALIGN_CHUNKS = ((2048, 128), (4096, 256), (32768, 512), (float("inf"), 1024))


class Layout(NamedTuple):
    """The sorted layout of one call (see the module docstring); every tensor lives on the device."""
    sorted_pairs: torch.Tensor  # [rows] int32: pair t * k + slot per routed row, -1 for pad rows (shared rows unused)
    block_expert: torch.Tensor  # [rows // BLOCK_M] int32: local expert of each block, num_local for the shared one
    inverse: torch.Tensor       # [T * k] int32: row of each pair, -1 if another rank's expert
    total: torch.Tensor         # [1] int32: rows in use; blocks past it exit at once
    rows: int                   # worst-case rows for T (host int, from shapes only)
    block_m: int
    top_k: int


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


def align_fast(ids: torch.Tensor, start: int, num_local: int, block_m: int) -> Layout:
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
                        CHUNK=min(1024, triton.next_power_of_2(T * k)), NB_CHUNK=16, num_warps=8, **pdl())
    return layout


def align_chunked(ids: torch.Tensor, start: int, num_local: int, block_m: int, chunk: int | None = None) -> Layout:
    """The layout in three launches over chunks of `chunk` pairs (a power of two; align_chunk's by default), equal to
    align_torch's entry for entry (a group's pairs in pair order) and with no atomics:

        _align_count_kernel    a program per chunk: its pairs per local expert -> counts [chunks, bins]
        _align_offsets_kernel  one program: the group offsets, and per (chunk, expert) where the chunk's pairs of
                               that expert start (a scan over the chunks); total, block table, pad rows
        _align_scatter_kernel  a program per chunk: its pairs sorted by (expert, pair); the j-th goes to row
                               offs[e] + base[chunk, e] + j

    The grid and the scratch ([chunks, bins] twice) follow from T alone."""
    T, k = ids.shape
    chunk = chunk or align_chunk(T * k)
    layout = _empty_layout(T, k, num_local, block_m, ids.device)
    bins = max(2, triton.next_power_of_2(num_local))  # no scan over a length-1 axis
    chunks = max(1, triton.cdiv(T * k, chunk))
    sizes = [chunks * bins, chunks * bins, bins]
    counts, base, offs = empty_aligned(sizes, torch.int32, ids.device)
    ids = ids.contiguous()
    _align_count_kernel[(chunks,)](ids, counts, T, start, num_local, TOP_K=k, BINS=bins, CHUNK=chunk, num_warps=4,
    **pdl())
    _align_offsets_kernel[(1,)](counts, base, offs, layout.sorted_pairs, layout.block_expert, layout.total, T,
                                num_local, TOP_K=k, BLOCK_M=block_m, BINS=bins, CHUNK=chunk,
                                STEP=max(2, 4096 // bins), NB_CHUNK=16, num_warps=8, **pdl())
    _align_scatter_kernel[(chunks,)](ids, layout.sorted_pairs, layout.inverse, base, offs, T, start, num_local,
                                     TOP_K=k, BINS=bins, CHUNK=chunk, num_warps=4, **pdl())
    return layout


def align_chunk(pairs: int) -> int:
    """align_chunked's default chunk for `pairs` pairs: ALIGN_CHUNKS' entry, or the pairs rounded up to a power of
    two where fewer (one chunk)."""
    chunk = next(c for most, c in ALIGN_CHUNKS if pairs <= most)
    return min(chunk, triton.next_power_of_2(max(16, pairs)))


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


if triton is not None:
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
        prior_done()  # (backend.pdl: the kernels before this one have finished)
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
        prior_done()  # (backend.pdl: the kernels before this one have finished)
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
        prior_done()  # (backend.pdl: the kernels before this one have finished)
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
        prior_done()  # (backend.pdl: the kernels before this one have finished)
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
