"""Gated DeltaNet on a speculative verify step: T tokens per sequence (its newest token, then its drafts) read the
sequence's conv tail and recurrent state without writing them; after acceptance, `commit` replays each sequence's
first counts[b] tokens from the unchanged state and writes the state and the tail once.

Why a replay and not a state per draft position: at full size a sequence's states are ~60 MB (TP=1), so writing
T of them per step costs more memory traffic than reading the one state again for the replay; and the inputs the
replay needs are the T rows of the fused projection proj = u | z | b | a that the verify step computed (the layer
keeps a reference to them until commit).

Both ops compute, token by token, exactly what T calls of layers/deltanet.py decode_torch compute (the same conv
window per token, the same delta-rule update and readout): the outputs of verify equal T single decode steps, and
after commit(counts) the state and tail equal counts[b] single decode steps (exact in fp32, torch pair).

Rows are contiguous per sequence: sequence b's tokens are rows b*T .. b*T + T - 1 of proj.
    verify_torch / verify_fast (proj, conv_state, ssm_state, slots, conv_weight, A_log, dt_bias, norm_weight, eps, T)
        -> y [B*T, Hv*dv]; nothing written
    commit_torch / commit_fast (proj, conv_state, ssm_state, slots, conv_weight, A_log, dt_bias, counts, T)
        -> None; conv_state[slots] and ssm_state[slots] advanced by counts[b] tokens (1 <= counts[b] <= T)
No host sync in either (counts stay on the device): masks by t < counts[b].
"""
from __future__ import annotations

import torch

from layers.backend import pdl, prior_done, round_to, tl, triton
from layers.deltanet import (L2_EPS, _dims, conv_column_qkv, decode_launch, delta_rule_step, gates_torch,
                             split_proj)
from layers.norm import gated_rms_norm_fast, gated_rms_norm_torch


def _windows(proj, conv_state, slots, conv_dim, Hv, dv, T):
    """(u, z, b, a) as [B, T, ...] and the conv's input sequence [B, C, K-1 + T] (cached tail, then the T inputs)."""
    B = proj.shape[0] // T
    u, z, b, a = split_proj(proj.view(B, T, -1), conv_dim, Hv, dv)
    seq = torch.cat([conv_state[slots], u.transpose(1, 2)], dim=-1)
    return u, z, b, a, seq


def verify_torch(proj, conv_state, ssm_state, slots, conv_weight, A_log, dt_bias, norm_weight, eps: float, T: int):
    """Outputs of T tokens per sequence on its state (module docstring), the caches untouched."""
    Hk, Hv, dk, dv, conv_dim = _dims(conv_state, ssm_state)
    K = conv_weight.shape[-1]
    u, z, b, a, seq = _windows(proj, conv_state, slots, conv_dim, Hv, dv, T)
    state = ssm_state[slots]
    y = []
    for t in range(T):
        # (everything per token on decode_torch's shapes: the same shapes take the same vectorised code paths, so
        # the results are the same bits)
        g, beta = gates_torch(a[:, t], b[:, t], A_log, dt_bias)
        q, k, v = conv_column_qkv(seq[..., t:t + K], conv_weight, Hk, Hv, dk, dv)
        state = delta_rule_step(state, k, v, g, beta)
        o = torch.einsum("bhkv,bhk->bhv", state, q).to(u.dtype)
        y.append(gated_rms_norm_torch(o, z[:, t], norm_weight, eps).flatten(1))
    return torch.stack(y, dim=1).flatten(0, 1)


def commit_torch(proj, conv_state, ssm_state, slots, conv_weight, A_log, dt_bias, counts, T: int) -> None:
    """Advance each sequence's state and conv tail by its first counts[b] tokens of the verify step (replayed)."""
    Hk, Hv, dk, dv, conv_dim = _dims(conv_state, ssm_state)
    K = conv_weight.shape[-1]
    u, z, b, a, seq = _windows(proj, conv_state, slots, conv_dim, Hv, dv, T)
    state = ssm_state[slots]
    for t in range(T):
        g, beta = gates_torch(a[:, t], b[:, t], A_log, dt_bias)
        _, k, v = conv_column_qkv(seq[..., t:t + K], conv_weight, Hk, Hv, dk, dv)
        new = delta_rule_step(state, k, v, g, beta)
        state = torch.where((t < counts)[:, None, None, None], new, state)
    ssm_state[slots] = state
    # the tail after n tokens: inputs n .. n + K - 2 of the sequence [tail, T inputs]
    at = counts[:, None] + torch.arange(K - 1, device=seq.device)[None, :]
    conv_state[slots] = seq.gather(2, at[:, None, :].expand(-1, seq.shape[1], -1))


# ------------------------------------------------------------------------------------------------ fast
def _launch(proj, conv_state, ssm_state, slots, conv_weight, A_log, dt_bias, counts, y, T: int, commit: bool):
    Hk, Hv, dk, dv, conv_dim = _dims(conv_state, ssm_state)
    B = proj.shape[0] // T
    BV, warps = decode_launch(dk, dv, B)
    n_split = triton.cdiv(dv, BV)
    z_off = conv_dim
    b_off = z_off + Hv * dv
    _verify_kernel[(Hv * n_split, B)](
        proj, conv_state, conv_weight, ssm_state, slots, counts, A_log, dt_bias, y, T,
        proj.stride(0), *conv_state.stride(), conv_weight.stride(0), conv_weight.stride(2), *ssm_state.stride(),
        y.stride(0), Hk * dk, 2 * Hk * dk, b_off, b_off + Hv, dk ** -0.5, L2_EPS,
        KERNEL=conv_weight.shape[-1], REP=Hv // Hk, N_SPLIT=n_split, DK=dk, DV=dv,
        BK=triton.next_power_of_2(dk), BV=BV, COMMIT=commit, num_warps=warps, **pdl())


def verify_fast(proj, conv_state, ssm_state, slots, conv_weight, A_log, dt_bias, norm_weight, eps: float, T: int):
    """verify_torch in two launches: the T tokens of each (sequence, value-head block) in one program (the state
    slab in registers, read once, never written; the conv windows from the cached tail and the proj rows), storing
    each token's readout; then the gated RMSNorm over all rows."""
    Hk, Hv, dk, dv, conv_dim = _dims(conv_state, ssm_state)
    o = torch.empty(proj.shape[0], Hv * dv, dtype=proj.dtype, device=proj.device)
    if proj.shape[0]:
        _launch(proj, conv_state, ssm_state, slots, conv_weight, A_log, dt_bias, slots, o, T, commit=False)
    z = split_proj(proj, conv_dim, Hv, dv)[1]
    return gated_rms_norm_fast(o.view(-1, Hv, dv), z, norm_weight, eps).flatten(1)


def commit_fast(proj, conv_state, ssm_state, slots, conv_weight, A_log, dt_bias, counts, T: int) -> None:
    """commit_torch in two launches: one replays the first counts[b] tokens per (sequence, value-head block)
    program and writes its state slab once; then the conv tails move on (a launch of its own: it must follow the
    first, which reads the old tails), each program reading its channels' whole new tail before writing it."""
    Hk, Hv, dk, dv, conv_dim = _dims(conv_state, ssm_state)
    if not proj.shape[0]:
        return
    _launch(proj, conv_state, ssm_state, slots, conv_weight, A_log, dt_bias, counts, proj, T, commit=True)
    B = proj.shape[0] // T
    _commit_tail_kernel[(B, triton.cdiv(conv_dim, TAIL_BLOCK))](
        proj, conv_state, slots, counts, T, proj.stride(0), *conv_state.stride(), conv_dim,
        TAIL=conv_weight.shape[-1] - 1, TAIL_P=triton.next_power_of_2(conv_weight.shape[-1] - 1), BLOCK=TAIL_BLOCK,
        **pdl())


TAIL_BLOCK = 256  # conv channels per program of the tail update


if triton is not None:
    from layers.deltanet import _beta, _softplus

    @triton.jit
    def _window_silu(prow0, sp_b, t, tail, w_ptr, ch, mask, ss_c, ss_t, sw_c, sw_t, KERNEL: tl.constexpr,
                     DTYPE: tl.constexpr):
        """Token t's conv column at channels `ch`: taps over [cached tail (K-1), the row's T inputs] from t on,
        accumulated in fp32 in tap order and rounded to DTYPE, then SiLU rounded again (deltanet._conv_silu's
        rule). fp32 result."""
        acc = tl.zeros(ch.shape, dtype=tl.float32)
        for j in tl.static_range(KERNEL):
            s = tl.zeros(ch.shape, dtype=tl.int32) + t + j  # (a tile: t may be a plain int)
            old = tl.load(tail + ch * ss_c + s * ss_t, mask=mask & (s < KERNEL - 1), other=0.0).to(tl.float32)
            new = tl.load(prow0 + (s - (KERNEL - 1)).to(tl.int64) * sp_b + ch, mask=mask & (s >= KERNEL - 1),
                          other=0.0).to(tl.float32)
            acc += (old + new) * tl.load(w_ptr + ch * sw_c + j * sw_t, mask=mask, other=0.0).to(tl.float32)
        y = round_to(acc, DTYPE)
        return round_to(y * tl.sigmoid(y), DTYPE)

    @triton.jit
    def _commit_tail_kernel(proj_ptr, conv_ptr, slots_ptr, counts_ptr, T, sp_b, sc_slot, sc_c, sc_t, conv_dim,
                            TAIL: tl.constexpr, TAIL_P: tl.constexpr, BLOCK: tl.constexpr):
        """Sequence b's conv tail at channels [j*BLOCK, (j+1)*BLOCK) after counts[b] tokens: entries n .. n + TAIL
        - 1 of [old tail (TAIL), its T inputs], all read (a barrier) before any is written (in place)."""
        prior_done()  # (backend.pdl: the kernels before this one have finished)
        b = tl.program_id(0)
        ch = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
        i = tl.arange(0, TAIL_P)
        mask = (ch < conv_dim)[:, None] & (i < TAIL)[None, :]
        s = tl.load(counts_ptr + b) + i[None, :]
        tail = conv_ptr + tl.load(slots_ptr + b) * sc_slot + ch[:, None] * sc_c
        old = tl.load(tail + s * sc_t, mask=mask & (s < TAIL), other=0.0)
        new = tl.load(proj_ptr + (b * T + s - TAIL).to(tl.int64) * sp_b + ch[:, None], mask=mask & (s >= TAIL),
                      other=0.0)
        vals = tl.where(s < TAIL, old, new)
        tl.debug_barrier()
        tl.store(tail + i[None, :] * sc_t, vals, mask=mask)

    @triton.jit
    def _verify_kernel(proj_ptr, conv_ptr, conv_w_ptr, state_ptr, slots_ptr, counts_ptr, A_log_ptr, dt_bias_ptr,
                       y_ptr, T, sp_b, sc_slot, sc_c, sc_t, sw_c, sw_t, ss_slot, ss_h, ss_k, ss_v, sy_b,
                       k_off, v_off, b_off, a_off, scale, l2_eps,
                       KERNEL: tl.constexpr, REP: tl.constexpr, N_SPLIT: tl.constexpr, DK: tl.constexpr,
                       DV: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr, COMMIT: tl.constexpr):
        """Value columns [j*BV, (j+1)*BV) of value head h of sequence b, program (h * N_SPLIT + j, b), its T tokens
        in order (the decode kernel's step per token). Verify (COMMIT False): the slab is read, never written; each
        token's readout o (rounded) goes to row b*T + t of y, unnormalised. Commit: tokens t >= counts[b] leave
        the slab as it was; the slab is written once at the end; nothing else (y unused)."""
        prior_done()  # (backend.pdl: the kernels before this one have finished)
        pid, b = tl.program_id(0), tl.program_id(1).to(tl.int64)
        h, j = pid // N_SPLIT, pid % N_SPLIT
        hk = h // REP
        dtype = proj_ptr.dtype.element_ty
        kk, vv = tl.arange(0, BK), j * BV + tl.arange(0, BV)
        km, vm = kk < DK, vv < DV
        slot = tl.load(slots_ptr + b).to(tl.int64)
        tail = conv_ptr + slot * sc_slot
        ptrs = state_ptr + slot * ss_slot + h * ss_h + kk[:, None] * ss_k + vv[None, :] * ss_v
        smask = km[:, None] & vm[None, :]
        S = tl.load(ptrs, mask=smask, other=0.0)
        n = T
        if COMMIT:
            n = tl.load(counts_ptr + b)
        prow0 = proj_ptr + b * T * sp_b
        decay_scale = -tl.exp(tl.load(A_log_ptr + h).to(tl.float32))
        bias = tl.load(dt_bias_ptr + h).to(tl.float32)
        for t in range(T):
            prow = prow0 + t * sp_b
            k = _window_silu(prow0, sp_b, t, tail, conv_w_ptr, k_off + hk * DK + kk, km, sc_c, sc_t, sw_c, sw_t,
                             KERNEL, dtype)
            v = _window_silu(prow0, sp_b, t, tail, conv_w_ptr, v_off + h * DV + vv, vm, sc_c, sc_t, sw_c, sw_t,
                             KERNEL, dtype)
            k = k * tl.rsqrt(tl.sum(k * k, 0) + l2_eps)
            decay = tl.exp(decay_scale * _softplus(tl.load(prow + a_off + h).to(tl.float32) + bias))
            beta = _beta(tl.load(prow + b_off + h))
            new = S * decay
            delta = (v - tl.sum(new * k[:, None], 0)) * beta
            new = new + k[:, None] * delta[None, :]
            if COMMIT:
                S = tl.where(t < n, new, S)
            else:
                S = new
                q = _window_silu(prow0, sp_b, t, tail, conv_w_ptr, hk * DK + kk, km, sc_c, sc_t, sw_c, sw_t,
                                 KERNEL, dtype)
                q = q * tl.rsqrt(tl.sum(q * q, 0) + l2_eps) * scale
                o = round_to(tl.sum(S * q[:, None], 0), dtype)
                tl.store(y_ptr + (b * T + t) * sy_b + h * DV + vv, o.to(dtype), mask=vm)
        if COMMIT:
            tl.store(ptrs, S, mask=smask)
