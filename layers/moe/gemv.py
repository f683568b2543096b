"""The MoE decode kernels: a program per (token, N tile), no sorted layout. At decode sizes the launches, not the
bytes, are the cost (more so at TP=8, where a rank's expert bytes shrink 8x).

    gate_up_gemv_torch / _fast  route, then silu(x W_gate^T) * (x W_up^T) of each token's local experts and the
                                shared expert, in one launch
    down_combine_torch / _fast  the down GEMVs, routing weights and the per-token sum, in one launch

_gate_up_gemv_kernel  per (token, N tile): the token's routing (route_token: route_fast's bits; every program
                      routes, one stores it), then its local experts' gate|up rows as one tile and the shared
                      expert's, in one software-pipelined H loop -> act: shared row t, pair p at row T + p (other
                      ranks' pairs: -1 in the pair -> row index, rows unwritten)
_gate_up_persistent_kernel  the same act from G programs a token, each routing once and taking the token's work
                      items (whole rows of the shared expert, then of its local experts) in turn: at 1-4 tokens
_down_combine_kernel  per (token, N tile): the token's routed experts as one tile and the shared expert's, in one
                      software-pipelined K loop (every expert's loads in flight together), each GEMV times its
                      weight, summed in fp32 in a fixed order. It reads act through the pair -> row index, so it
                      ends both the GEMV path and the sorted layout's (layers/moe/grouped.py) at few tokens.
"""
from __future__ import annotations

import functools
from typing import NamedTuple

import torch
import torch.nn.functional as F

from dist import push
from layers import backend
from layers.backend import next_may_start, pdl, prior_done, round_to, tl, triton
from layers.linear import inbox_args
from layers.activation import silu_mul_sums, silu_mul_torch
from layers.moe.experts import ExpertWeights
from layers.moe.routing import route_token, route_torch
from layers.moe.tiles import DOWN_COMBINE_TILE, GEMV_TILE, cap_tile


class GemvAct(NamedTuple):
    """What the GEMV path's gate_up step gives: the routing and act, laid out per token (no sorted layout)."""
    act: torch.Tensor          # [T * (k + 1), max(I, I_s)]: shared rows [0, T), pair p = t * k + slot at row T + p
    ids: torch.Tensor          # [T, k] global expert ids (int32 from the kernel, int64 from torch)
    weights: torch.Tensor      # [T, k] model dtype
    shared_gate: torch.Tensor  # [T, 1] model dtype
    inverse: torch.Tensor      # [T * k] int32: row of each pair, -1 if another rank's expert (its row unwritten)


def gate_up_gemv_torch(x: torch.Tensor, logits: torch.Tensor, top_k: int, w: ExpertWeights,
                       tile: dict | None = None) -> GemvAct:
    """route_torch, then act and inverse as pair_rows_torch's. tile is the fast kernel's and unused here."""
    ids, weights, shared_gate = route_torch(logits, top_k)
    act, inverse = pair_rows_torch(x, ids, w)
    return GemvAct(act, ids, weights, shared_gate, inverse)


def pair_rows_torch(x: torch.Tensor, ids: torch.Tensor, w: ExpertWeights) -> tuple[torch.Tensor, torch.Tensor]:
    """(act, inverse) in the GEMV path's rows: silu(x W_gate^T) * (x W_up^T) in the model dtype for the shared expert
    (row t) and every local pair (row T + p; other ranks' pairs: inverse -1 and their rows 0)."""
    T, top_k = ids.shape
    num_local, two_i, _ = w.gate_up.shape
    inter, shared_inter = two_i // 2, w.shared_gate_up.shape[0] // 2
    local = ids.long() - w.start
    mine = (local >= 0) & (local < num_local)
    rows = T + torch.arange(T * top_k, device=x.device).view(T, top_k)
    act = torch.zeros(T * (top_k + 1), max(inter, shared_inter), dtype=x.dtype, device=x.device)
    act[:T, :shared_inter] = silu_mul_torch(F.linear(x, w.shared_gate_up))
    tok, slot = mine.nonzero(as_tuple=True)
    h = torch.bmm(w.gate_up[local[tok, slot]], x[tok].unsqueeze(2)).squeeze(2)
    act[rows[tok, slot], :inter] = silu_mul_torch(h)
    return act, torch.where(mine, rows, -1).flatten().int()


# The persistent gate_up (a tile with "persistent": tiles.py's default at T <= PERSISTENT_MAX_T where no tuned table
# entry says otherwise): G programs a token (per_sm a SM, all resident), each routing once and then taking the token's
# work items in turn, an item being BLOCK_N whole gate and up rows of one expert, loaded at once (as linear.py's GEMV
# does). Under TP a token has ~k / tp local experts: only their rows are items. The grid it replaced, a program per
# (slot, N tile), local or not, each routing, took 15.7 us at T = 1 for ~9 MB of weights at the TP=4 rank shape,
# against 8.7 (1x H200, L2 cold, benchmarks/bench_gate_up_gemv.py, 2026-11-27).
PERSISTENT_TILE = 16384   # elements of an item's gate and up rows where the tile names no BLOCK_N
PERSISTENT_PER_SM = 4     # the persistent gate_up's programs per SM where the tile names none


@functools.lru_cache(maxsize=None)
def persistent_programs(device: torch.device, T: int, per_sm: int) -> int:
    """Programs per token of _gate_up_persistent_kernel: per_sm a SM over the T tokens, so that every program is
    resident at once and routes once (3 on the CPU, so that tests step the programs through several items)."""
    if device.type != "cuda":
        return 3
    return max(1, per_sm * backend.sm_count(device) // T)


def gate_up_gemv_fast(x: torch.Tensor, logits: torch.Tensor, top_k: int, w: ExpertWeights,
                      tile: dict | None = None) -> GemvAct:
    """gate_up_gemv_torch in one launch, a program per (token, N tile of max(I, I_s)), or with a tile's "persistent"
    G programs a token (per_sm, BLOCK_N, num_stages: its keys): each routes its token (route_fast's kernel code, so
    the same bits) and streams that token's local experts' and the shared expert's gate|up rows. x [T, H] and
    logits [T, E + 1] with unit column stride."""
    T, H = x.shape
    E = logits.shape[1] - 1
    num_local, two_i, _ = w.gate_up.shape
    inter, shared_inter = two_i // 2, w.shared_gate_up.shape[0] // 2
    width = max(inter, shared_inter)
    ids, inverse = torch.empty(2, T, top_k, dtype=torch.int32, device=x.device)  # one allocation
    weights = torch.empty(T, top_k, dtype=logits.dtype, device=x.device)
    shared_gate = torch.empty(T, 1, dtype=logits.dtype, device=x.device)
    act = torch.empty(T * (top_k + 1), width, dtype=x.dtype, device=x.device)
    tile = tile or GEMV_TILE
    if T and tile.get("persistent"):
        block_h = triton.next_power_of_2(H)
        block_n = min(triton.next_power_of_2(width), tile.get("BLOCK_N") or max(1, PERSISTENT_TILE // (2 * block_h)))
        _gate_up_persistent_kernel[(persistent_programs(x.device, T, tile.get("per_sm", PERSISTENT_PER_SM)), T)](
            x, logits, w.gate_up, w.shared_gate_up, act, ids, inverse, weights, shared_gate, T, H, E, inter,
            shared_inter, w.start, num_local, x.stride(0), logits.stride(0), w.gate_up.stride(0),
            w.gate_up.stride(1), w.shared_gate_up.stride(0), act.stride(0), TOP_K=top_k,
            K_POW2=triton.next_power_of_2(top_k), BLOCK_E=triton.next_power_of_2(E), BLOCK_N=block_n,
            BLOCK_H=block_h, NUM_STAGES=tile.get("num_stages", 1),
            num_warps=tile.get("num_warps") or (8 if 2 * block_n * block_h >= PERSISTENT_TILE else 4), **pdl())
    elif T:
        tile = cap_tile(tile, triton.next_power_of_2(width), triton.next_power_of_2(H), least=2)
        _gate_up_gemv_kernel[(T, triton.cdiv(width, tile["BLOCK_N"]))](
            x, logits, w.gate_up, w.shared_gate_up, act, ids, inverse, weights, shared_gate, T, H, E, inter,
            shared_inter, w.start, num_local, x.stride(0), logits.stride(0), w.gate_up.stride(0),
            w.gate_up.stride(1), w.shared_gate_up.stride(0), act.stride(0), TOP_K=top_k,
            K_POW2=triton.next_power_of_2(top_k), BLOCK_E=triton.next_power_of_2(E), BLOCK_N=tile["BLOCK_N"],
            BLOCK_K=tile["BLOCK_K"], NUM_STAGES=tile["num_stages"], SUM_LAST=tile.get("sum_last", False),
            EVEN=H % tile["BLOCK_K"] == 0 and inter == shared_inter and inter % tile["BLOCK_N"] == 0,
            num_warps=tile["num_warps"], **pdl())
    return GemvAct(act, ids, weights, shared_gate, inverse.view(-1))


def down_combine_torch(act: torch.Tensor, w: ExpertWeights, inverse: torch.Tensor, ids: torch.Tensor,
                       weights: torch.Tensor, shared_gate: torch.Tensor, tile: dict | None = None,
                       partial: bool = False) -> torch.Tensor:
    """out [T, H]: per token, (act[row] W_down[e]^T) rounded to the model dtype times its routing weight (rounded),
    for its routed rows in top-k order, then the shared row times sigmoid(shared gate), summed in fp32. act [rows,
    max(I, I_s)]: token t's shared row is row t, pair p's row inverse[p] (-1: another rank's expert), as both
    gate_up_fast's layout and the GEMV path's give them; tile is the fast kernel's and unused here, as is partial
    (the output is a layer boundary's partial sums: the caller's boundary all-reduces them)."""
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
                      weights: torch.Tensor, shared_gate: torch.Tensor, tile: dict | None = None,
                      partial: bool = False) -> torch.Tensor | push.Pushed:
    """down_combine_torch in one launch: a program per (token, N tile) reads the k + 1 expert tiles it needs, all
    at once. For few tokens only: an expert two tokens share, and the shared expert, are read once per token.
    partial (the output is a layer boundary's partial sums), where the inbox takes them (TP > 1, decode sizes):
    pushed to every rank from the epilogue (dist/push.py), and a Pushed is returned."""
    T, k = ids.shape
    num_local, H, inter = w.down.shape
    out = torch.empty(T, H, dtype=act.dtype, device=act.device)
    if T == 0:
        return out
    box = push.pushes((T, H), act.dtype) if partial else None
    slot = box.claim(T) if box is not None else 0
    width = triton.next_power_of_2(max(inter, w.shared_down.shape[1]))
    tile = cap_tile(tile or DOWN_COMBINE_TILE, triton.next_power_of_2(H), width, least=4)
    _down_combine_kernel[(T, triton.cdiv(H, tile["BLOCK_N"]))](
        act, w.down, w.shared_down, out, ids, inverse, weights, shared_gate, H, inter, w.shared_down.shape[1],
        w.start, act.stride(0), w.down.stride(0), w.down.stride(1), w.shared_down.stride(0), out.stride(0),
        ids.stride(0), weights.stride(0), shared_gate.stride(0), slot, *inbox_args(box, act.device), TOP_K=k,
        K_POW2=triton.next_power_of_2(k), BLOCK_N=tile["BLOCK_N"], BLOCK_K=tile["BLOCK_K"],
        NUM_STAGES=tile["num_stages"], PUSH=box is not None, P=box.world if box is not None else 1,
        EARLY=backend.early_launch(T), EVEN=H % tile["BLOCK_N"] == 0 and inter == w.shared_down.shape[1]
        and inter % tile["BLOCK_K"] == 0, num_warps=tile["num_warps"], **pdl())
    return push.Pushed(box, slot, out.shape, out.dtype) if box is not None else out


if triton is not None:
    @triton.jit(do_not_specialize=["T"])  # one compile for every batch size
    def _gate_up_gemv_kernel(x_ptr, logits_ptr, w_ptr, sw_ptr, act_ptr, ids_ptr, inv_ptr, rw_ptr, sg_ptr, T, H, E, I,
                             I_s, start, num_local, sx, sl, swe, swn, sswn, sa, TOP_K: tl.constexpr,
                             K_POW2: tl.constexpr, BLOCK_E: tl.constexpr, BLOCK_N: tl.constexpr,
                             BLOCK_K: tl.constexpr, NUM_STAGES: tl.constexpr, SUM_LAST: tl.constexpr,
                             EVEN: tl.constexpr):
        """Program (token t, N tile): t's routing (route_token; every program routes, the pid_n == 0 one stores it
        and each pair's act row for the down step), then columns [n, n + BLOCK_N) of silu(x W_gate^T) * (x W_up^T)
        of its local slots as one [K_POW2, BLOCK_N, BLOCK_K] tile per H step (gate and up halves) and of the shared
        expert as another, in one loop that Triton software-pipelines (as _down_combine_kernel). Other ranks'
        slots are masked: they read and write nothing. Rows: shared t, pair p = t * TOP_K + slot at T + p.
        SUM_LAST (the tile's "sum_last"): the products accumulate elementwise over the H steps and are summed along
        K once after the loop, instead of once a step (fewer instructions a step, more registers). ncu at the TP=2
        rank shape, T = 8 (1x H200, 2026-11-30): summed a step, DRAM at 65% of peak with 12% of warp slots active
        and few stalls, so the issue of each step's reductions held it; summing last, 23.6 -> 20.6 us at T = 4 and
        35.5 -> 34.1 at T = 8 (L2 cold), TP=2 decode 2.603 / 2.884 / 3.351 / 3.863 -> 2.585 / 2.876 / 3.220 / 3.821
        ms at batch 3 / 4 / 5 / 8 (one 2x H200 call, 2026-11-30_record_h200x2_tp2_sum_last{,_base}.json). At T = 16
        with the default tile it was slower (65.6 -> 72.2 us), and the down_combine kernel summing last was too
        (19.0 -> 20.4 us at T = 8): a tile option, tuned per bucket (benchmarks/tune_moe.py; also TP=1's T = 8: decode
        5.008 / 6.077 -> 4.676 / 5.992 ms at batch 5 / 8; its T = 4 tile lost 0.6-0.8% at batch 3-4 and was not
        kept; TP=4's T = 8 from the tuner alone). Stacking the slots' rows for tl.dot, or fetching the tiles by TMA,
        was 1.3-3x slower (2026-11-30_moe_gemv_variants_h200.json)."""
        prior_done()  # (backend.pdl: the kernels before this one have finished)
        t = tl.program_id(0).to(tl.int64)
        pid_n = tl.program_id(1)
        ids = route_token(logits_ptr, ids_ptr, rw_ptr, sg_ptr, t, E, sl, pid_n == 0, TOP_K, K_POW2, BLOCK_E)
        s = tl.arange(0, K_POW2)
        e = ids - start
        local = (s < TOP_K) & (e >= 0) & (e < num_local)
        row = T + t * TOP_K + s
        first = s < tl.where(pid_n == 0, TOP_K, 0)  # one program per token stores the rows, as the routing
        tl.store(inv_ptr + t * TOP_K + s, tl.where(local, row, -1).to(tl.int32), mask=first)
        if (tl.max(local.to(tl.int32), 0) == 0) & (pid_n * BLOCK_N >= I_s):
            return  # no weight of this rank in these columns
        cols = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
        # EVEN (H a multiple of BLOCK_K, I = I_s a multiple of BLOCK_N): the limits fold away, the loads keep only
        # `local`, which the loop does not change
        rmask = local[:, None] & ((cols < I) | EVEN)[None, :]
        smask = (cols < I_s) | EVEN
        ks = tl.arange(0, BLOCK_K)
        wp = w_ptr + tl.where(local, e, 0).to(tl.int64)[:, None, None] * swe + ks[None, None, :]
        gp = wp + cols.to(tl.int64)[None, :, None] * swn
        up = wp + (cols + I).to(tl.int64)[None, :, None] * swn
        sgp = sw_ptr + cols.to(tl.int64)[:, None] * sswn + ks[None, :]
        sup = sw_ptr + (cols + I_s).to(tl.int64)[:, None] * sswn + ks[None, :]
        xp = x_ptr + t * sx + ks
        if SUM_LAST:
            acc_g = tl.zeros([K_POW2, BLOCK_N, BLOCK_K], dtype=tl.float32)
            acc_u = tl.zeros([K_POW2, BLOCK_N, BLOCK_K], dtype=tl.float32)
            acc_sg = tl.zeros([BLOCK_N, BLOCK_K], dtype=tl.float32)
            acc_su = tl.zeros([BLOCK_N, BLOCK_K], dtype=tl.float32)
        else:
            acc_g = tl.zeros([K_POW2, BLOCK_N], dtype=tl.float32)
            acc_u = tl.zeros([K_POW2, BLOCK_N], dtype=tl.float32)
            acc_sg = tl.zeros([BLOCK_N], dtype=tl.float32)
            acc_su = tl.zeros([BLOCK_N], dtype=tl.float32)
        for k0 in tl.range(0, H, BLOCK_K, num_stages=NUM_STAGES):
            kmask = (k0 + ks < H) | EVEN
            a = tl.load(xp + k0, mask=kmask, other=0.0).to(tl.float32)
            m = rmask[:, :, None] & kmask[None, None, :]
            g = tl.load(gp + k0, mask=m, other=0.0).to(tl.float32) * a[None, None, :]
            u = tl.load(up + k0, mask=m, other=0.0).to(tl.float32) * a[None, None, :]
            m = smask[:, None] & kmask[None, :]
            sg = tl.load(sgp + k0, mask=m, other=0.0).to(tl.float32) * a[None, :]
            su = tl.load(sup + k0, mask=m, other=0.0).to(tl.float32) * a[None, :]
            if SUM_LAST:
                acc_g += g
                acc_u += u
                acc_sg += sg
                acc_su += su
            else:
                acc_g += tl.sum(g, 2)
                acc_u += tl.sum(u, 2)
                acc_sg += tl.sum(sg, 1)
                acc_su += tl.sum(su, 1)
        if SUM_LAST:
            acc_g, acc_u, acc_sg, acc_su = tl.sum(acc_g, 2), tl.sum(acc_u, 2), tl.sum(acc_sg, 1), tl.sum(acc_su, 1)
        dt = act_ptr.dtype.element_ty
        tl.store(act_ptr + row.to(tl.int64)[:, None] * sa + cols[None, :], silu_mul_sums(acc_g, acc_u, dt), mask=rmask)
        tl.store(act_ptr + t * sa + cols, silu_mul_sums(acc_sg, acc_su, dt), mask=smask)

    @triton.jit(do_not_specialize=["T"])  # one compile for every batch size
    def _gate_up_persistent_kernel(x_ptr, logits_ptr, w_ptr, sw_ptr, act_ptr, ids_ptr, inv_ptr, rw_ptr, sg_ptr, T, H,
                                   E, I, I_s, start, num_local, sx, sl, swe, swn, sswn, sa, TOP_K: tl.constexpr,
                                   K_POW2: tl.constexpr, BLOCK_E: tl.constexpr, BLOCK_N: tl.constexpr,
                                   BLOCK_H: tl.constexpr, NUM_STAGES: tl.constexpr):
        """Program (p, token t) of G per token takes the token's work items p, p + G, ...: items [0, n_shared) are
        the shared expert's N tiles, done before the routing (they need none); then t's routing, once (route_token;
        (0, t) stores it and each pair's act row), and the N tiles of the token's local slots in slot order (other
        ranks' slots are no items). An item is BLOCK_N whole gate rows and up rows, loaded at once; NUM_STAGES > 1
        keeps the next items' loads in flight. G programs a token, all resident, so none waits for a wave before it
        can route (a grid of a program per slot and N tile, local or not, each routing, was 1.8x slower). Rows as
        _gate_up_gemv_kernel's."""
        prior_done()  # (backend.pdl: the kernels before this one have finished)
        p = tl.program_id(0)
        G = tl.num_programs(0)
        t = tl.program_id(1).to(tl.int64)
        ks = tl.arange(0, BLOCK_H)
        kmask = ks < H
        a = tl.load(x_ptr + t * sx + ks, mask=kmask, other=0.0).to(tl.float32)
        dt = act_ptr.dtype.element_ty
        n_shared = tl.cdiv(I_s, BLOCK_N)
        for i in tl.range(p, n_shared, G, num_stages=NUM_STAGES):
            cols = i * BLOCK_N + tl.arange(0, BLOCK_N)
            act = _silu_rows(sw_ptr, sswn, I_s, cols, ks, kmask, a, dt)
            tl.store(act_ptr + t * sa + cols, act, mask=cols < I_s)
        ids = route_token(logits_ptr, ids_ptr, rw_ptr, sg_ptr, t, E, sl, p == 0, TOP_K, K_POW2, BLOCK_E)
        s = tl.arange(0, K_POW2)
        e = ids - start
        local = (s < TOP_K) & (e >= 0) & (e < num_local)
        tl.store(inv_ptr + t * TOP_K + s, tl.where(local, T + t * TOP_K + s, -1).to(tl.int32),
                 mask=s < tl.where(p == 0, TOP_K, 0))
        rank = tl.cumsum(local.to(tl.int32), 0) - 1  # a local slot's place among the local slots
        n_tiles = tl.cdiv(I, BLOCK_N)
        total = n_shared + tl.sum(local.to(tl.int32), 0) * n_tiles
        first = p + tl.cdiv(tl.maximum(n_shared - p, 0), G) * G  # this program's first item past the shared ones
        for i in tl.range(first, total, G, num_stages=NUM_STAGES):
            pick = local & (rank == (i - n_shared) // n_tiles)
            j = tl.sum(tl.where(pick, s, 0), 0)
            cols = ((i - n_shared) % n_tiles) * BLOCK_N + tl.arange(0, BLOCK_N)
            act = _silu_rows(w_ptr + tl.sum(tl.where(pick, e, 0), 0).to(tl.int64) * swe, swn, I, cols, ks, kmask, a,
                             dt)
            tl.store(act_ptr + (T + t * TOP_K + j).to(tl.int64) * sa + cols, act, mask=cols < I)

    @triton.jit
    def _silu_rows(w_ptr, srow, I, cols, ks, kmask, a, DTYPE: tl.constexpr):
        """silu(a W_gate^T) * (a W_up^T) at columns cols of one expert (gate rows [0, I), up rows [I, 2I), srow
        apart), each row loaded whole."""
        m = (cols < I)[:, None] & kmask[None, :]
        g = tl.load(w_ptr + cols.to(tl.int64)[:, None] * srow + ks[None, :], mask=m, other=0.0)
        u = tl.load(w_ptr + (cols + I).to(tl.int64)[:, None] * srow + ks[None, :], mask=m, other=0.0)
        return silu_mul_sums(tl.sum(g.to(tl.float32) * a[None, :], 1), tl.sum(u.to(tl.float32) * a[None, :], 1), DTYPE)

    @triton.jit(do_not_specialize=["push_slot"])
    def _down_combine_kernel(act_ptr, w_ptr, sw_ptr, out_ptr, ids_ptr, inv_ptr, rw_ptr, sg_ptr, H, I, I_s, start,
                             sa, swe, swh, sswh, so, sid, srw, ssg, push_slot, table, rank, region_stride,
                             TOP_K: tl.constexpr, K_POW2: tl.constexpr, BLOCK_N: tl.constexpr,
                             BLOCK_K: tl.constexpr, NUM_STAGES: tl.constexpr, PUSH: tl.constexpr, P: tl.constexpr,
                             EARLY: tl.constexpr, EVEN: tl.constexpr):
        """Columns [n, n + BLOCK_N) of token t's output: its k routed rows (other ranks' experts masked) as one
        [K_POW2, BLOCK_N, BLOCK_K] weight tile per K step and its shared row (row t) as another, in one loop that
        Triton software-pipelines (tl.range num_stages: NUM_STAGES - 1 steps of every expert's loads in flight;
        a plain loop here, with no tl.dot, would wait for memory once per step). Each GEMV is rounded, times its
        weight, rounded (_down_kernel's epilogue); the routed ones are summed in a fixed order, then the shared
        one, in fp32: no atomics, the same bits on every run. PUSH: the row goes into every rank's inbox instead of
        out_ptr (dist/push.py), and the programs empty the boundary before it in this rank's inbox."""
        prior_done()  # (backend.pdl: the kernels before this one have finished)
        if EARLY:  # (backend.early_launch: the GEMV after this kernel loads its weights while it runs)
            next_may_start()
        t = tl.program_id(0).to(tl.int64)
        cols = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
        cmask = (cols < H) | EVEN  # (EVEN: H a multiple of BLOCK_N, I = I_s of BLOCK_K: the limits fold away)
        s = tl.arange(0, K_POW2)
        # the three loads side by side (ids and weights not masked by the rows: one round trip to memory, not two)
        row = tl.load(inv_ptr + t * TOP_K + s, mask=s < TOP_K, other=-1)
        e = tl.load(ids_ptr + t * sid + s, mask=s < TOP_K, other=0).to(tl.int64) - start
        rw = tl.load(rw_ptr + t * srw + s, mask=s < TOP_K, other=0.0).to(tl.float32)
        valid = row >= 0
        e = tl.where(valid, e, 0)
        rw = tl.where(valid, rw, 0.0)
        ks = tl.arange(0, BLOCK_K)
        ap = act_ptr + tl.where(valid, row, 0).to(tl.int64)[:, None] * sa + ks[None, :]
        wp = w_ptr + e[:, None, None] * swe + cols.to(tl.int64)[None, :, None] * swh + ks[None, None, :]
        sap = act_ptr + t * sa + ks
        swp = sw_ptr + cols.to(tl.int64)[:, None] * sswh + ks[None, :]
        acc = tl.zeros([K_POW2, BLOCK_N], dtype=tl.float32)
        acc_s = tl.zeros([BLOCK_N], dtype=tl.float32)
        for k0 in tl.range(0, tl.maximum(I, I_s), BLOCK_K, num_stages=NUM_STAGES):
            kr = valid[:, None] & ((k0 + ks < I) | EVEN)[None, :]
            a = tl.load(ap + k0, mask=kr, other=0.0).to(tl.float32)
            w = tl.load(wp + k0, mask=kr[:, None, :] & cmask[None, :, None], other=0.0).to(tl.float32)
            acc += tl.sum(w * a[:, None, :], 2)
            ksh = (k0 + ks < I_s) | EVEN
            a = tl.load(sap + k0, mask=ksh, other=0.0).to(tl.float32)
            w = tl.load(swp + k0, mask=cmask[:, None] & ksh[None, :], other=0.0).to(tl.float32)
            acc_s += tl.sum(w * a[None, :], 1)
        dt = out_ptr.dtype.element_ty
        y = tl.sum(round_to(round_to(acc, dt) * rw[:, None], dt), 0)  # invalid slots add 0
        y += round_to(round_to(acc_s, dt) * tl.load(sg_ptr + t * ssg).to(tl.float32), dt)
        if PUSH:
            push.push_rows(y.to(dt), t, cols, cmask, push_slot, table, rank, region_stride, H, P)
            if push_slot > 0:
                push.clear_slot(push_slot - 1, tl.num_programs(0) * H, table, rank, region_stride, P, dt, 1024)
        else:
            tl.store(out_ptr + t * so + cols, y.to(dt), mask=cmask)
