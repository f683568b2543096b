"""Gated DeltaNet on a speculative verify step: T tokens per sequence (its newest token, then its drafts) read the
sequence's conv tail and recurrent state; the state is written once, after the first token (the newest one, always
accepted), the tail not at all. After acceptance, `commit` replays each sequence's accepted drafts (tokens 1 ..
counts[b] - 1) from that state and writes it once (a sequence that accepted none is not touched), and moves every
tail on by counts[b], for every layer at once.

Why a replay and not a state per draft position: at full size a sequence's states are ~60 MB (TP=1), so writing
T of them per step costs more memory traffic than reading the one state again for the replay; and the inputs the
replay needs are the T rows of the fused projection proj = u | z | b | a that the verify step computed (each layer
keeps a reference to them until commit: a VerifyStep). Writing the state after the first token costs the verify
step little (its programs wait on their serial token updates more than on memory: ~30% of the copy rate at batch
64 on an H200) and spares the commit the sequences that accepted no draft (40% of them at acceptance 0.6).

Both ops compute, token by token, exactly what T calls of layers/deltanet.py decode_torch compute (the same conv
window per token, the same delta-rule update and readout): the outputs of verify equal T single decode steps, and
after verify the state equals one single decode step and after commit(counts) the state and tail equal counts[b]
single decode steps (exact in fp32, torch pair).

Rows are contiguous per sequence: sequence b's tokens are rows b*T .. b*T + T - 1 of proj.
    verify_torch / verify_fast (proj, conv_state, ssm_state, slots, conv_weight, A_log, dt_bias, norm_weight, eps, T,
                                row) -> y [B*T, Hv*dv]; ssm_state[slots] advanced by the first token
    commit_torch / commit_fast (steps: list[VerifyStep], counts) -> None; for every layer, conv_state[slots] and
                                ssm_state[slots] advanced by counts[b] tokens (1 <= counts[b] <= T) in all
No host sync in either (counts stay on the device): masks by t < counts[b].

The fast pair is one launch a layer for verify (the gated norm inside it) and one launch for the commit of every
layer. The commit kernel finds each layer's tensors in a table of addresses in device memory that the layer's
verify launch wrote (row `row`, from its own pointer arguments), so no host-to-device copy is needed inside a CUDA
graph and the table always names the buffers of the step being committed.
"""
from __future__ import annotations

from typing import NamedTuple

import torch

from layers import backend
from layers.backend import pdl, prior_done, round_to, tl, triton
from layers.deltanet import (L2_EPS, _dims, conv_column_qkv, decode_launch, delta_rule_step, gates_torch,
                             split_proj)
from layers.norm import gated_rms_norm_torch


class VerifyStep(NamedTuple):
    """One layer's verify step, kept for its commit: the projection rows it computed, the caches and weights it read,
    the step's slots and tokens per sequence, and the row of the commit table its fast launch wrote."""
    proj: torch.Tensor
    conv_state: torch.Tensor
    ssm_state: torch.Tensor
    slots: torch.Tensor
    conv_weight: torch.Tensor
    A_log: torch.Tensor
    dt_bias: torch.Tensor
    T: int
    row: int


def _windows(proj, conv_state, slots, conv_dim, Hv, dv, T):
    """(u, z, b, a) as [B, T, ...] and the conv's input sequence [B, C, K-1 + T] (cached tail, then the T inputs)."""
    B = proj.shape[0] // T
    u, z, b, a = split_proj(proj.view(B, T, -1), conv_dim, Hv, dv)
    seq = torch.cat([conv_state[slots], u.transpose(1, 2)], dim=-1)
    return u, z, b, a, seq


def verify_torch(proj, conv_state, ssm_state, slots, conv_weight, A_log, dt_bias, norm_weight, eps: float, T: int,
                 row: int = 0):
    """Outputs of T tokens per sequence on its state (module docstring); the state written after the first token, the
    tail untouched (row: the fast op's)."""
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
        if t == 0:
            ssm_state[slots] = state
        o = torch.einsum("bhkv,bhk->bhv", state, q).to(u.dtype)
        y.append(gated_rms_norm_torch(o, z[:, t], norm_weight, eps).flatten(1))
    return torch.stack(y, dim=1).flatten(0, 1)


def commit_torch(steps: list[VerifyStep], counts: torch.Tensor) -> None:
    """Advance each layer's states (after its verify step's first token) by each sequence's accepted drafts, tokens 1
    .. counts[b] - 1 (replayed), and its conv tails by counts[b] tokens, layer by layer."""
    for s in steps:
        _commit_layer_torch(s.proj, s.conv_state, s.ssm_state, s.slots, s.conv_weight, s.A_log, s.dt_bias, counts,
                            s.T)


def _commit_layer_torch(proj, conv_state, ssm_state, slots, conv_weight, A_log, dt_bias, counts, T: int) -> None:
    Hk, Hv, dk, dv, conv_dim = _dims(conv_state, ssm_state)
    K = conv_weight.shape[-1]
    u, z, b, a, seq = _windows(proj, conv_state, slots, conv_dim, Hv, dv, T)
    state = ssm_state[slots]
    for t in range(1, T):
        g, beta = gates_torch(a[:, t], b[:, t], A_log, dt_bias)
        _, k, v = conv_column_qkv(seq[..., t:t + K], conv_weight, Hk, Hv, dk, dv)
        new = delta_rule_step(state, k, v, g, beta)
        state = torch.where((t < counts)[:, None, None, None], new, state)
    ssm_state[slots] = state
    # the tail after n tokens: inputs n .. n + K - 2 of the sequence [tail, T inputs]
    at = counts[:, None] + torch.arange(K - 1, device=seq.device)[None, :]
    conv_state[slots] = seq.gather(2, at[:, None, :].expand(-1, seq.shape[1], -1))


# ------------------------------------------------------------------------------------------------ fast
TABLE_FIELDS = 6  # a commit table row: the addresses of proj, conv_state, ssm_state, conv_weight, A_log, dt_bias
_TABLES: dict[torch.device, torch.Tensor] = {}  # (backend.graph_scratch)
_RECORDED: dict[torch.device, dict[int, tuple]] = {}  # the host's copy of what each row names


def _fields(t: VerifyStep) -> tuple:
    return t.proj, t.conv_state, t.ssm_state, t.conv_weight, t.A_log, t.dt_bias


def verify_fast(proj, conv_state, ssm_state, slots, conv_weight, A_log, dt_bias, norm_weight, eps: float, T: int,
                row: int = 0):
    """verify_torch in one launch: the T tokens of each (sequence, value-head block) in one program (the state slab in
    registers, read once, written after the first token; the conv windows from the cached tail and the proj rows), each
    token's readout stored; the last program of each (sequence, qk-head) group to arrive applies the gated RMSNorm to
    its heads' rows (as decode_fast's). Program (0, 0) writes this layer's addresses into row `row` of the commit table,
    for commit_fast."""
    Hk, Hv, dk, dv, conv_dim = _dims(conv_state, ssm_state)
    y = torch.empty(proj.shape[0], Hv * dv, dtype=proj.dtype, device=proj.device)
    step = VerifyStep(proj, conv_state, ssm_state, slots, conv_weight, A_log, dt_bias, T, row)
    table = backend.graph_scratch(_TABLES, "commit table rows", row + 1, proj.device, torch.int64, 64,
                                  (TABLE_FIELDS,))
    _RECORDED.setdefault(proj.device, {})[row] = tuple(t.data_ptr() for t in _fields(step))
    if not proj.shape[0]:
        return y
    B = proj.shape[0] // T
    BV, warps = decode_launch(dk, dv, B)
    n_split = triton.cdiv(dv, BV)
    rep = Hv // Hk
    z_off = conv_dim
    b_off = z_off + Hv * dv
    _verify_kernel[(Hv * n_split, B)](
        proj, conv_state, conv_weight, ssm_state, slots, A_log, dt_bias, norm_weight, y,
        backend.arrival_counters(B * Hk, proj.device), table, row, T,
        proj.stride(0), *conv_state.stride(), conv_weight.stride(0), conv_weight.stride(2), *ssm_state.stride(),
        y.stride(0), Hk * dk, 2 * Hk * dk, z_off, b_off, b_off + Hv, dk ** -0.5, L2_EPS, eps,
        KERNEL=conv_weight.shape[-1], REP=rep, REP_P2=triton.next_power_of_2(rep), N_SPLIT=n_split, DK=dk, DV=dv,
        BK=triton.next_power_of_2(dk), BV=BV, BV_HEAD=triton.next_power_of_2(dv), FIELDS=TABLE_FIELDS,
        num_warps=warps, **pdl())
    return y


def commit_fast(steps: list[VerifyStep], counts: torch.Tensor) -> None:
    """commit_torch in one launch for every layer: program (h * n_split + j, b, l) replays tokens 1 .. counts[b] - 1 of
    its slab of layer l (its tensors from row l of the commit table, which layer l's verify_fast wrote: steps[l].row
    must be l) and writes the slab once (neither where counts[b] is 1), then moves on its own v channels of the conv
    tail; the last program of each (layer, sequence, qk-head) group to arrive moves on the group's q/k channels (every
    program of the group has read them by then). The layers must share shapes, strides and dtypes, the slots and T."""
    if not steps:
        return
    first = steps[0]
    device = first.proj.device
    recorded = _RECORDED.get(device, {})
    like = [(t.shape, t.stride(), t.dtype) for t in _fields(first)]
    for i, s in enumerate(steps):
        if s.row != i or recorded.get(i) != tuple(t.data_ptr() for t in _fields(s)):
            raise RuntimeError(f"commit_fast: layer {i}'s verify step is not in row {i} of the commit table "
                               f"(verify_fast(..., row={i}) on these tensors first)")
        if [(t.shape, t.stride(), t.dtype) for t in _fields(s)] != like or s.slots is not first.slots \
                or s.T != first.T:
            raise ValueError(f"commit_fast: layer {i}'s verify step differs from layer 0's in shape, stride, dtype, "
                             "slots or T; one launch commits layers of one kind")
    Hk, Hv, dk, dv, conv_dim = _dims(first.conv_state, first.ssm_state)
    T, L = first.T, len(steps)
    B = first.proj.shape[0] // T
    if not B:
        return
    BV, warps = decode_launch(dk, dv, B)
    n_split = triton.cdiv(dv, BV)
    K = first.conv_weight.shape[-1]
    b_off = conv_dim + Hv * dv
    _commit_kernel[(Hv * n_split, B, L)](
        _TABLES[device], *_fields(first), first.slots, counts, backend.arrival_counters(L * B * Hk, device), T,
        first.proj.stride(0), *first.conv_state.stride(), first.conv_weight.stride(0), first.conv_weight.stride(2),
        *first.ssm_state.stride(), Hk * dk, 2 * Hk * dk, b_off, b_off + Hv, L2_EPS,
        KERNEL=K, REP=Hv // Hk, N_SPLIT=n_split, DK=dk, DV=dv, BK=triton.next_power_of_2(dk), BV=BV,
        TAIL_P=triton.next_power_of_2(K - 1), FIELDS=TABLE_FIELDS, num_warps=warps, **pdl())


if triton is not None:
    from layers.deltanet import _beta, _gated_norm_group, _softplus

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
    def _slab(proj_ptr, conv_ptr, state_ptr, slots_ptr, A_log_ptr, dt_bias_ptr, b, h, kk, vv, km, vm, T, sp_b,
              sc_slot, ss_slot, ss_h, ss_k, ss_v):
        """What a program of sequence b and value head h (value columns vv) reads first: (the slot's conv tail, its
        state slab's pointers, the slab (its load issued first: its bytes come from HBM while the rest is set up),
        the sequence's first proj row, the head's -exp(A_log) and dt_bias in fp32)."""
        slot = tl.load(slots_ptr + b).to(tl.int64)
        ptrs = state_ptr + slot * ss_slot + h * ss_h + kk[:, None] * ss_k + vv[None, :] * ss_v
        S = tl.load(ptrs, mask=km[:, None] & vm[None, :], other=0.0)
        decay_scale = -tl.exp(tl.load(A_log_ptr + h).to(tl.float32))
        bias = tl.load(dt_bias_ptr + h).to(tl.float32)
        return conv_ptr + slot * sc_slot, ptrs, S, proj_ptr + b * T * sp_b, decay_scale, bias

    @triton.jit
    def _token_update(S, prow0, sp_b, t, tail, conv_w_ptr, h, hk, kk, vv, km, vm, sc_c, sc_t, sw_c, sw_t, k_off,
                      v_off, b_off, a_off, decay_scale, bias, l2_eps, KERNEL: tl.constexpr, DK: tl.constexpr,
                      DV: tl.constexpr, DTYPE: tl.constexpr):
        """The slab after token t (decode_kernel's step): k, v from the conv windows, k l2-normed, the decay and
        beta from the row's a and b; S = exp(g) S; S += k (beta (v - S^T k))^T."""
        prow = prow0 + t * sp_b
        k = _window_silu(prow0, sp_b, t, tail, conv_w_ptr, k_off + hk * DK + kk, km, sc_c, sc_t, sw_c, sw_t, KERNEL,
                         DTYPE)
        v = _window_silu(prow0, sp_b, t, tail, conv_w_ptr, v_off + h * DV + vv, vm, sc_c, sc_t, sw_c, sw_t, KERNEL,
                         DTYPE)
        k = k * tl.rsqrt(tl.sum(k * k, 0) + l2_eps)
        decay = tl.exp(decay_scale * _softplus(tl.load(prow + a_off + h).to(tl.float32) + bias))
        beta = _beta(tl.load(prow + b_off + h))
        new = S * decay
        delta = (v - tl.sum(new * k[:, None], 0)) * beta
        return new + k[:, None] * delta[None, :]

    @triton.jit
    def _move_tail(prow0, sp_b, tail, ch, mask, n, sc_c, sc_t, TAIL: tl.constexpr, TAIL_P: tl.constexpr):
        """Channels `ch` of a sequence's conv tail after n tokens: entries n .. n + TAIL - 1 of [old tail (TAIL),
        its T inputs], all read (a barrier) before any is written (in place)."""
        i = tl.arange(0, TAIL_P)
        m = mask[:, None] & (i < TAIL)[None, :]
        s = n + i[None, :]
        old = tl.load(tail + ch[:, None] * sc_c + s * sc_t, mask=m & (s < TAIL), other=0.0)
        new = tl.load(prow0 + (s - TAIL).to(tl.int64) * sp_b + ch[:, None], mask=m & (s >= TAIL), other=0.0)
        vals = tl.where(s < TAIL, old, new)
        tl.debug_barrier()
        tl.store(tail + ch[:, None] * sc_c + i[None, :] * sc_t, vals, mask=m)

    @triton.jit
    def _verify_kernel(proj_ptr, conv_ptr, conv_w_ptr, state_ptr, slots_ptr, A_log_ptr, dt_bias_ptr, norm_w_ptr,
                       y_ptr, count_ptr, table_ptr, row, T, sp_b, sc_slot, sc_c, sc_t, sw_c, sw_t, ss_slot, ss_h,
                       ss_k, ss_v, sy_b, k_off, v_off, z_off, b_off, a_off, scale, l2_eps, eps,
                       KERNEL: tl.constexpr, REP: tl.constexpr, REP_P2: tl.constexpr, N_SPLIT: tl.constexpr,
                       DK: tl.constexpr, DV: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr,
                       BV_HEAD: tl.constexpr, FIELDS: tl.constexpr):
        """Value columns [j*BV, (j+1)*BV) of value head h of sequence b, program (h * N_SPLIT + j, b), its T tokens
        in order (the decode kernel's step per token): the slab is read, written after the first token (always
        accepted: the commit replays the rest); each token's readout o
        (rounded) goes to row b*T + t of y. The last program of the (b, qk-head) group to arrive normalises and
        gates the group's heads in all T rows (_gated_norm_group) and resets the counter."""
        prior_done()  # (backend.pdl: the kernels before this one have finished)
        pid, b = tl.program_id(0), tl.program_id(1).to(tl.int64)
        h, j = pid // N_SPLIT, pid % N_SPLIT
        hk = h // REP
        dtype = proj_ptr.dtype.element_ty
        if (pid == 0) & (b == 0):  # this layer's tensors, for the commit (the module docstring)
            entry = table_ptr + row * FIELDS
            tl.store(entry + 0, proj_ptr.to(tl.int64, bitcast=True))
            tl.store(entry + 1, conv_ptr.to(tl.int64, bitcast=True))
            tl.store(entry + 2, state_ptr.to(tl.int64, bitcast=True))
            tl.store(entry + 3, conv_w_ptr.to(tl.int64, bitcast=True))
            tl.store(entry + 4, A_log_ptr.to(tl.int64, bitcast=True))
            tl.store(entry + 5, dt_bias_ptr.to(tl.int64, bitcast=True))
        kk, vv = tl.arange(0, BK), j * BV + tl.arange(0, BV)
        km, vm = kk < DK, vv < DV
        tail, ptrs, S, prow0, decay_scale, bias = _slab(proj_ptr, conv_ptr, state_ptr, slots_ptr, A_log_ptr,
                                                        dt_bias_ptr, b, h, kk, vv, km, vm, T, sp_b, sc_slot, ss_slot,
                                                        ss_h, ss_k, ss_v)
        for t in range(T):
            S = _token_update(S, prow0, sp_b, t, tail, conv_w_ptr, h, hk, kk, vv, km, vm, sc_c, sc_t, sw_c, sw_t,
                              k_off, v_off, b_off, a_off, decay_scale, bias, l2_eps, KERNEL, DK, DV, dtype)
            if t == 0:
                tl.store(ptrs, S, mask=km[:, None] & vm[None, :])
            q = _window_silu(prow0, sp_b, t, tail, conv_w_ptr, hk * DK + kk, km, sc_c, sc_t, sw_c, sw_t, KERNEL,
                             dtype)
            q = q * tl.rsqrt(tl.sum(q * q, 0) + l2_eps) * scale
            o = round_to(tl.sum(S * q[:, None], 0), dtype)
            tl.store(y_ptr + (b * T + t) * sy_b + h * DV + vv, o.to(dtype), mask=vm)
        # arrive: the barrier orders every thread's stores above before the (one-thread) release
        tl.debug_barrier()
        count = count_ptr + b * (tl.num_programs(0) // (REP * N_SPLIT)) + hk
        if tl.atomic_add(count, 1, sem="acq_rel") == REP * N_SPLIT - 1:
            for t in range(T):
                _gated_norm_group(y_ptr + (b * T + t) * sy_b, prow0 + t * sp_b + z_off, norm_w_ptr, hk, eps, REP,
                                  REP_P2, DV, BV_HEAD)
            tl.store(count, 0)

    @triton.jit
    def _address(entry, like):
        """The pointer a commit table entry holds, as `like` (a pointer argument of the same type) plus a whole number
        of elements, so that the compiler knows it 16-byte aligned (torch's tensors start on 512-byte boundaries):
        a pointer cast from the table's integer carried no alignment, the slab's loads and stores went scalar and
        the commit ran 2-3x longer (1x H200, batch 8-64; a hint on the integer did not pass the cast)."""
        size: tl.constexpr = like.dtype.element_ty.primitive_bitwidth // 8
        offset = (tl.load(entry) - like.to(tl.int64, bitcast=True)) // size  # elements from `like`
        return like + tl.multiple_of(offset, 16 // size)

    @triton.jit
    def _commit_kernel(table_ptr, proj0, conv0, state0, conv_w0, A_log0, dt_bias0, slots_ptr, counts_ptr, count_ptr,
                       T, sp_b, sc_slot, sc_c, sc_t, sw_c, sw_t, ss_slot, ss_h, ss_k, ss_v, k_off, v_off, b_off,
                       a_off, l2_eps, KERNEL: tl.constexpr, REP: tl.constexpr, N_SPLIT: tl.constexpr,
                       DK: tl.constexpr, DV: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr,
                       TAIL_P: tl.constexpr, FIELDS: tl.constexpr):
        """Value columns [j*BV, (j+1)*BV) of value head h of sequence b in layer l, program (h * N_SPLIT + j, b, l):
        layer l's tensors from row l of the commit table (the *0 arguments give their types); where counts[b] > 1,
        tokens 1 .. counts[b] - 1 update the slab (as the verify left it, after token 0), which is written once; then
        this program's v tail channels move on (only it reads them), and the last program of the (l, b, qk-head) group
        to arrive moves on the group's q and k channels and resets the counter."""
        prior_done()  # (backend.pdl: the kernels before this one have finished, the table written)
        pid, b, l = tl.program_id(0), tl.program_id(1).to(tl.int64), tl.program_id(2)
        entry = table_ptr + l * FIELDS
        proj_ptr = _address(entry + 0, proj0)
        conv_ptr = _address(entry + 1, conv0)
        state_ptr = _address(entry + 2, state0)
        conv_w_ptr = _address(entry + 3, conv_w0)
        A_log_ptr = _address(entry + 4, A_log0)
        dt_bias_ptr = _address(entry + 5, dt_bias0)
        h, j = pid // N_SPLIT, pid % N_SPLIT
        hk = h // REP
        dtype = proj0.dtype.element_ty
        kk, vv = tl.arange(0, BK), j * BV + tl.arange(0, BV)
        km, vm = kk < DK, vv < DV
        n = tl.load(counts_ptr + b)
        if n > 1:  # (a sequence that accepted no draft: its slab is as the verify left it)
            tail, ptrs, S, prow0, decay_scale, bias = _slab(proj_ptr, conv_ptr, state_ptr, slots_ptr, A_log_ptr,
                                                            dt_bias_ptr, b, h, kk, vv, km, vm, T, sp_b, sc_slot,
                                                            ss_slot, ss_h, ss_k, ss_v)
            for t in range(1, n):  # (the accepted drafts only: the rejected ones cost nothing)
                S = _token_update(S, prow0, sp_b, t, tail, conv_w_ptr, h, hk, kk, vv, km, vm, sc_c, sc_t, sw_c,
                                  sw_t, k_off, v_off, b_off, a_off, decay_scale, bias, l2_eps, KERNEL, DK, DV, dtype)
            tl.store(ptrs, S, mask=km[:, None] & vm[None, :])
        tail = conv_ptr + tl.load(slots_ptr + b).to(tl.int64) * sc_slot
        prow0 = proj_ptr + b * T * sp_b
        _move_tail(prow0, sp_b, tail, v_off + h * DV + vv, vm, n, sc_c, sc_t, KERNEL - 1, TAIL_P)
        # arrive: the barrier orders every thread's loads and stores above before the (one-thread) release
        tl.debug_barrier()
        Hk = tl.num_programs(0) // (REP * N_SPLIT)
        count = count_ptr + (l * tl.num_programs(1) + b) * Hk + hk
        if tl.atomic_add(count, 1, sem="acq_rel") == REP * N_SPLIT - 1:
            # every program of the group has read the q/k tail channels
            _move_tail(prow0, sp_b, tail, hk * DK + kk, km, n, sc_c, sc_t, KERNEL - 1, TAIL_P)
            _move_tail(prow0, sp_b, tail, k_off + hk * DK + kk, km, n, sc_c, sc_t, KERNEL - 1, TAIL_P)
            tl.store(count, 0)
