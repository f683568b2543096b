"""The grouped MoE kernels: on the sorted layout (layers/moe/layout.py), each expert's weights streamed once for
all its rows.

    experts_torch / experts_fast  routed experts + sigmoid(shared gate) * shared expert, in the model dtype
    gate_up_torch / gate_up_fast  its steps on a given layout: silu(x W_gate^T) * (x W_up^T) per row,
    down_torch / down_fast        (act W_down^T) * routing weight per row,
    combine_torch / combine_fast  each token's rows summed

experts_torch is the oracle: one expert at a time, with host syncs (eager only). experts_fast is Triton launches
with no host sync and buffers sized from T alone, so CUDA graphs capture it:

    align_fast       (token, slot) pairs of this rank's experts grouped by expert into the sorted layout
    _gate_up_kernel  grouped GEMM x @ [W_gate | W_up]^T with silu(gate) * up in the epilogue -> act [rows, I]
    _down_kernel     grouped GEMM act @ W_down^T times the routing weight in the epilogue -> y [rows, H]
    _combine_kernel  per token: the k routed rows in top-k order, then the shared row, summed in fp32 -> [T, H]

At decode sizes the tile table may put down + combine in one kernel (layers/moe/gemv.py down_combine_fast).
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from dist import push
from layers.backend import dot_precision, pdl, prior_done, round_to, tl, triton
from layers.linear import inbox_args
from layers.activation import silu_mul_sums, silu_mul_torch
from layers.mlp import mlp_torch
from layers.moe.experts import ExpertWeights
from layers.moe.gemv import down_combine_fast
from layers.moe.layout import Layout, align_fast
from layers.moe.tiles import DECODE_MAX_T, config_for


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


def experts_fast(x: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor, shared_gate: torch.Tensor,
                 w: ExpertWeights, partial: bool = False) -> torch.Tensor | push.Pushed:
    """experts_torch with no host sync: align_fast, then the grouped kernels (see the module docstring). partial:
    the combine pushes where the inbox takes the output (a verify step's rows, past the decode kernels')."""
    if x.shape[0] == 0:
        return torch.empty_like(x)
    cfg = config_for(x, w)
    layout = align_fast(ids, w.start, w.gate_up.shape[0], cfg["BLOCK_M"])
    return experts_on_layout(x.contiguous(), w, layout, ids, weights, shared_gate, cfg, partial=partial)


def experts_on_layout(x: torch.Tensor, w: ExpertWeights, layout: Layout, ids: torch.Tensor, weights: torch.Tensor,
                      shared_gate: torch.Tensor, cfg: dict, down_combine: bool | None = None,
                      partial: bool = False) -> torch.Tensor | push.Pushed:
    """gate_up, then down + combine in one kernel or two: as down_combine forces, else one where the config has a
    down_combine tile (T <= DECODE_MAX_T only). partial: the last kernel pushes where the inbox takes the output
    (down_combine_fast, combine_fast)."""
    T = x.shape[0]
    act = gate_up_fast(x, w, layout, cfg["gate_up"])
    if down_combine is None:
        down_combine = T <= DECODE_MAX_T and cfg["down_combine"] is not None
    if down_combine:
        return down_combine_fast(act, w, layout.inverse, ids, weights, shared_gate, cfg["down_combine"],
                                 partial=partial)
    return combine_fast(down_fast(act, w, layout, weights, shared_gate, cfg["down"]), layout.inverse, T, partial)


def _routed_rows(layout: Layout, T: int):
    """The routed rows of a layout in use, each with its pair and its expert, on the host's terms (the torch twins
    sync): rows [S, total) where the pair is not -1 (a pad row), S = T rounded up to BLOCK_M."""
    bm = layout.block_m
    shared_rows = triton.cdiv(T, bm) * bm
    total = int(layout.total)
    pairs = layout.sorted_pairs[shared_rows:total].long()
    experts = layout.block_expert[shared_rows // bm: total // bm].long().repeat_interleave(bm)
    rows = (pairs >= 0).nonzero().squeeze(1)
    return shared_rows + rows, pairs[rows], experts[rows]


def gate_up_torch(x: torch.Tensor, w: ExpertWeights, layout: Layout, tile: dict | None = None) -> torch.Tensor:
    """gate_up_fast's rows in torch, an expert at a time: the shared rows [0, T) (I_s columns) and the routed rows
    in use (I columns), rounded as mlp_torch rounds; every other entry 0 (the kernel leaves rows past `total` and
    columns past an expert's width unwritten). tile is the fast kernel's and unused here."""
    T, k = x.shape[0], layout.top_k
    inter, shared_inter = w.gate_up.shape[1] // 2, w.shared_gate_up.shape[0] // 2
    act = torch.zeros(layout.rows, max(inter, shared_inter), dtype=x.dtype, device=x.device)
    act[:T, :shared_inter] = silu_mul_torch(F.linear(x, w.shared_gate_up))
    rows, pairs, experts = _routed_rows(layout, T)
    for e in experts.unique().tolist():
        mine = experts == e
        act[rows[mine], :inter] = silu_mul_torch(F.linear(x[pairs[mine] // k], w.gate_up[e]))
    return act


def down_torch(act: torch.Tensor, w: ExpertWeights, layout: Layout, weights: torch.Tensor,
               shared_gate: torch.Tensor, tile: dict | None = None) -> torch.Tensor:
    """down_fast's rows in torch, an expert at a time: (act W_down^T) rounded to the model dtype times the routing
    weight (sigmoid(shared gate) for the shared rows), rounded; every other row 0 (the kernel leaves pad rows and
    rows past `total` unwritten). tile is the fast kernel's and unused here."""
    T, k = weights.shape
    inter, shared_inter = w.down.shape[2], w.shared_down.shape[1]
    y = torch.zeros(layout.rows, w.down.shape[1], dtype=act.dtype, device=act.device)
    y[:T] = F.linear(act[:T, :shared_inter], w.shared_down) * shared_gate
    rows, pairs, experts = _routed_rows(layout, T)
    for e in experts.unique().tolist():
        mine = experts == e
        y[rows[mine]] = F.linear(act[rows[mine], :inter], w.down[e]) * weights.flatten()[pairs[mine], None]
    return y


def combine_torch(y: torch.Tensor, inverse: torch.Tensor, T: int) -> torch.Tensor:
    """out [T, H]: each token's routed rows of y (pair p = t * k + slot at row inverse[p]; -1: another rank's expert,
    adds nothing) in top-k order, then its shared row t, summed in fp32 in that order; cast to y's dtype."""
    pos = inverse.long().view(T, -1)
    acc = torch.zeros(T, y.shape[1], dtype=torch.float32, device=y.device)
    for j in range(pos.shape[1]):
        mine = (pos[:, j] >= 0).nonzero().squeeze(1)
        acc[mine] += y[pos[mine, j]].float()
    return (acc + y[:T].float()).to(y.dtype)


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
                          BLOCK_N=tile["BLOCK_N"], BLOCK_K=tile["BLOCK_K"], PRECISION=dot_precision(x.dtype),
                          num_warps=tile["num_warps"], num_stages=tile["num_stages"], **pdl())
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
                       BLOCK_K=tile["BLOCK_K"], PRECISION=dot_precision(act.dtype), num_warps=tile["num_warps"],
                       num_stages=tile["num_stages"], **pdl())
    return y


def combine_fast(y: torch.Tensor, inverse: torch.Tensor, T: int, partial: bool = False) -> torch.Tensor | push.Pushed:
    """combine_torch in one launch, a program per (token, column block). partial (the output is a layer boundary's
    partial sums), where the inbox takes them (TP > 1, decode sizes): pushed to every rank from the epilogue
    (dist/push.py), and a Pushed is returned."""
    H = y.shape[1]
    out = torch.empty(T, H, dtype=y.dtype, device=y.device)
    if T == 0:
        return out
    box = push.pushes((T, H), y.dtype) if partial else None
    slot = box.claim(T) if box is not None else 0
    block_h = min(1024, triton.next_power_of_2(H))
    _combine_kernel[(T, triton.cdiv(H, block_h))](y, inverse, out, H, y.stride(0), out.stride(0), slot,
                                                  *inbox_args(box, y.device), TOP_K=inverse.numel() // T,
                                                  BLOCK_H=block_h, PUSH=box is not None,
                                                  P=box.world if box is not None else 1, num_warps=4, **pdl())
    return push.Pushed(box, slot, out.shape, out.dtype) if box is not None else out


if triton is not None:
    @triton.jit(do_not_specialize=["T"])  # one compile for every batch size
    def _gate_up_kernel(x_ptr, w_ptr, sw_ptr, act_ptr, sorted_ptr, block_expert_ptr, total_ptr, T, H, I, I_s,
                        num_local, sx, swe, swn, sswn, sa, TOP_K: tl.constexpr, BLOCK_M: tl.constexpr,
                        BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, PRECISION: tl.constexpr):
        """Columns [n, n + BLOCK_N) of silu(x W_gate^T) * (x W_up^T) for one block of rows of one expert; gate and
        up of those columns are rows n.. and n + inter.. of the expert's [2 inter, H] weight."""
        prior_done()  # (backend.pdl: the kernels before this one have finished)
        pid_m, pid_n = tl.program_id(0), tl.program_id(1)
        rows = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
        # the layout's three loads side by side, one round trip to memory (the grid covers the buffers' rows; a
        # shared block's pairs are unwritten and unused)
        e = tl.load(block_expert_ptr + pid_m)
        total = tl.load(total_ptr)
        pair = tl.load(sorted_ptr + rows)
        shared = e == num_local
        inter = tl.where(shared, I_s, I)
        if (pid_m * BLOCK_M >= total) | (pid_n * BLOCK_N >= inter):
            return
        if shared:
            tok = rows
            valid = rows < T
            w = sw_ptr
            wn = sswn
        else:
            tok = pair // TOP_K
            valid = pair >= 0
            w = w_ptr + e.to(tl.int64) * swe
            wn = swn
        cols = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
        out = gate_up_tile(x_ptr, tok, valid, w, wn, inter, cols, H, sx, BLOCK_M, BLOCK_N, BLOCK_K, PRECISION,
                           act_ptr.dtype.element_ty)  # pad rows: silu(0) * 0 = 0
        tl.store(act_ptr + rows.to(tl.int64)[:, None] * sa + cols[None, :], out, mask=(cols < inter)[None, :])

    @triton.jit
    def gate_up_tile(x_ptr, tok, valid, w, wn, inter, cols, H, sx, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                     BLOCK_K: tl.constexpr, PRECISION: tl.constexpr, DTYPE: tl.constexpr):
        """silu(x W_gate^T) * (x W_up^T) (silu_mul_sums' rounding) for x rows tok (invalid ones read as 0) and
        columns cols of one expert, whose gate and up rows lie at w + cols * wn and w + (inter + cols) * wn: a
        [BLOCK_M, BLOCK_N] tile, by tl.dot over H in BLOCK_K steps (the grouped and the scan gate_up's body)."""
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
        return silu_mul_sums(acc_g, acc_u, DTYPE)

    @triton.jit(do_not_specialize=["T"])  # one compile for every batch size
    def _down_kernel(act_ptr, w_ptr, sw_ptr, y_ptr, sorted_ptr, block_expert_ptr, total_ptr, rw_ptr, sg_ptr,
                     T, H, I, I_s, num_local, sa, swe, swh, sswh, sy, srw, ssg, TOP_K: tl.constexpr,
                     BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, PRECISION: tl.constexpr):
        """Columns [n, n + BLOCK_N) of (act W_down^T) * routing weight for one block of rows of one expert."""
        prior_done()  # (backend.pdl: the kernels before this one have finished)
        pid_n, pid_m = tl.program_id(0), tl.program_id(1)
        rows = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
        e = tl.load(block_expert_ptr + pid_m)  # side by side, as _gate_up_kernel's
        total = tl.load(total_ptr)
        pair = tl.load(sorted_ptr + rows)
        if pid_m * BLOCK_M >= total:
            return
        if e == num_local:
            valid = rows < T
            rw = tl.load(sg_ptr + rows * ssg, mask=valid, other=0.0).to(tl.float32)
            w = sw_ptr
            wh = sswh
            inter = I_s
        else:
            valid = pair >= 0
            rw = tl.load(rw_ptr + (pair // TOP_K).to(tl.int64) * srw + pair % TOP_K, mask=valid,
                         other=0.0).to(tl.float32)
            w = w_ptr + e.to(tl.int64) * swe
            wh = swh
            inter = I
        cols = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
        y = down_tile(act_ptr, rows, valid, rw, w, wh, inter, cols, H, sa, BLOCK_M, BLOCK_N, BLOCK_K, PRECISION,
                      y_ptr.dtype.element_ty)
        tl.store(y_ptr + rows.to(tl.int64)[:, None] * sy + cols[None, :], y,
                 mask=valid[:, None] & (cols < H)[None, :])

    @triton.jit
    def down_tile(act_ptr, rows, valid, rw, w, wh, inter, cols, H, sa, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                  BLOCK_K: tl.constexpr, PRECISION: tl.constexpr, DTYPE: tl.constexpr):
        """(act W_down^T) rounded to DTYPE, times rw (fp32, a row's routing weight), rounded, for act rows `rows`
        (invalid ones read as 0) and output columns cols of one expert's [H, inter] weight at w (rows wh apart): a
        [BLOCK_M, BLOCK_N] tile, by tl.dot over inter in BLOCK_K steps (the grouped and the scan down's body)."""
        cmask = cols < H
        ks = tl.arange(0, BLOCK_K)
        ap = act_ptr + rows.to(tl.int64)[:, None] * sa + ks[None, :]
        wp = w + cols.to(tl.int64)[None, :] * wh + ks[:, None]
        acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
        for k0 in range(0, inter, BLOCK_K):
            kmask = k0 + ks < inter
            a = tl.load(ap + k0, mask=valid[:, None] & kmask[None, :], other=0.0)
            acc = tl.dot(a, tl.load(wp + k0, mask=kmask[:, None] & cmask[None, :], other=0.0), acc,
                         input_precision=PRECISION)
        return (round_to(acc, DTYPE) * rw[:, None]).to(DTYPE)

    @triton.jit(do_not_specialize=["push_slot"])
    def _combine_kernel(y_ptr, inv_ptr, out_ptr, H, sy, so, push_slot, table, rank, region_stride,
                        TOP_K: tl.constexpr, BLOCK_H: tl.constexpr, PUSH: tl.constexpr, P: tl.constexpr):
        """out[t] = sum of token t's routed rows in top-k order, then its shared row (row t), in fp32: a fixed
        order, so no atomics and the same bits on every run. PUSH: the row goes into every rank's inbox instead of
        out_ptr, and the programs empty the boundary before it in this rank's inbox (as _down_combine_kernel)."""
        prior_done()  # (backend.pdl: the kernels before this one have finished)
        t = tl.program_id(0).to(tl.int64)
        cols = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)
        mask = cols < H
        acc = tl.zeros([BLOCK_H], dtype=tl.float32)
        for j in tl.static_range(TOP_K):
            pos = tl.load(inv_ptr + t * TOP_K + j).to(tl.int64)
            hit = cols < tl.where(pos >= 0, H, 0)  # pairs of other ranks' experts add nothing
            acc += tl.load(y_ptr + pos * sy + cols, mask=hit, other=0.0).to(tl.float32)
        acc += tl.load(y_ptr + t * sy + cols, mask=mask, other=0.0).to(tl.float32)
        dt = out_ptr.dtype.element_ty
        if PUSH:
            push.push_rows(acc.to(dt), t, cols, mask, push_slot, table, rank, region_stride, H, P)
            if push_slot > 0:
                push.clear_slot(push_slot - 1, tl.num_programs(0) * H, table, rank, region_stride, P, dt, BLOCK_H)
        else:
            tl.store(out_ptr + t * so + cols, acc.to(dt), mask=mask)
