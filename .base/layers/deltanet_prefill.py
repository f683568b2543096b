"""DeltaNet prefill over a packed varlen batch (spec §3.2, issue #9): the causal depthwise conv with a cached tail and
the chunked gated delta rule with an fp32 state, both reading and writing their caches in place by state slot.

The packed batch holds B sequences delimited by `cu_seqlens` [B+1] (int32); sequence b continues from its cached
state (conv tail, recurrent state) in slot `slots[b]` when `start_pos[b] > 0` and from zeros otherwise, and leaves
its final state in the same slot. Decodes in a mixed step are simply sequences of one token.

Each operation has a torch oracle (`<op>_torch`, per-sequence loop, host sync) and a Triton version (`<op>_fast`,
one grid over the whole batch, no host sync, no per-sequence loop) with the same signature.

Checkpoints (the prefix cache of issue #9): `checkpoints` is an optional int64 tensor [n, 3] of rows
(sequence index b, absolute position p, destination slot): the state after the sequence's first p tokens
(p counts the cached start_pos tokens too) is also written to the destination slot. For the delta rule p - start_pos
must be a multiple of the chunk or the sequence's end; for the conv any p in (start_pos, start_pos + len]. A
destination must not be the slot of a sequence in the batch. Without checkpoints the kernels compile without them.

Chunked delta rule (Gated DeltaNet, UT/WY form), per sequence, value head and chunk of C tokens with
cumulative log decay G (from the chunk start), keys k (l2-normalised), queries q (l2-normalised and scaled):
    A = strict_lower(diag(beta) K K^T * exp(G_i - G_j));  T = (I + A)^-1          (in-chunk triangular solve)
    W = T (diag(beta exp(G)) K);  U = T (diag(beta) V)                             (no dependency on the state)
    V' = U - W S;  O = diag(exp(G)) Q S + (Q K^T * exp(G_i - G_j))_causal V';  S = exp(G_C) S + (exp(G_C - G) K)^T V'
The fast path runs it as three kernels (the split of flash-linear-attention's chunked kernels, our own code):
  prep    one program per (chunk, value head), all chunks in parallel: W and U; A through a scratch [N, Hv, CHUNK],
          the solve by row blocks of CHUNK/4 (diagonal inverses by forward substitution, the rest by block
          products), T written over A and read back for two full-size dots;
  state   one program per (sequence, value head, block of value columns), the only sequential part: the state
          [dk, BV] stays in registers across the chunks; it saves the state at each chunk start (h, fp32) and
          turns U into V' in place;
  output  one program per (chunk, value head), all chunks in parallel again: O from Q, K, G, h and V'.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from layers.backend import pdl, prior_done, round_to, tl, triton
from layers.varlen import block_of, seq_tile

CHUNK = 64          # tokens per chunk of the delta rule
L2_EPS = 1e-6       # q, k l2-norm: x * rsqrt(sum x^2 + eps), fp32
# Launch settings of the fast path (module level so that benchmarks can sweep them; the signatures stay equal).
# precision: tl.dot input precision of the state and output kernels ("tf32", "tf32x3" or "ieee"); precision_prep:
# that of the prep kernel's products W = T X, U = T Y; precision_solve: that of its K K^T and triangular solve
# ("tf32x3": three tf32 products, about fp32's accuracy on the tensor cores; "ieee" runs them on the FMA units).
# block_v / block_v_out: value columns per state program / per step of an output program; stages: the state
# kernel's software pipelining (the next chunk's W, U and K load while this one computes).
# Defaults: the best of `python -m benchmarks.bench_deltanet_prefill --sweep` on 1x H200 (2026-11-24, 8 x 1024
# tokens at TP=1: delta rule 1.28 ms per layer, conv 0.27 ms); the conv's 32 x 128 tiles, 4 warps, from a sweep of
# the conv with its tail-free path past the first block (2026-11-25: 0.18 ms).
FAST_CONFIG = {"conv_block_t": 32, "conv_block_c": 128, "block_v": 64, "block_v_out": 32, "warps_prep": 4,
               "warps_state": 4, "warps_out": 4, "stages": 2, "precision": "tf32", "precision_prep": "tf32",
               "precision_solve": "tf32x3", "warps_conv": 4}
# Per-step quantities stay out of the kernels' compile keys, so that a step of any make-up (sequences, checkpoints,
# where its metadata rows start) runs kernels compiled at start: Triton compiles anew for each new constexpr value
# and specialises integer arguments (== 1, divisible by 16) and pointers (16-byte aligned) unless told not to; a
# compile costs ~1 s in the middle of serving (2026-11-25). The per-step integers and metadata pointers are
# do_not_specialize (METADATA); the tiles over sequences (varlen.seq_tile) and checkpoints have floors that cover
# the usual step (beyond them, the warm-up meets each power of two).
METADATA = ["cu_ptr", "start_ptr", "slots_ptr", "ck_ptr", "n_ck", "B"]
CKPT_TILE = 64      # BLOCK_CK floor: one variant up to 64 checkpoints in a step


def _ckpt_tile(n_ck: int) -> int:
    return max(CKPT_TILE, triton.next_power_of_2(max(n_ck, 1)))


# ------------------------------------------------------------------------------------------------ torch oracles
def causal_conv1d_varlen_torch(u: torch.Tensor, cu_seqlens: torch.Tensor, start_pos: torch.Tensor,
                               conv_state: torch.Tensor, slots: torch.Tensor, weight: torch.Tensor,
                               checkpoints: torch.Tensor | None = None) -> torch.Tensor:
    """silu(causal depthwise conv) of the packed inputs u [N, C] -> [N, C] in u's dtype; updates the tails in place.

    conv_state [slots, C, K-1] holds each sequence's last K-1 raw inputs (oldest first); weight [C, 1, K], tap K-1
    on the current token. The conv is accumulated in fp32 and rounded to the model dtype before the SiLU, as the
    decode kernel does."""
    K = weight.shape[-1]
    w = weight[:, 0, :].float()
    out = torch.empty(u.shape, dtype=u.dtype, device=u.device)
    bounds, starts, slot_ids = cu_seqlens.tolist(), start_pos.tolist(), slots.tolist()
    marks = _checkpoints_by_seq(checkpoints)
    for b, slot in enumerate(slot_ids):
        lo, hi = bounds[b], bounds[b + 1]
        tail = conv_state[slot] if starts[b] > 0 else torch.zeros_like(conv_state[slot])
        seq = torch.cat([tail, u[lo:hi].t()], dim=1)                 # [C, K-1 + n], oldest first
        x = seq.float()
        acc = torch.zeros(x.shape[0], hi - lo, dtype=torch.float32, device=u.device)
        for j in range(K):                                           # the kernel's summation order
            acc = acc + x[:, j:j + hi - lo] * w[:, j:j + 1]
        y = acc.to(u.dtype).float()
        out[lo:hi] = F.silu(y).to(u.dtype).t()
        for pos, dst in marks.get(b, ()):
            rel = pos - starts[b]
            conv_state[dst] = seq[:, rel:rel + K - 1]
        conv_state[slot] = seq[:, seq.shape[1] - (K - 1):]
    return out


def chunk_delta_rule_varlen_torch(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor,
                                  beta: torch.Tensor, cu_seqlens: torch.Tensor, start_pos: torch.Tensor,
                                  ssm_state: torch.Tensor, slots: torch.Tensor, scale: float,
                                  checkpoints: torch.Tensor | None = None, chunk: int = CHUNK) -> torch.Tensor:
    """Gated delta rule over the packed batch -> o [N, Hv, dv] in v's dtype; final states written to ssm_state.

    q, k [N, Hk, dk]: raw conv outputs (this op l2-normalises them in fp32 and scales q by `scale`);
    v [N, Hv, dv]; g (log decay, <= 0) and beta [N, Hv]; value head j reads qk head j // (Hv / Hk);
    ssm_state [slots, Hv, dk, dv] fp32."""
    Hv = v.shape[1]
    rep = Hv // q.shape[1]
    out = torch.empty(v.shape, dtype=v.dtype, device=v.device)
    bounds, starts, slot_ids = cu_seqlens.tolist(), start_pos.tolist(), slots.tolist()
    marks = _checkpoints_by_seq(checkpoints)
    for b, slot in enumerate(slot_ids):
        lo, hi = bounds[b], bounds[b + 1]
        qs = (l2norm(q[lo:hi].float()) * scale).repeat_interleave(rep, dim=1)
        ks = l2norm(k[lo:hi].float()).repeat_interleave(rep, dim=1)
        vs, gs, bs = v[lo:hi].float(), g[lo:hi].float(), beta[lo:hi].float()
        state = ssm_state[slot].clone() if starts[b] > 0 else torch.zeros_like(ssm_state[slot])
        done = 0
        # chunks start at the sequence's first new token, so splitting at checkpoints keeps the same chunks
        for end, dst in sorted(marks.get(b, ())) + [(starts[b] + hi - lo, None)]:
            end -= starts[b]
            sl = slice(done, end)
            o, state = chunked_gated_delta_rule(qs[sl], ks[sl], vs[sl], gs[sl], bs[sl], state, chunk)
            out[lo + done:lo + end] = o.to(v.dtype)
            if dst is not None:
                ssm_state[dst] = state
            done = end
        ssm_state[slot] = state
    return out


def l2norm(x: torch.Tensor, eps: float = L2_EPS) -> torch.Tensor:
    return x * torch.rsqrt((x * x).sum(-1, keepdim=True) + eps)


def chunked_gated_delta_rule(q, k, v, g, beta, state, chunk):
    """One sequence, fp32, per value head: q, k [n, H, dk], v [n, H, dv], g, beta [n, H], state [H, dk, dv].
    Returns (o [n, H, dv], final state); chunk by chunk in the UT form of the module docstring."""
    out = torch.empty_like(v)
    for c0 in range(0, q.shape[0], chunk):
        sl = slice(c0, c0 + chunk)
        qc, kc, vc = (x[sl].transpose(0, 1) for x in (q, k, v))        # [H, n, d]
        gc, bc = g[sl].t().cumsum(-1), beta[sl].t()                    # [H, n]
        n = gc.shape[-1]
        causal = torch.ones(n, n, dtype=torch.bool, device=q.device).tril()
        decay = (gc[:, :, None] - gc[:, None, :]).masked_fill(~causal, float("-inf")).exp()
        system = (kc @ kc.transpose(1, 2)) * decay * bc[:, :, None]    # its diagonal is ignored (unit triangular)
        wc = torch.linalg.solve_triangular(system, kc * (bc * gc.exp())[..., None], upper=False, unitriangular=True)
        uc = torch.linalg.solve_triangular(system, vc * bc[..., None], upper=False, unitriangular=True)
        v_new = uc - wc @ state
        o = (qc * gc.exp()[..., None]) @ state + ((qc @ kc.transpose(1, 2)) * decay) @ v_new
        out[sl] = o.transpose(0, 1)
        state = state * gc[:, -1:, None].exp() + (kc * (gc[:, -1:] - gc).exp()[..., None]).transpose(1, 2) @ v_new
    return out, state


def _checkpoints_by_seq(checkpoints: torch.Tensor | None) -> dict[int, list[tuple[int, int]]]:
    marks: dict[int, list[tuple[int, int]]] = {}
    for b, pos, dst in ([] if checkpoints is None else checkpoints.tolist()):
        marks.setdefault(b, []).append((pos, dst))
    return marks


# ------------------------------------------------------------------------------------------------ fast path
def causal_conv1d_varlen_fast(u: torch.Tensor, cu_seqlens: torch.Tensor, start_pos: torch.Tensor,
                              conv_state: torch.Tensor, slots: torch.Tensor, weight: torch.Tensor,
                              checkpoints: torch.Tensor | None = None) -> torch.Tensor:
    """causal_conv1d_varlen_torch in one launch: programs over (sequence-aligned token block, channel block); the
    first block of each sequence reads the cached tail and writes the new one (and the checkpoint tails)."""
    N, C = u.shape
    K = weight.shape[-1]
    B = cu_seqlens.numel() - 1
    out = torch.empty((N, C), dtype=u.dtype, device=u.device)
    cfg = FAST_CONFIG
    block_t = max(cfg["conv_block_t"], triton.next_power_of_2(K - 1))  # the first block must cover the tail reads
    if B == 0:
        return out
    ck, n_ck = _checkpoint_arg(checkpoints, slots)
    grid = (triton.cdiv(N, block_t) + B, triton.cdiv(C, cfg["conv_block_c"]))
    _conv_varlen_kernel[grid](
        u, cu_seqlens, start_pos, conv_state, slots, weight, out, ck, n_ck, B, C,
        u.stride(0), u.stride(1), conv_state.stride(0), conv_state.stride(1), conv_state.stride(2),
        weight.stride(0), weight.stride(2), out.stride(0),
        KERNEL=K, BLOCK_T=block_t, BLOCK_C=cfg["conv_block_c"], BLOCK_B=seq_tile(B),
        BLOCK_K1=triton.next_power_of_2(K - 1), HAS_CKPT=n_ck > 0, num_warps=cfg["warps_conv"], **pdl())
    return out


def chunk_delta_rule_varlen_fast(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor,
                                 beta: torch.Tensor, cu_seqlens: torch.Tensor, start_pos: torch.Tensor,
                                 ssm_state: torch.Tensor, slots: torch.Tensor, scale: float,
                                 checkpoints: torch.Tensor | None = None, chunk: int = CHUNK) -> torch.Tensor:
    """chunk_delta_rule_varlen_torch in three launches: W/U per chunk in parallel, the state recurrence (the only
    sequential part, per sequence), then the outputs per chunk in parallel from the states at the chunk starts.
    Head dims of any size: the kernels' blocks span the next power of two (at least 16, tl.dot's minimum), masked
    past dk and dv, and the scratch is laid out padded (W's columns past dk, U's past dv and h's rows past dk: 0).
    The chunk is 64 or 128 (four row blocks of >= 16)."""
    N, Hk, dk = q.shape
    Hv, dv = v.shape[1], v.shape[2]
    B = cu_seqlens.numel() - 1
    out = torch.empty((N, Hv, dv), dtype=v.dtype, device=v.device)
    if B == 0:
        return out
    if chunk not in (64, 128):
        raise ValueError(f"the fast delta rule takes chunks of 64 or 128 tokens, got {chunk}")
    BK, BV_PAD = (max(16, triton.next_power_of_2(d)) for d in (dk, dv))  # the padded head dims
    q, k, v, g, beta = (x if x.stride(-1) == 1 else x.contiguous() for x in (q, k, v, g, beta))
    cfg = FAST_CONFIG
    chunks = triton.cdiv(N, chunk) + B          # an upper bound of the chunks in the pack (a shape: no sync)
    block_b = seq_tile(B)
    w = torch.empty((N, Hv, BK), dtype=torch.float32, device=v.device)
    u = torch.empty((N, Hv, BV_PAD), dtype=torch.float32, device=v.device)  # U, then V' in place
    h = torch.empty((chunks, Hv, BK, BV_PAD), dtype=torch.float32, device=v.device)  # state at each chunk start
    scr = torch.empty((N, Hv, chunk), dtype=torch.float32, device=v.device)  # each chunk's A, then T
    _prep_kernel[(chunks, Hv)](
        k, v, g, beta, cu_seqlens, w, u, scr, B, k.stride(0), k.stride(1), v.stride(0), v.stride(1), g.stride(0),
        beta.stride(0), w.stride(0), w.stride(1), u.stride(0), u.stride(1), scr.stride(0), scr.stride(1),
        REP=Hv // Hk, DK=dk, DV=dv, BK=BK, BV_PAD=BV_PAD, CHUNK=chunk, BLOCK_B=block_b,
        SOLVE=cfg["precision_solve"], PRECISION=cfg["precision_prep"], num_warps=cfg["warps_prep"], **pdl())
    ck, n_ck = _checkpoint_arg(checkpoints, slots)
    block_v = min(cfg["block_v"], BV_PAD)
    st = ssm_state
    _state_kernel[(B, Hv, triton.cdiv(dv, block_v))](
        k, g, w, u, cu_seqlens, start_pos, slots, st, h, ck, n_ck, B,
        k.stride(0), k.stride(1), g.stride(0), w.stride(0), w.stride(1), u.stride(0), u.stride(1),
        st.stride(0), st.stride(1), st.stride(2), h.stride(0), h.stride(1),
        REP=Hv // Hk, DK=dk, DV=dv, BK=BK, BV_PAD=BV_PAD, BV=block_v, CHUNK=chunk, BLOCK_B=block_b,
        BLOCK_CK=_ckpt_tile(n_ck), HAS_CKPT=n_ck > 0, PRECISION=cfg["precision"],
        STAGES=cfg["stages"], num_warps=cfg["warps_state"], **pdl())
    _output_kernel[(chunks, Hv)](
        q, k, g, u, h, cu_seqlens, out, B, q.stride(0), q.stride(1), k.stride(0), k.stride(1), g.stride(0),
        u.stride(0), u.stride(1), h.stride(0), h.stride(1), out.stride(0), out.stride(1), scale,
        REP=Hv // Hk, DK=dk, DV=dv, BK=BK, BV_PAD=BV_PAD, BV=min(cfg["block_v_out"], BV_PAD), CHUNK=chunk,
        BLOCK_B=block_b,
        PRECISION=cfg["precision"], num_warps=cfg["warps_out"], **pdl())
    return out


def _checkpoint_arg(checkpoints: torch.Tensor | None, placeholder: torch.Tensor):
    """(int64 [n, 3] contiguous, n); with none, a placeholder pointer that the kernels never read."""
    if checkpoints is None or checkpoints.numel() == 0:
        return placeholder, 0
    return checkpoints.to(torch.int64).contiguous(), checkpoints.shape[0]


if triton is not None:
    @triton.jit
    def _conv_inputs(u_ptr, tail, lo, p, n, oldest, c, cmask, su_t, su_c, ss_k, KERNEL: tl.constexpr):
        """Raw inputs [len(p), BLOCK_C] at positions p relative to the sequence's first new token: new tokens for
        p >= 0, the cached tail for p < 0 (zeros for a fresh sequence)."""
        new = (p >= 0) & (p < n)
        old = (p < 0) & (p >= oldest)
        x = tl.load(u_ptr + (lo + p).to(tl.int64)[:, None] * su_t + c[None, :] * su_c,
                    mask=new[:, None] & cmask[None, :], other=0.0)
        x_old = tl.load(tail[None, :] + (KERNEL - 1 + p)[:, None] * ss_k, mask=old[:, None] & cmask[None, :],
                        other=0.0)
        return tl.where(new[:, None], x, x_old)

    @triton.jit(do_not_specialize=METADATA)
    def _conv_varlen_kernel(u_ptr, cu_ptr, start_ptr, state_ptr, slots_ptr, w_ptr, out_ptr, ck_ptr, n_ck, B, C,
                            su_t, su_c, ss_slot, ss_c, ss_k, sw_c, sw_k, so_t,
                            KERNEL: tl.constexpr, BLOCK_T: tl.constexpr, BLOCK_C: tl.constexpr,
                            BLOCK_B: tl.constexpr, BLOCK_K1: tl.constexpr, HAS_CKPT: tl.constexpr):
        """silu(conv) for BLOCK_T tokens x BLOCK_C channels of one sequence. Only a sequence's first block reads
        its cached tail (BLOCK_T >= K-1), so it alone rewrites the tail, after a barrier that orders the reads of
        all its threads before the writes."""
        prior_done()  # (backend.pdl: the kernels before this one have finished)
        b, blk = block_of(cu_ptr, tl.program_id(0), B, BLOCK_T, BLOCK_B, True)
        if b >= B:
            return
        c = tl.program_id(1) * BLOCK_C + tl.arange(0, BLOCK_C)
        cmask = c < C
        lo = tl.load(cu_ptr + b)
        n = tl.load(cu_ptr + b + 1) - lo
        start = tl.load(start_ptr + b)
        oldest = (start > 0).to(tl.int32) * (1 - KERNEL)  # first readable tail position: -(K-1), or 0 when fresh
        tail = state_ptr + tl.load(slots_ptr + b).to(tl.int64) * ss_slot + c * ss_c
        i = blk * BLOCK_T + tl.arange(0, BLOCK_T)
        acc = tl.zeros([BLOCK_T, BLOCK_C], dtype=tl.float32)
        if blk == 0:
            for j in tl.static_range(KERNEL):
                xin = _conv_inputs(u_ptr, tail, lo, i - (KERNEL - 1) + j, n, oldest, c, cmask, su_t, su_c, ss_k,
                                   KERNEL)
                wj = tl.load(w_ptr + c * sw_c + j * sw_k, mask=cmask, other=0.0).to(tl.float32)
                acc += xin.to(tl.float32) * wj[None, :]
        else:  # past the first block every input is a new token (i - (K-1) >= BLOCK_T - (K-1) >= 0): no tail
            src = u_ptr + (lo + i - (KERNEL - 1)).to(tl.int64)[:, None] * su_t + c[None, :] * su_c
            live = (i < n)[:, None] & cmask[None, :]
            for j in tl.static_range(KERNEL):
                wj = tl.load(w_ptr + c * sw_c + j * sw_k, mask=cmask, other=0.0).to(tl.float32)
                acc += tl.load(src + j * su_t, mask=live, other=0.0).to(tl.float32) * wj[None, :]
        y = round_to(acc, out_ptr.dtype.element_ty)
        rows = (lo + i).to(tl.int64)
        tl.store(out_ptr + rows[:, None] * so_t + c[None, :], (y * tl.sigmoid(y)).to(out_ptr.dtype.element_ty),
                 mask=(i < n)[:, None] & cmask[None, :])
        if blk == 0:
            jj = tl.arange(0, BLOCK_K1)
            jmask = (jj < KERNEL - 1)[:, None] & cmask[None, :]
            if HAS_CKPT:
                for e in range(n_ck):
                    rows_k = (tl.load(ck_ptr + 3 * e) == b).to(tl.int32) * (KERNEL - 1)  # 0: not this sequence's
                    rel = tl.load(ck_ptr + 3 * e + 1) - start
                    dst = state_ptr + tl.load(ck_ptr + 3 * e + 2) * ss_slot + c * ss_c
                    ck = _conv_inputs(u_ptr, tail, lo, rel - (KERNEL - 1) + jj, n, oldest, c, cmask,
                                      su_t, su_c, ss_k, KERNEL)
                    tl.store(dst[None, :] + jj[:, None] * ss_k, ck, mask=(jj < rows_k)[:, None] & cmask[None, :])
            last = _conv_inputs(u_ptr, tail, lo, n - (KERNEL - 1) + jj, n, oldest, c, cmask, su_t, su_c, ss_k,
                                KERNEL)
            tl.debug_barrier()
            tl.store(tail[None, :] + jj[:, None] * ss_k, last, mask=jmask)

    @triton.jit
    def _diag_inverses_t(scr, s_row, n, BLK: tl.constexpr):
        """Transposes of (I + D_r)^-1 for the four strictly lower diagonal blocks D_r [BLK, BLK] of a chunk's A,
        whose rows lie in scratch (A_ij at scr + i * s_row + j; rows >= n are padding, read as 0).
        Forward substitution on X = T^T, column by column: X[:, i] = e_i - X D[i, :]^T (the columns not yet built
        are identity columns and meet D_ij = 0, j >= i). Row i of D comes from memory straight into the layout of
        the broadcast, and each step reduces along a row (within a warp), not across warps."""
        ii = tl.arange(0, BLK)
        eye = tl.where(ii[:, None] == ii[None, :], 1.0, 0.0)
        x0, x1, x2, x3 = eye, eye, eye, eye
        for i in range(1, BLK):
            e_i = tl.where(ii == i, 1.0, 0.0)
            at_i = ii[None, :] == i
            row = tl.zeros([BLK], dtype=tl.int32) + i  # a tensor: the interpreter takes no scalar mask
            d0 = tl.load(scr + i * s_row + ii, mask=row < n, other=0.0)
            d1 = tl.load(scr + (BLK + i) * s_row + BLK + ii, mask=row + BLK < n, other=0.0)
            d2 = tl.load(scr + (2 * BLK + i) * s_row + 2 * BLK + ii, mask=row + 2 * BLK < n, other=0.0)
            d3 = tl.load(scr + (3 * BLK + i) * s_row + 3 * BLK + ii, mask=row + 3 * BLK < n, other=0.0)
            x0 = tl.where(at_i, (e_i - tl.sum(x0 * d0[None, :], 1))[:, None], x0)
            x1 = tl.where(at_i, (e_i - tl.sum(x1 * d1[None, :], 1))[:, None], x1)
            x2 = tl.where(at_i, (e_i - tl.sum(x2 * d2[None, :], 1))[:, None], x2)
            x3 = tl.where(at_i, (e_i - tl.sum(x3 * d3[None, :], 1))[:, None], x3)
        return x0, x1, x2, x3

    @triton.jit
    def _within(rows, cols, D: tl.constexpr, PAD: tl.constexpr):
        """The mask rows[:, None] of a [rows, PAD] block, and cols < D where the block is padded past D (PAD > D);
        at PAD == D the row mask alone, so that a power-of-two head dim compiles as it did before padding."""
        if PAD == D:
            return rows[:, None]
        else:
            return rows[:, None] & (cols < D)[None, :]

    @triton.jit
    def _dot_p(a, b, PRECISION: tl.constexpr):
        return tl.dot(a, b, input_precision=PRECISION)

    @triton.jit
    def _block(scr, s_row, n, r, s, BLK: tl.constexpr):
        """Block (r, s) [BLK, BLK] of the chunk matrix in scratch (rows >= n read as 0)."""
        ii = tl.arange(0, BLK)
        rows = r * BLK + ii
        return tl.load(scr + rows[:, None] * s_row + s * BLK + ii[None, :], mask=(rows < n)[:, None], other=0.0)

    @triton.jit
    def _store_block(scr, s_row, n, r, s, x, BLK: tl.constexpr):
        ii = tl.arange(0, BLK)
        rows = r * BLK + ii
        tl.store(scr + rows[:, None] * s_row + s * BLK + ii[None, :], x, mask=(rows < n)[:, None])

    @triton.jit(do_not_specialize=METADATA)
    def _prep_kernel(k_ptr, v_ptr, g_ptr, beta_ptr, cu_ptr, w_ptr, u_ptr, scr_ptr, B,
                     sk_t, sk_h, sv_t, sv_h, sg_t, sb_t, sw_t, sw_h, su_t, su_h, ss_t, ss_h,
                     REP: tl.constexpr, DK: tl.constexpr, DV: tl.constexpr, BK: tl.constexpr, BV_PAD: tl.constexpr,
                     CHUNK: tl.constexpr, BLOCK_B: tl.constexpr, SOLVE: tl.constexpr, PRECISION: tl.constexpr):
        """W and U of one (chunk, value head): the state-independent part of the chunk, all chunks in parallel.
        A = strict_lower(diag(beta) K K^T * exp(G_i - G_j)) from one dot goes through this program's scratch
        rows scr [N, Hv, CHUNK] (registers cannot be sliced); T = (I + A)^-1 by row blocks of BLK = CHUNK / 4
        (diagonal inverses by forward substitution, then T_rs = -T_rr sum_{s<=j<r} A_rj T_js, dots of SOLVE) is
        written over it, read back whole (blocks above the diagonal as 0), and W = T diag(beta exp(G)) K and
        U = T diag(beta) V are two full-size dots. K K^T of the l2-normalised keys is diag(r) (K_raw K_raw^T) diag(r)
        (r the inverse norms): from the model's bf16 keys the products are exact and summed in fp32 by one bf16
        MMA, where the normalised fp32 keys needed three tf32 ones (tf32x3) for the same accuracy (the prep
        kernel 743 -> 455 us at 8 x 1024 tokens, 1x H200, 2026-11-25; the output kernel's Q K^T likewise)."""
        prior_done()  # (backend.pdl: the kernels before this one have finished)
        BLK: tl.constexpr = CHUNK // 4
        b, ci = block_of(cu_ptr, tl.program_id(0), B, CHUNK, BLOCK_B, False)
        if b >= B:
            return
        h = tl.program_id(1)
        t0 = tl.load(cu_ptr + b) + ci * CHUNK
        n = tl.minimum(tl.load(cu_ptr + b + 1) - t0, CHUNK)
        rows = tl.arange(0, CHUNK)
        valid = rows < n
        t = (t0 + rows).to(tl.int64)
        kk = tl.arange(0, BK)
        k_raw = tl.load(k_ptr + t[:, None] * sk_t + (h // REP) * sk_h + kk[None, :], mask=_within(valid, kk, DK, BK),
                        other=0.0)
        k = k_raw.to(tl.float32)
        r = tl.rsqrt(tl.sum(k * k, 1) + 1e-6)
        k = k * r[:, None]
        g = tl.load(g_ptr + t * sg_t + h, mask=valid, other=0.0).to(tl.float32)
        beta = tl.load(beta_ptr + t * sb_t + h, mask=valid, other=0.0).to(tl.float32)
        gc = tl.cumsum(g, 0)
        lower = rows[:, None] > rows[None, :]
        A = _dot_p(k_raw, tl.trans(k_raw), SOLVE) * (r * beta)[:, None] * r[None, :] * \
            tl.exp(tl.where(lower, gc[:, None] - gc[None, :], float("-inf")))
        scr = scr_ptr + t0.to(tl.int64) * ss_t + h * ss_h
        tile = scr + rows[:, None] * ss_t + rows[None, :]
        tl.store(tile, A, mask=valid[:, None])
        tl.debug_barrier()  # every thread's rows stored before any thread reads them
        x0, x1, x2, x3 = _diag_inverses_t(scr, ss_t, n, BLK)
        T00, T11, T22, T33 = tl.trans(x0), tl.trans(x1), tl.trans(x2), tl.trans(x3)
        A21 = _block(scr, ss_t, n, 2, 1, BLK)
        A31 = _block(scr, ss_t, n, 3, 1, BLK)
        A32 = _block(scr, ss_t, n, 3, 2, BLK)
        T10 = -_dot_p(T11, _dot_p(_block(scr, ss_t, n, 1, 0, BLK), T00, SOLVE), SOLVE)
        T21 = -_dot_p(T22, _dot_p(A21, T11, SOLVE), SOLVE)
        T20 = -_dot_p(T22, _dot_p(_block(scr, ss_t, n, 2, 0, BLK), T00, SOLVE) + _dot_p(A21, T10, SOLVE),
                      SOLVE)
        T32 = -_dot_p(T33, _dot_p(A32, T22, SOLVE), SOLVE)
        T31 = -_dot_p(T33, _dot_p(A31, T11, SOLVE) + _dot_p(A32, T21, SOLVE), SOLVE)
        T30 = -_dot_p(T33, _dot_p(_block(scr, ss_t, n, 3, 0, BLK), T00, SOLVE) + _dot_p(A31, T10, SOLVE) +
                      _dot_p(A32, T20, SOLVE), SOLVE)
        tl.debug_barrier()  # A read whole before T overwrites it
        _store_block(scr, ss_t, n, 0, 0, T00, BLK)
        _store_block(scr, ss_t, n, 1, 0, T10, BLK)
        _store_block(scr, ss_t, n, 1, 1, T11, BLK)
        _store_block(scr, ss_t, n, 2, 0, T20, BLK)
        _store_block(scr, ss_t, n, 2, 1, T21, BLK)
        _store_block(scr, ss_t, n, 2, 2, T22, BLK)
        _store_block(scr, ss_t, n, 3, 0, T30, BLK)
        _store_block(scr, ss_t, n, 3, 1, T31, BLK)
        _store_block(scr, ss_t, n, 3, 2, T32, BLK)
        _store_block(scr, ss_t, n, 3, 3, T33, BLK)
        tl.debug_barrier()
        T = tl.load(tile, mask=valid[:, None] & (rows[None, :] // BLK <= rows[:, None] // BLK), other=0.0)
        w = tl.dot(T, k * (beta * tl.exp(gc))[:, None], input_precision=PRECISION)
        tl.store(w_ptr + t[:, None] * sw_t + h * sw_h + kk[None, :], w, mask=valid[:, None])
        vv = tl.arange(0, BV_PAD)
        v = tl.load(v_ptr + t[:, None] * sv_t + h * sv_h + vv[None, :], mask=_within(valid, vv, DV, BV_PAD),
                    other=0.0)
        u = tl.dot(T, v.to(tl.float32) * beta[:, None], input_precision=PRECISION)
        tl.store(u_ptr + t[:, None] * su_t + h * su_h + vv[None, :], u, mask=valid[:, None])

    @triton.jit(do_not_specialize=METADATA)
    def _state_kernel(k_ptr, g_ptr, w_ptr, u_ptr, cu_ptr, start_ptr, slots_ptr, state_ptr, h_ptr,
                      ck_ptr, n_ck, B, sk_t, sk_h, sg_t, sw_t, sw_h, su_t, su_h, ss_slot, ss_h, ss_k, sh_c, sh_h,
                      REP: tl.constexpr, DK: tl.constexpr, DV: tl.constexpr, BK: tl.constexpr, BV_PAD: tl.constexpr,
                      BV: tl.constexpr, CHUNK: tl.constexpr, BLOCK_B: tl.constexpr, BLOCK_CK: tl.constexpr,
                      HAS_CKPT: tl.constexpr, PRECISION: tl.constexpr, STAGES: tl.constexpr):
        """One (sequence, value head, block of BV value columns), the only sequential part: the fp32 state [BK, BV]
        (rows past DK zero) stays in registers across the sequence's chunks. Per chunk it saves the state at the chunk start (h, for
        the output kernel), turns u into V' = U - W S in place, and steps S = exp(G_C) S + (exp(G_C - G) K)^T V'.
        The state is read from the slot at the start (zeros for a fresh sequence), written back at the end (and
        at checkpoints). Chunk c of sequence b has h index (chunks of the sequences before b) + c, the index the
        prep and output kernels' programs have."""
        prior_done()  # (backend.pdl: the kernels before this one have finished)
        b, h, vb = tl.program_id(0), tl.program_id(1), tl.program_id(2)
        hk = h // REP
        lo = tl.load(cu_ptr + b)
        length = tl.load(cu_ptr + b + 1) - lo
        start = tl.load(start_ptr + b)
        seqs = tl.arange(0, BLOCK_B)
        before = seqs < b
        lens = tl.load(cu_ptr + seqs + 1, mask=before, other=0) - tl.load(cu_ptr + seqs, mask=before, other=0)
        first = tl.sum((lens + CHUNK - 1) // CHUNK, 0)
        kk = tl.arange(0, BK)
        vv = vb * BV + tl.arange(0, BV)
        vmask = vv < DV
        state = state_ptr + h * ss_h + kk[:, None] * ss_k + vv[None, :]
        # masks are built from index comparisons (the interpreter rejects a scalar bool and'ed into a tensor mask)
        rows_k = (start > 0).to(tl.int32) * DK  # 0 rows of the slot read for a fresh sequence
        S = tl.load(state + tl.load(slots_ptr + b).to(tl.int64) * ss_slot,
                    mask=(kk < rows_k)[:, None] & vmask[None, :], other=0.0)
        if HAS_CKPT:
            ce = tl.arange(0, BLOCK_CK)
            cm = ce < n_ck
            ck_b = tl.load(ck_ptr + 3 * ce, mask=cm, other=-1)
            ck_pos = tl.load(ck_ptr + 3 * ce + 1, mask=cm, other=-1)
            ck_dst = tl.load(ck_ptr + 3 * ce + 2, mask=cm, other=0)
        rows = tl.arange(0, CHUNK)
        for ci in tl.range(0, (length + CHUNK - 1) // CHUNK, num_stages=STAGES):
            n = tl.minimum(length - ci * CHUNK, CHUNK)
            valid = rows < n
            t = (lo + ci * CHUNK + rows).to(tl.int64)
            hp = h_ptr + (first + ci).to(tl.int64) * sh_c + h * sh_h + kk[:, None] * BV_PAD + vv[None, :]
            tl.store(hp, S, mask=vmask[None, :])
            w = tl.load(w_ptr + t[:, None] * sw_t + h * sw_h + kk[None, :], mask=valid[:, None], other=0.0)
            up = u_ptr + t[:, None] * su_t + h * su_h + vv[None, :]
            u = tl.load(up, mask=valid[:, None] & vmask[None, :], other=0.0)
            v_new = u - tl.dot(w, S, input_precision=PRECISION)
            tl.store(up, v_new, mask=valid[:, None] & vmask[None, :])
            k = tl.load(k_ptr + t[:, None] * sk_t + hk * sk_h + kk[None, :], mask=_within(valid, kk, DK, BK),
                        other=0.0).to(tl.float32)
            k = k * tl.rsqrt(tl.sum(k * k, 1) + 1e-6)[:, None]
            g = tl.load(g_ptr + t * sg_t + h, mask=valid, other=0.0).to(tl.float32)
            gc = tl.cumsum(g, 0)
            g_end = tl.sum(g, 0)
            S = S * tl.exp(g_end) + tl.dot(tl.trans(k * tl.exp(g_end - gc)[:, None]), v_new,
                                           input_precision=PRECISION)
            if HAS_CKPT:
                hit = (ck_b == b) & (ck_pos == start + ci * CHUNK + n)
                dst = tl.sum(tl.where(hit, ck_dst, 0), 0)
                rows_k = tl.sum(hit.to(tl.int32), 0) * DK
                tl.store(state + dst * ss_slot, S, mask=(kk < rows_k)[:, None] & vmask[None, :])
        if BK == DK:
            last = vmask[None, :]
        else:  # the padded rows past dk stay out of the slot
            last = (kk < DK)[:, None] & vmask[None, :]
        tl.store(state + tl.load(slots_ptr + b).to(tl.int64) * ss_slot, S, mask=last)

    @triton.jit(do_not_specialize=METADATA)
    def _output_kernel(q_ptr, k_ptr, g_ptr, vn_ptr, h_ptr, cu_ptr, out_ptr, B, sq_t, sq_h, sk_t, sk_h, sg_t,
                       sv_t, sv_h, sh_c, sh_h, so_t, so_h, scale,
                       REP: tl.constexpr, DK: tl.constexpr, DV: tl.constexpr, BK: tl.constexpr, BV_PAD: tl.constexpr,
                       BV: tl.constexpr, CHUNK: tl.constexpr, BLOCK_B: tl.constexpr, PRECISION: tl.constexpr):
        """One (chunk, value head), all chunks in parallel once the states at the chunk starts (h) and V' are
        known: O = diag(exp(G)) Q S + (Q K^T * exp(G_i - G_j))_causal V', the value columns BV at a time."""
        prior_done()  # (backend.pdl: the kernels before this one have finished)
        pid = tl.program_id(0)
        b, ci = block_of(cu_ptr, pid, B, CHUNK, BLOCK_B, False)
        if b >= B:
            return
        h = tl.program_id(1)
        hk = h // REP
        t0 = tl.load(cu_ptr + b) + ci * CHUNK
        n = tl.minimum(tl.load(cu_ptr + b + 1) - t0, CHUNK)
        rows = tl.arange(0, CHUNK)
        valid = rows < n
        t = (t0 + rows).to(tl.int64)
        kk = tl.arange(0, BK)
        q_raw = tl.load(q_ptr + t[:, None] * sq_t + hk * sq_h + kk[None, :], mask=_within(valid, kk, DK, BK),
                        other=0.0)
        q = q_raw.to(tl.float32)
        r_q = tl.rsqrt(tl.sum(q * q, 1) + 1e-6) * scale
        q = q * r_q[:, None]
        k_raw = tl.load(k_ptr + t[:, None] * sk_t + hk * sk_h + kk[None, :], mask=_within(valid, kk, DK, BK),
                        other=0.0)
        k = k_raw.to(tl.float32)
        r_k = tl.rsqrt(tl.sum(k * k, 1) + 1e-6)
        gc = tl.cumsum(tl.load(g_ptr + t * sg_t + h, mask=valid, other=0.0).to(tl.float32), 0)
        causal = rows[:, None] >= rows[None, :]
        attn = tl.dot(q_raw, tl.trans(k_raw), input_precision=PRECISION) * r_q[:, None] * r_k[None, :] * \
            tl.exp(tl.where(causal, gc[:, None] - gc[None, :], float("-inf")))
        qg = q * tl.exp(gc)[:, None]
        for v0 in tl.static_range(0, DV, BV):
            vv = v0 + tl.arange(0, BV)
            S = tl.load(h_ptr + pid.to(tl.int64) * sh_c + h * sh_h + kk[:, None] * BV_PAD + vv[None, :])
            vn = tl.load(vn_ptr + t[:, None] * sv_t + h * sv_h + vv[None, :], mask=valid[:, None], other=0.0)
            o = tl.dot(attn, vn, tl.dot(qg, S, input_precision=PRECISION), input_precision=PRECISION)
            tl.store(out_ptr + t[:, None] * so_t + h * so_h + vv[None, :], o.to(out_ptr.dtype.element_ty),
                     mask=_within(valid, vv, DV, BV_PAD))
