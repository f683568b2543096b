"""The MoE after the router GEMM in one launch, for a few tokens: routing, gate_up, down and the per-token sum.

    fused_torch / fused_fast   out [T, H] from x [T, H] and the router logits [T, E + 1] (moe_torch's output)

The GEMV path (layers/moe/gemv.py) takes two dependent launches, and at 1-16 tokens each costs its ramp, its
routing before the first weight load and its drain on top of its bytes. Here a program takes one item: a token t,
one of its pairs (a routed slot, or the shared expert), and BLOCK_I rows of that expert's intermediate dimension.
It computes those rows of act = silu(x W_gate^T) * (x W_up^T) (the whole H sum: a few gate and up rows), then
their share of the down GEMV, W_down[:, rows] act[rows], a partial [H] row in fp32: the split of the down GEMV's K
across items gives every SM work at one token. The partial rows meet by counting, not waiting:

- each item stores its partial row, then adds 1 to its pair's counter (an atomic, release and acquire: the
  program's stores before it, after a barrier). The item that brings it to the pair's item count sums the pair's
  partial rows in item order in fp32, rounds, times the pair's weight (routing weight, or sigmoid of the shared
  gate), rounds (down_combine's epilogue), stores the pair's row and adds 1 to its token's counter;
- the pair that brings that to the token's pair count sums the pair rows, routed slots in top-k order then the
  shared one, in fp32, and stores the token's row (or pushes it to every rank's inbox, dist/push.py).

Who sums changes nothing: the order is fixed, so the bits are the same on every run, for any T and grid (a padded
decode batch gives its rows the same bits), and every counter is back at 0 when the launch ends (the last to count
resets it), so a CUDA graph replays it. No program waits for another, so Triton's interpreter, which runs programs
one after another, runs it too. Items of the shared expert come first in the grid: they need no routing.
"""
from __future__ import annotations

import functools

import torch

from dist import push
from layers.backend import round_to, tl, triton
from layers.linear import inbox_args
from layers.mlp import silu_mul_sums
from layers.moe.experts import ExpertWeights
from layers.moe.grouped import experts_torch
from layers.moe.routing import route_torch, top_k_token

FUSED_TILE = dict(BLOCK_I=16, BLOCK_K=256, BLOCK_HD=256, num_warps=4, num_stages=3)  # untuned default
COUNTER_TOKENS = 64  # tokens the counters cover (the fused path serves at most this many: moe.DECODE_MAX_T)


def fused_torch(x: torch.Tensor, logits: torch.Tensor, top_k: int, w: ExpertWeights,
                tile: dict | None = None, partial: bool = False) -> torch.Tensor:
    """route_torch then experts_torch (moe_torch after its router GEMM). tile and partial are the fast kernel's."""
    return experts_torch(x, *route_torch(logits, top_k), w)


@functools.lru_cache(maxsize=None)
def _counters(device: torch.device, top_k: int) -> torch.Tensor:
    """Zeroed int32 counters, a pair's and a token's for COUNTER_TOKENS tokens, shared by every fused launch on the
    device (one stream runs them one after another; each leaves them zero). Made by the first call, eagerly: the
    decode graphs are captured after an eager warm-up of each size."""
    return torch.zeros(COUNTER_TOKENS * (top_k + 2), dtype=torch.int32, device=device)


def fused_fast(x: torch.Tensor, logits: torch.Tensor, top_k: int, w: ExpertWeights, tile: dict | None = None,
               partial: bool = False) -> torch.Tensor | push.Pushed:
    """fused_torch in one launch (the module doc). x [T, H] and logits [T, E + 1] with unit column stride, T <=
    COUNTER_TOKENS. tile: BLOCK_I (intermediate rows an item), BLOCK_K (the H step of its gate and up rows),
    BLOCK_HD (the H step of its down columns), num_warps, num_stages. partial (the output is a layer boundary's
    partial sums), where the inbox takes them: pushed to every rank, and a Pushed is returned."""
    T, H = x.shape
    if T > COUNTER_TOKENS:
        raise ValueError(f"fused_fast serves at most {COUNTER_TOKENS} tokens, got {T}")
    E = logits.shape[1] - 1
    num_local, two_i, _ = w.gate_up.shape
    inter, shared_inter = two_i // 2, w.shared_gate_up.shape[0] // 2
    out = torch.empty(T, H, dtype=x.dtype, device=x.device)
    if T == 0:
        return out
    tile = tile or FUSED_TILE
    block_i = min(tile["BLOCK_I"], triton.next_power_of_2(max(inter, shared_inter)))
    chunks = triton.cdiv(max(inter, shared_inter), block_i)  # items a pair
    pairs = T * (top_k + 1)
    partials = torch.empty(pairs * chunks, H, dtype=torch.float32, device=x.device)
    pair_rows = torch.empty(pairs, H, dtype=x.dtype, device=x.device)
    box = push.pushes((T, H), x.dtype) if partial else None
    slot = box.claim(T) if box is not None else 0
    block_h = triton.next_power_of_2(H)
    _fused_kernel[(pairs * chunks,)](
        x, logits, w.gate_up, w.shared_gate_up, w.down, w.shared_down, partials, pair_rows,
        _counters(x.device, top_k), out, T, H, E, inter, shared_inter, w.start, num_local, x.stride(0),
        logits.stride(0), w.gate_up.stride(0), w.gate_up.stride(1), w.shared_gate_up.stride(0), w.down.stride(0),
        w.down.stride(1), w.shared_down.stride(0), out.stride(0), slot, *inbox_args(box, x.device),
        TOP_K=top_k, K_POW2=triton.next_power_of_2(top_k), BLOCK_E=triton.next_power_of_2(E), CHUNKS=chunks,
        CHUNKS_POW2=triton.next_power_of_2(chunks), K1_POW2=triton.next_power_of_2(top_k + 1),
        BLOCK_I=block_i, BLOCK_K=min(tile["BLOCK_K"], block_h), BLOCK_HD=min(tile["BLOCK_HD"], block_h),
        ALL_LOCAL=w.start == 0 and num_local == E,
        TOKEN_COUNTERS=COUNTER_TOKENS * (top_k + 1), NUM_STAGES=tile["num_stages"], PUSH=box is not None,
        P=box.world if box is not None else 1, num_warps=tile["num_warps"])
    return push.Pushed(box, slot, out.shape, out.dtype) if box is not None else out


if triton is not None:
    @triton.jit(do_not_specialize=["T", "push_slot"])  # one compile for every batch size
    def _fused_kernel(x_ptr, logits_ptr, w_ptr, sw_ptr, wd_ptr, swd_ptr, part_ptr, pair_ptr, cnt_ptr, out_ptr, T, H,
                      E, I, I_s, start, num_local, sx, sl, swe, swn, sswn, sde, sdh, ssdh, so, push_slot, table,
                      rank, region_stride, TOP_K: tl.constexpr, K_POW2: tl.constexpr, BLOCK_E: tl.constexpr,
                      CHUNKS: tl.constexpr, CHUNKS_POW2: tl.constexpr, K1_POW2: tl.constexpr,
                      BLOCK_I: tl.constexpr, BLOCK_K: tl.constexpr, BLOCK_HD: tl.constexpr,
                      ALL_LOCAL: tl.constexpr, TOKEN_COUNTERS: tl.constexpr, NUM_STAGES: tl.constexpr,
                      PUSH: tl.constexpr, P: tl.constexpr):
        """Item q: the shared expert's items first (token q // CHUNKS), then token t's slot s, chunk c. Pair
        index t * (TOP_K + 1) + s, the shared expert's s = TOP_K; partial row pair * CHUNKS + c. Counters: the
        pairs', then from TOKEN_COUNTERS the tokens'."""
        q = tl.program_id(0)
        dt = out_ptr.dtype.element_ty
        if PUSH:
            if push_slot > 0:  # empty the boundary before this one in my inbox (dist/push.py), shared by the grid
                push.clear_slot(push_slot - 1, T * H, table, rank, region_stride, P, dt, 1024)
        shared = q < T * CHUNKS
        r = tl.where(shared, q, q - T * CHUNKS)
        t = tl.where(shared, r // CHUNKS, r // (TOP_K * CHUNKS)).to(tl.int64)
        s = tl.where(shared, TOP_K, (r // CHUNKS) % TOP_K)
        c = r % CHUNKS
        k_slots = tl.arange(0, K_POW2)
        # the token's routing: every routed item's, and where ranks hold whole experts every item's (which slots
        # are this rank's sets the token's pair count); the shared expert's items need none where all are local
        if ALL_LOCAL:
            n_pairs = TOP_K + 1
            local = k_slots < TOP_K
            ids = tl.zeros([K_POW2], dtype=tl.int32)
            rw = tl.zeros([K_POW2], dtype=tl.float32)
            if q >= T * CHUNKS:
                ids, rw = top_k_token(logits_ptr, t, E, sl, TOP_K, K_POW2, BLOCK_E)
        else:
            ids, rw = top_k_token(logits_ptr, t, E, sl, TOP_K, K_POW2, BLOCK_E)
            local = (k_slots < TOP_K) & (ids - start >= 0) & (ids - start < num_local)
            n_pairs = tl.sum(local.to(tl.int32), 0) + 1
        pick = k_slots == s
        e = tl.sum(tl.where(pick, ids - start, 0), 0).to(tl.int64)
        mine = shared | (tl.sum((pick & local).to(tl.int32), 0) > 0)
        if mine:
            if shared:
                weight = round_to(tl.sigmoid(tl.load(logits_ptr + t * sl + E).to(tl.float32)), dt)
                width = I_s
                up_ptr = sw_ptr
                srow = sswn
                down_ptr = swd_ptr
                sdrow = ssdh
            else:
                weight = round_to(tl.sum(tl.where(pick, rw, 0.0), 0), dt)
                width = I
                up_ptr = w_ptr + e * swe
                srow = swn
                down_ptr = wd_ptr + e * sde
                sdrow = sdh
            rows = c * BLOCK_I + tl.arange(0, BLOCK_I)
            rmask = rows < width
            # act[rows]: BLOCK_I gate rows and up rows over H, in a loop Triton software-pipelines
            ks = tl.arange(0, BLOCK_K)
            gp = up_ptr + rows.to(tl.int64)[:, None] * srow + ks[None, :]
            upp = up_ptr + (rows + width).to(tl.int64)[:, None] * srow + ks[None, :]
            acc_g = tl.zeros([BLOCK_I], dtype=tl.float32)
            acc_u = tl.zeros([BLOCK_I], dtype=tl.float32)
            for k0 in tl.range(0, H, BLOCK_K, num_stages=NUM_STAGES):
                kmask = k0 + ks < H
                a = tl.load(x_ptr + t * sx + k0 + ks, mask=kmask, other=0.0).to(tl.float32)
                m = rmask[:, None] & kmask[None, :]
                acc_g += tl.sum(tl.load(gp + k0, mask=m, other=0.0).to(tl.float32) * a[None, :], 1)
                acc_u += tl.sum(tl.load(upp + k0, mask=m, other=0.0).to(tl.float32) * a[None, :], 1)
            act = silu_mul_sums(acc_g, acc_u, dt).to(tl.float32)  # rows past width: silu(0) * 0 = 0
            # their share of the down GEMV, W_down[:, rows] act[rows], H columns BLOCK_HD at a time
            pair = t * (TOP_K + 1) + s
            hs = tl.arange(0, BLOCK_HD)
            dp = down_ptr + hs.to(tl.int64)[:, None] * sdrow + rows[None, :]
            prow = part_ptr + (pair * CHUNKS + c) * H + hs
            for h0 in tl.range(0, H, BLOCK_HD, num_stages=NUM_STAGES):
                hmask = h0 + hs < H
                wd = tl.load(dp + h0 * sdrow, mask=hmask[:, None] & rmask[None, :], other=0.0).to(tl.float32)
                tl.store(prow + h0, tl.sum(wd * act[None, :], 1), mask=hmask)
            tl.debug_barrier()  # every thread's partial stores before the count (its release publishes them)
            if tl.atomic_add(cnt_ptr + pair, 1, sem="acq_rel", scope="gpu") == CHUNKS - 1:
                # the pair's last item: its row, from the partial rows in item order
                tl.atomic_xchg(cnt_ptr + pair, 0, sem="relaxed", scope="gpu")
                # (all of a column block's partial rows loaded at once, one memory round trip a block)
                cs = tl.arange(0, CHUNKS_POW2)
                first = part_ptr + (pair * CHUNKS + cs)[:, None] * H + hs[None, :]
                for h0 in tl.range(0, H, BLOCK_HD, num_stages=NUM_STAGES):
                    hmask = h0 + hs < H
                    parts = tl.load(first + h0, mask=(cs < CHUNKS)[:, None] & hmask[None, :], other=0.0,
                                    cache_modifier=".cg")
                    tl.store(pair_ptr + pair * H + h0 + hs,
                             round_to(round_to(tl.sum(parts, 0), dt) * weight, dt).to(dt), mask=hmask)
                tl.debug_barrier()
                tok = cnt_ptr + TOKEN_COUNTERS + t
                if tl.atomic_add(tok, 1, sem="acq_rel", scope="gpu") == n_pairs - 1:
                    # the token's last pair: its row, routed slots in top-k order, then the shared expert
                    tl.atomic_xchg(tok, 0, sem="relaxed", scope="gpu")
                    js = tl.arange(0, K1_POW2)  # slot j's row; the shared expert's at j = TOP_K
                    keep = (js == TOP_K) | (tl.sum((local[None, :] & (k_slots[None, :] == js[:, None])).to(tl.int32),
                                                   1) > 0)
                    base = pair_ptr + (t * (TOP_K + 1) + js)[:, None] * H + hs[None, :]
                    for h0 in tl.range(0, H, BLOCK_HD, num_stages=NUM_STAGES):
                        hmask = h0 + hs < H
                        y = tl.sum(tl.load(base + h0, mask=keep[:, None] & hmask[None, :], other=0.0,
                                           cache_modifier=".cg").to(tl.float32), 0)
                        if PUSH:
                            push.push_rows(y.to(dt), t, h0 + hs, hmask, push_slot, table, rank, region_stride, H, P)
                        else:
                            tl.store(out_ptr + t * so + h0 + hs, y.to(dt), mask=hmask)

