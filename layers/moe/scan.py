"""The MoE's expert-major decode kernels: a program per (expert, N tile) finds its expert's (token, slot) pairs by
scanning the step's routing itself, so there is no sorted layout to build (no align launch), and each expert's
weights are read once for all the tokens that chose it. The GEMV path (layers/moe/gemv.py), a program per token,
reads an expert once per token that chose it: at 16-64 tokens that is 1.3-2.3x the bytes (the TP=4 rank shape,
E256_H2048_I128: 90 us at T = 32 against ~53 of unique bytes, 1x H200, L2 cold, 2026-11-27).

    gate_up_scan_torch / _fast  act in the GEMV path's rows (GemvAct): shared row t, pair p = t * k + slot at T + p
    down_scan_torch / _fast     y in the same rows: (act W_down^T) rounded, times its routing weight (the shared
                                rows: sigmoid(shared gate)), rounded; layers/moe/grouped.py's combine sums them

The path (layers/moe/block.py decode_path): router GEMM, route_fast, gate_up_scan_fast, then down_combine_fast (a
program per token) or down_scan_fast + combine_fast, as the tuned table says per bucket of T.

A program's pairs: the step's T * k expert ids are loaded whole (T <= DECODE_MAX_T: at most 512), the pairs of its
expert numbered by a cumulative sum, and taken BLOCK_M at a time in pair order. The shared expert's T rows go to
cdiv(T, BLOCK_M) programs of one row block each, first in the grid (_scan says why). Each output row is computed from
its own input row only, so the grouping changes no bits.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from layers.backend import dot_precision, pdl, prior_done, tl, triton
from layers.moe.experts import ExpertWeights
from layers.moe.gemv import GemvAct, pair_rows_torch
from layers.moe.grouped import down_tile, gate_up_tile
from layers.moe.tiles import cap_tile

# untuned defaults (the tuned table names a bucket's tiles; tests and forced calls use these): a [BLOCK_M, BLOCK_K] x
# [BLOCK_K, BLOCK_N] tl.dot per step
SCAN_GATE_UP_TILE = dict(BLOCK_M=16, BLOCK_N=32, BLOCK_K=128, num_warps=4, num_stages=3)
SCAN_DOWN_TILE = dict(BLOCK_M=16, BLOCK_N=64, BLOCK_K=128, num_warps=4, num_stages=3)


def gate_up_scan_torch(x: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor, shared_gate: torch.Tensor,
                       w: ExpertWeights, tile: dict | None = None) -> GemvAct:
    """The routing given (route_fast's), act and inverse as pair_rows_torch's. tile is the fast kernel's, unused."""
    act, inverse = pair_rows_torch(x, ids, w)
    return GemvAct(act, ids, weights, shared_gate, inverse)


def gate_up_scan_fast(x: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor, shared_gate: torch.Tensor,
                      w: ExpertWeights, tile: dict | None = None) -> GemvAct:
    """gate_up_scan_torch in one launch: a program per (local expert or the shared one, N tile of the gate|up
    columns). x [T, H] with unit column stride."""
    ids = ids.contiguous()  # the kernel reads the T * k ids flat
    T, H = x.shape
    top_k = ids.shape[1]
    num_local, two_i, _ = w.gate_up.shape
    inter, shared_inter = two_i // 2, w.shared_gate_up.shape[0] // 2
    width = max(inter, shared_inter)
    act = torch.empty(T * (top_k + 1), width, dtype=x.dtype, device=x.device)
    inverse = torch.empty(T * top_k, dtype=torch.int32, device=x.device)
    if T:
        t = cap_tile(tile or SCAN_GATE_UP_TILE, triton.next_power_of_2(width), triton.next_power_of_2(H))
        grid = (triton.cdiv(T, t["BLOCK_M"]) + num_local, triton.cdiv(width, t["BLOCK_N"]))
        _gate_up_scan_kernel[grid](
            x, ids, w.gate_up, w.shared_gate_up, act, inverse, T, H, inter, shared_inter, w.start, num_local,
            x.stride(0), w.gate_up.stride(0), w.gate_up.stride(1), w.shared_gate_up.stride(0), act.stride(0),
            TOP_K=top_k, P_POW2=triton.next_power_of_2(T * top_k), BLOCK_M=t["BLOCK_M"], BLOCK_N=t["BLOCK_N"],
            BLOCK_K=t["BLOCK_K"], PRECISION=dot_precision(x.dtype), num_warps=t["num_warps"],
            num_stages=t["num_stages"], **pdl())
    return GemvAct(act, ids, weights, shared_gate, inverse)


def down_scan_torch(act: torch.Tensor, w: ExpertWeights, inverse: torch.Tensor, ids: torch.Tensor,
                    weights: torch.Tensor, shared_gate: torch.Tensor, tile: dict | None = None) -> torch.Tensor:
    """y [T * (k + 1), H] in act's rows: (act[row] W_down[e]^T) rounded to the model dtype times the pair's routing
    weight, rounded (shared rows t: the shared expert times sigmoid(shared gate)); rows of other ranks' pairs 0.
    tile is the fast kernel's, unused."""
    T, k = ids.shape
    inter, shared_inter = w.down.shape[2], w.shared_down.shape[1]
    y = torch.zeros(act.shape[0], w.down.shape[1], dtype=act.dtype, device=act.device)
    y[:T] = F.linear(act[:T, :shared_inter], w.shared_down) * shared_gate
    pairs = (inverse >= 0).nonzero().squeeze(1)
    rows = inverse[pairs].long()
    h = torch.bmm(w.down[ids.flatten()[pairs].long() - w.start], act[rows, :inter].unsqueeze(2)).squeeze(2)
    y[rows] = h * weights.flatten()[pairs, None]
    return y


def down_scan_fast(act: torch.Tensor, w: ExpertWeights, inverse: torch.Tensor, ids: torch.Tensor,
                   weights: torch.Tensor, shared_gate: torch.Tensor, tile: dict | None = None) -> torch.Tensor:
    """down_scan_torch in one launch: a program per (local expert or the shared one, N tile of H); rows of other
    ranks' pairs left unwritten."""
    ids, weights = ids.contiguous(), weights.contiguous()  # the kernel reads both flat, by pair
    T, top_k = ids.shape
    num_local, H, inter = w.down.shape
    y = torch.empty(act.shape[0], H, dtype=act.dtype, device=act.device)
    if T:
        t = cap_tile(tile or SCAN_DOWN_TILE, triton.next_power_of_2(H),
                     triton.next_power_of_2(max(inter, w.shared_down.shape[1])))
        grid = (triton.cdiv(T, t["BLOCK_M"]) + num_local, triton.cdiv(H, t["BLOCK_N"]))
        _down_scan_kernel[grid](
            act, ids, weights, shared_gate, w.down, w.shared_down, y, T, H, inter, w.shared_down.shape[1], w.start,
            num_local, act.stride(0), w.down.stride(0), w.down.stride(1), w.shared_down.stride(0), y.stride(0),
            shared_gate.stride(0), TOP_K=top_k, P_POW2=triton.next_power_of_2(T * top_k), BLOCK_M=t["BLOCK_M"],
            BLOCK_N=t["BLOCK_N"], BLOCK_K=t["BLOCK_K"], PRECISION=dot_precision(act.dtype),
            num_warps=t["num_warps"], num_stages=t["num_stages"], **pdl())
    return y


if triton is not None:
    @triton.jit
    def _scan(ids_ptr, T, q, start, num_local, TOP_K: tl.constexpr, P_POW2: tl.constexpr, BLOCK_M: tl.constexpr):
        """What program q (of grid axis 0) takes: the shared expert's rows m0.. (programs q < cdiv(T, BLOCK_M), one
        block each: first in the grid, not one program streaming the shared weights once per block at the end), or
        local expert e = q - cdiv(T, BLOCK_M)'s pairs among the step's T * TOP_K from m0 = 0.
        Returns (e (num_local: the shared expert), m0, p, local (each pair's local expert id, -1 - start past the
        pairs), match, rank, count), with rank the place of each match in pair order and count the expert's rows
        (the shared expert's: T)."""
        n_shared = tl.cdiv(T, BLOCK_M)
        shared = q < n_shared
        e = tl.where(shared, num_local, q - n_shared)
        n = T * TOP_K
        p = tl.arange(0, P_POW2)
        local = tl.load(ids_ptr + p, mask=p < n, other=-1).to(tl.int32) - start
        match = (p < n) & (local == e) & (e < num_local)
        hits = match.to(tl.int32)
        count = tl.where(shared, T, tl.sum(hits, 0))
        return e, tl.where(shared, q * BLOCK_M, 0), p, local, match, tl.cumsum(hits, 0) - 1, count

    @triton.jit
    def _expert(e, num_local, w_ptr, swe, srow, I, sw_ptr, ssrow, I_s):
        """(weight base, row stride, intermediate size) of local expert e, or of the shared expert (e == num_local)."""
        if e == num_local:
            w = sw_ptr
            stride = ssrow
            inter = I_s
        else:
            w = w_ptr + e.to(tl.int64) * swe
            stride = srow
            inter = I
        return w, stride, inter

    @triton.jit
    def _pick(p, match, rank, m, e, num_local, T, TOP_K: tl.constexpr):
        """(row, token) of the pairs numbered m (a [BLOCK_M] vector) of the program's expert: the shared expert's
        row and token are m; a pair's row is T + pair (the GemvAct rows)."""
        pair = tl.sum(tl.where(match[None, :] & (rank[None, :] == m[:, None]), p[None, :], 0), 1)
        shared = e == num_local
        return tl.where(shared, m, T + pair), tl.where(shared, m, pair // TOP_K)

    @triton.jit(do_not_specialize=["T"])  # one compile for every batch size
    def _gate_up_scan_kernel(x_ptr, ids_ptr, w_ptr, sw_ptr, act_ptr, inv_ptr, T, H, I, I_s, start, num_local, sx,
                             swe, swn, sswn, sa, TOP_K: tl.constexpr, P_POW2: tl.constexpr, BLOCK_M: tl.constexpr,
                             BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, PRECISION: tl.constexpr):
        """Program (expert e's rows from m0 (_scan), N tile n): columns [n, n + BLOCK_N) of silu(x W_gate^T) *
        (x W_up^T) for those rows, BLOCK_M at a time (gate and up rows n.. and n + inter.. of e's [2 inter, H]
        weight). The shared expert's first program of tile 0 also stores every pair's act row (inverse; -1: another
        rank's expert).
        The first BLOCK_M pairs run outside any loop, so that nothing encloses their K loop (84 -> 79 us at T = 64,
        TP=4 shapes, 1x H200, L2 cold); the larger gain was the shared expert's blocks first in the grid (_scan:
        79 -> 62)."""
        prior_done()  # (backend.pdl: the kernels before this one have finished)
        pid_n = tl.program_id(1)
        e, m0, p, local, match, rank, count = _scan(ids_ptr, T, tl.program_id(0), start, num_local, TOP_K, P_POW2,
                                                    BLOCK_M)
        if (e == num_local) & (m0 == 0) & (pid_n == 0):
            mine = (local >= 0) & (local < num_local)
            tl.store(inv_ptr + p, tl.where(mine, T + p, -1), mask=p < T * TOP_K)
        w, wn, inter = _expert(e, num_local, w_ptr, swe, swn, I, sw_ptr, sswn, I_s)
        if (m0 >= count) | (pid_n * BLOCK_N >= inter):
            return
        _gate_up_block(x_ptr, w, wn, act_ptr, p, match, rank, count, m0, e, num_local, pid_n, T, H, inter, sx, sa,
                       TOP_K, BLOCK_M, BLOCK_N, BLOCK_K, PRECISION)
        for m1 in range(m0 + BLOCK_M, tl.where(e == num_local, 0, count), BLOCK_M):  # a local expert of more than
            _gate_up_block(x_ptr, w, wn, act_ptr, p, match, rank, count, m1, e, num_local, pid_n, T, H, inter, sx,
                           sa, TOP_K, BLOCK_M, BLOCK_N, BLOCK_K, PRECISION)  # BLOCK_M pairs (rare at decode sizes)

    @triton.jit
    def _gate_up_block(x_ptr, w, wn, act_ptr, p, match, rank, count, m0, e, num_local, pid_n, T, H, inter, sx, sa,
                       TOP_K: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                       PRECISION: tl.constexpr):
        """act rows of the pairs numbered m0.. of the program's expert, columns of N tile pid_n."""
        m = m0 + tl.arange(0, BLOCK_M)
        valid = m < count
        row, tok = _pick(p, match, rank, m, e, num_local, T, TOP_K)
        cols = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
        out = gate_up_tile(x_ptr, tok, valid, w, wn, inter, cols, H, sx, BLOCK_M, BLOCK_N, BLOCK_K, PRECISION,
                           act_ptr.dtype.element_ty)
        tl.store(act_ptr + row.to(tl.int64)[:, None] * sa + cols[None, :], out,
                 mask=valid[:, None] & (cols < inter)[None, :])

    @triton.jit(do_not_specialize=["T"])  # one compile for every batch size
    def _down_scan_kernel(act_ptr, ids_ptr, rw_ptr, sg_ptr, w_ptr, sw_ptr, y_ptr, T, H, I, I_s, start, num_local,
                          sa, swe, swh, sswh, sy, ssg, TOP_K: tl.constexpr, P_POW2: tl.constexpr,
                          BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                          PRECISION: tl.constexpr):
        """Program (expert e's rows from m0 (_scan), N tile n): columns [n, n + BLOCK_N) of (act W_down^T) rounded,
        times the routing weight (the shared expert's rows: sigmoid(shared gate)), rounded, BLOCK_M rows at a time
        (the first block outside any loop, as _gate_up_scan_kernel's)."""
        prior_done()  # (backend.pdl: the kernels before this one have finished)
        pid_n = tl.program_id(1)
        e, m0, p, _, match, rank, count = _scan(ids_ptr, T, tl.program_id(0), start, num_local, TOP_K, P_POW2,
                                                BLOCK_M)
        w, wh, inter = _expert(e, num_local, w_ptr, swe, swh, I, sw_ptr, sswh, I_s)
        if m0 >= count:
            return
        _down_block(act_ptr, rw_ptr, sg_ptr, w, wh, y_ptr, p, match, rank, count, m0, e, num_local, pid_n, T, H,
                    inter, sa, sy, ssg, TOP_K, BLOCK_M, BLOCK_N, BLOCK_K, PRECISION)
        for m1 in range(m0 + BLOCK_M, tl.where(e == num_local, 0, count), BLOCK_M):
            _down_block(act_ptr, rw_ptr, sg_ptr, w, wh, y_ptr, p, match, rank, count, m1, e, num_local, pid_n, T, H,
                        inter, sa, sy, ssg, TOP_K, BLOCK_M, BLOCK_N, BLOCK_K, PRECISION)

    @triton.jit
    def _down_block(act_ptr, rw_ptr, sg_ptr, w, wh, y_ptr, p, match, rank, count, m0, e, num_local, pid_n, T, H, inter,
                    sa, sy, ssg, TOP_K: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                    BLOCK_K: tl.constexpr, PRECISION: tl.constexpr):
        """y rows of the pairs numbered m0.. of the program's expert, columns of N tile pid_n."""
        m = m0 + tl.arange(0, BLOCK_M)
        valid = m < count
        row, tok = _pick(p, match, rank, m, e, num_local, T, TOP_K)
        shared = e == num_local
        rw = tl.load(tl.where(shared, sg_ptr + tok * ssg, rw_ptr + (row - T)), mask=valid, other=0.0).to(tl.float32)
        cols = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
        y = down_tile(act_ptr, row, valid, rw, w, wh, inter, cols, H, sa, BLOCK_M, BLOCK_N, BLOCK_K, PRECISION,
                      y_ptr.dtype.element_ty)
        tl.store(y_ptr + row.to(tl.int64)[:, None] * sy + cols[None, :], y, mask=valid[:, None] & (cols < H)[None, :])
