"""Gated DeltaNet on a speculative verify step: T tokens per sequence (its newest token, then its drafts) read the
sequence's conv tail and recurrent state; the state is written once, after the first token (the newest one, always
accepted), the tail not at all. After acceptance, `commit` moves every tail on by counts[b] tokens (every layer in one
launch), and the accepted drafts (tokens 1 .. counts[b] - 1) stay pending: the next step that reads the state (a
decode row, the next verify step, or `settle` before a prefix-cache copy) first moves it through them.

Why pending and not committed at once: a state is ~2 MB a layer per sequence (TP=1, fp32), so moving it through the
accepted drafts in a launch of its own read and wrote every state a second time in each verify step (a commit kernel:
2.7 ms of a 23 ms batch-64 step on an H200, against 2.0 for the verify launches); the next step reads and writes
the state anyway, and a few more serial updates in its programs cost far less than the memory. What the replay needs
is kept per slot in `replay` [slots, K, Hk*dk + Hv*dv + 2*Hv] (model dtype): for tokens 1 .. T-1 their conv output's
k and v channels (after SiLU, rounded: what the update reads) and their b and a, ~12 KB a token and layer at TP=1;
`pending` [slots] (int64, shared by the layers) says how many of a slot's rows its state has not taken yet: the
runner sets it to counts - 1 after a verify step and clears it after any other step and after `settle`.
deltanet.replay_torch is the rule: each row's update is the token's own, bit for bit.

Both ops compute, token by token, exactly what single calls of layers/deltanet.py decode_torch compute (the same
conv window per token, the same delta-rule update and readout): the outputs of verify equal the pending drafts'
and then T single decode steps' (the drafts' outputs dropped), and after commit(counts) and a settle the state and
tail equal pending + counts[b] single decode steps (exact in fp32, torch pair).

Rows are contiguous per sequence: sequence b's tokens are rows b*T .. b*T + T - 1 of proj.
    verify_torch / verify_fast (proj, conv_state, ssm_state, slots, conv_weight, A_log, dt_bias, norm_weight, eps, T,
                                replay, pending, row) -> y [B*T, Hv*dv]; ssm_state[slots] moved through the pending
                                drafts and the first token, replay[slots, :T-1] the other tokens'
    commit_torch / commit_fast (steps: list[VerifyStep], counts) -> None; for every layer, conv_state[slots] moved
                                on by counts[b] tokens (1 <= counts[b] <= T)
    settle_torch / settle_fast (ssm_state, slots, replay, pending, A_log, dt_bias) -> None; one layer's states moved
                                through their pending drafts (pending left as it is: deltanet.settle clears it)
No host sync in any (counts and pending stay on the device).

The fast verify is one launch a layer (the gated norm inside it) and the commit one launch for every layer: it finds
each layer's proj rows and conv tails in a table of addresses in device memory that the layer's verify launch wrote
(row `row`, from its own pointer arguments), so no host-to-device copy is needed inside a CUDA graph and the table
always names the buffers of the step being committed.
"""
from __future__ import annotations

from typing import NamedTuple

import torch

from layers import backend
from layers.backend import pdl, prior_done, round_to, tl, triton
from layers.deltanet import (L2_EPS, _dims, conv_column, decode_launch, delta_rule_step, gates_torch, replay_args,
                             replay_key_heads, replay_torch, split_proj, split_qkv, state_args)
from layers.norm import gated_rms_norm_torch


class VerifyStep(NamedTuple):
    """One layer's verify step, kept for its commit: the projection rows it computed, the conv tails it read, the
    step's slots and tokens per sequence, and the row of the commit table its fast launch wrote."""
    proj: torch.Tensor
    conv_state: torch.Tensor
    slots: torch.Tensor
    T: int
    row: int


def _windows(proj, conv_state, slots, conv_dim, Hv, dv, T):
    """(u, z, b, a) as [B, T, ...] and the conv's input sequence (_conv_inputs)."""
    B = proj.shape[0] // T
    u, z, b, a = split_proj(proj.view(B, T, -1), conv_dim, Hv, dv)
    return u, z, b, a, _conv_inputs(u, conv_state, slots)


def _conv_inputs(u, conv_state, slots):
    """The conv's input sequence [B, C, K-1 + T]: the cached tail, then the T inputs u [B, T, C]."""
    return torch.cat([conv_state[slots], u.transpose(1, 2)], dim=-1)


def verify_torch(proj, conv_state, ssm_state, slots, conv_weight, A_log, dt_bias, norm_weight, eps: float, T: int,
                 replay: torch.Tensor, pending: torch.Tensor, row: int = 0):
    """Outputs of T tokens per sequence on its state after its pending drafts (module docstring); the state written
    after the first token, the other tokens' replay rows written, the tail untouched (row: the fast op's)."""
    Hk, Hv, dk, dv, conv_dim = _dims(conv_state, ssm_state)
    K = conv_weight.shape[-1]
    u, z, b, a, seq = _windows(proj, conv_state, slots, conv_dim, Hv, dv, T)
    state = replay_torch(ssm_state[slots], replay[slots], pending[slots], A_log, dt_bias, Hk, dk)
    y, rows = [], []
    for t in range(T):
        # (everything per token on decode_torch's shapes: the same shapes take the same vectorised code paths, so
        # the results are the same bits)
        g, beta = gates_torch(a[:, t], b[:, t], A_log, dt_bias)
        c = conv_column(seq[..., t:t + K], conv_weight)
        q, k, v = split_qkv(c, Hk, Hv, dk, dv)
        state = delta_rule_step(state, k, v, g, beta)
        if t == 0:
            ssm_state[slots] = state
        else:
            rows.append(torch.cat([c[:, Hk * dk:], b[:, t], a[:, t]], dim=-1))
        o = torch.einsum("bhkv,bhk->bhv", state, q).to(u.dtype)
        y.append(gated_rms_norm_torch(o, z[:, t], norm_weight, eps).flatten(1))
    if rows:
        replay[slots, :T - 1] = torch.stack(rows, dim=1)
    return torch.stack(y, dim=1).flatten(0, 1)


def commit_torch(steps: list[VerifyStep], counts: torch.Tensor) -> None:
    """Move each layer's conv tails on by counts[b] tokens of its verify step, layer by layer."""
    for s in steps:
        B, tail = s.proj.shape[0] // s.T, s.conv_state.shape[-1]
        seq = _conv_inputs(s.proj.view(B, s.T, -1)[..., :s.conv_state.shape[1]], s.conv_state, s.slots)
        # the tail after n tokens: inputs n .. n + K - 2 of the sequence [tail, T inputs]
        at = counts[:, None] + torch.arange(tail, device=seq.device)[None, :]
        s.conv_state[s.slots] = seq.gather(2, at[:, None, :].expand(-1, seq.shape[1], -1))


def settle_torch(ssm_state, slots, replay, pending, A_log, dt_bias) -> None:
    """One layer's states at `slots` moved through their pending drafts."""
    ssm_state[slots] = replay_torch(ssm_state[slots], replay[slots], pending[slots], A_log, dt_bias,
                                    replay_key_heads(ssm_state, replay), ssm_state.shape[2])


# ------------------------------------------------------------------------------------------------ fast
TABLE_FIELDS = 2  # a commit table row: the addresses of proj and conv_state
_TABLES: dict[torch.device, torch.Tensor] = {}  # (backend.graph_scratch)
_RECORDED: dict[torch.device, dict[int, tuple]] = {}  # the host's copy of what each row names


def _fields(t: VerifyStep) -> tuple:
    return t.proj, t.conv_state


def verify_fast(proj, conv_state, ssm_state, slots, conv_weight, A_log, dt_bias, norm_weight, eps: float, T: int,
                replay: torch.Tensor, pending: torch.Tensor, row: int = 0):
    """verify_torch in one launch: the pending drafts and then the T tokens of each (sequence, value-head block) in
    one program (the state slab in registers, read once, written after the first token; the conv windows from the
    cached tail and the proj rows), each token's readout stored, and its v columns of the replay rows; the last
    program of each (sequence, qk-head) group to arrive (every program of the group has read the old replay rows by
    then) applies the gated RMSNorm to its heads' rows (as decode_fast's) and writes the group's k, b and a entries of
    the replay rows. Program (0, 0) writes this layer's addresses into row `row` of the commit table, for
    commit_fast."""
    if conv_weight.shape[-1] > 4:
        raise ValueError(f"verify_fast: conv kernels of at most 4 taps (the window slides through 3 registers); "
                         f"this one has {conv_weight.shape[-1]}; verify_torch takes any")
    Hk, Hv, dk, dv, conv_dim = _dims(conv_state, ssm_state)
    y = torch.empty(proj.shape[0], Hv * dv, dtype=proj.dtype, device=proj.device)
    table = backend.graph_scratch(_TABLES, "commit table rows", row + 1, proj.device, torch.int64, 64,
                                  (TABLE_FIELDS,))
    _RECORDED.setdefault(proj.device, {})[row] = (proj.data_ptr(), conv_state.data_ptr())
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
        *replay_args(replay, pending, proj, Hk, Hv, dk, dv),
        proj.stride(0), *conv_state.stride(), conv_weight.stride(0), conv_weight.stride(2), *state_args(ssm_state),
        y.stride(0), Hk * dk, 2 * Hk * dk, z_off, b_off, b_off + Hv, dk ** -0.5, L2_EPS, eps,
        KERNEL=conv_weight.shape[-1], REP=rep, REP_P2=triton.next_power_of_2(rep), N_SPLIT=n_split, DK=dk, DV=dv,
        BK=triton.next_power_of_2(dk), BV=BV, BV_HEAD=triton.next_power_of_2(dv), FIELDS=TABLE_FIELDS,
        num_warps=warps, **pdl())
    return y


# conv channels a commit program moves (its tails of every channel: data movement only)
COMMIT_BLOCK_C = 256


def commit_fast(steps: list[VerifyStep], counts: torch.Tensor) -> None:
    """commit_torch in one launch for every layer: program (c, b, l) moves channels [c*BLOCK, (c+1)*BLOCK) of
    sequence b's tail in layer l on by counts[b] (its tensors from row l of the commit table, which layer l's
    verify_fast wrote: steps[l].row must be l). The layers must share shapes, strides and dtypes, the slots and T."""
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
    T, L = first.T, len(steps)
    B = first.proj.shape[0] // T
    if not B:
        return
    conv_dim, tail = first.conv_state.shape[1:]
    _commit_kernel[(triton.cdiv(conv_dim, COMMIT_BLOCK_C), B, L)](
        _TABLES[device], *_fields(first), first.slots, counts, T, conv_dim, first.proj.stride(0),
        *first.conv_state.stride(), TAIL=tail, TAIL_P=triton.next_power_of_2(tail), BLOCK_C=COMMIT_BLOCK_C,
        FIELDS=TABLE_FIELDS, num_warps=4, **pdl())


def settle_fast(ssm_state, slots, replay, pending, A_log, dt_bias) -> None:
    """settle_torch in one launch: program (h * n_split + j, b) moves its slab through its slot's pending drafts and
    writes it (not at all where none are pending)."""
    B = slots.shape[0]
    if not B:
        return
    Hv, dk, dv = ssm_state.shape[1:]
    Hk = replay_key_heads(ssm_state, replay)
    BV, warps = decode_launch(dk, dv, B)
    n_split = triton.cdiv(dv, BV)
    _settle_kernel[(Hv * n_split, B)](
        ssm_state, slots, A_log, dt_bias, *replay_args(replay, pending, ssm_state, Hk, Hv, dk, dv),
        *state_args(ssm_state), L2_EPS, REP=Hv // Hk, N_SPLIT=n_split, DK=dk, DV=dv, BK=triton.next_power_of_2(dk),
        BV=BV, num_warps=warps, **pdl())


if triton is not None:
    from layers.deltanet import _beta, _gated_norm_group, _load_slab, _replay, _rule, _slab, _softplus, _store_slab

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
    def _tail_inputs(tail, ch, mask, sc_c, sc_t, KERNEL: tl.constexpr):
        """The conv's inputs before a step's first token at channels `ch`, fp32: (x1, x2, x3), the cached tail's
        K-1 entries right-aligned (x3 the newest; slots before the oldest entry, K < 4, are zeros and never read)."""
        x1 = tl.zeros(ch.shape, dtype=tl.float32)
        x2, x3 = x1, x1
        if KERNEL >= 4:
            x1 = tl.load(tail + ch * sc_c + (KERNEL - 4) * sc_t, mask=mask, other=0.0).to(tl.float32)
        if KERNEL >= 3:
            x2 = tl.load(tail + ch * sc_c + (KERNEL - 3) * sc_t, mask=mask, other=0.0).to(tl.float32)
        if KERNEL >= 2:
            x3 = tl.load(tail + ch * sc_c + (KERNEL - 2) * sc_t, mask=mask, other=0.0).to(tl.float32)
        return x1, x2, x3

    @triton.jit
    def _slide_silu(x1, x2, x3, u, w_ptr, ch, mask, sw_c, sw_t, KERNEL: tl.constexpr, DTYPE: tl.constexpr):
        """The conv column of the token whose input is u, the K-1 inputs before it in (x1, x2, x3): taps in order,
        accumulated in fp32 and rounded to DTYPE, then SiLU rounded again (_window_silu's operations, the same
        bits). fp32 result."""
        acc = tl.zeros(ch.shape, dtype=tl.float32)
        if KERNEL >= 4:
            acc += x1 * tl.load(w_ptr + ch * sw_c + (KERNEL - 4) * sw_t, mask=mask, other=0.0).to(tl.float32)
        if KERNEL >= 3:
            acc += x2 * tl.load(w_ptr + ch * sw_c + (KERNEL - 3) * sw_t, mask=mask, other=0.0).to(tl.float32)
        if KERNEL >= 2:
            acc += x3 * tl.load(w_ptr + ch * sw_c + (KERNEL - 2) * sw_t, mask=mask, other=0.0).to(tl.float32)
        acc += u * tl.load(w_ptr + ch * sw_c + (KERNEL - 1) * sw_t, mask=mask, other=0.0).to(tl.float32)
        y = round_to(acc, DTYPE)
        return round_to(y * tl.sigmoid(y), DTYPE)

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
                       y_ptr, count_ptr, table_ptr, row, T, replay_ptr, pending_ptr, sr_slot, sr_t, rv_off, rb_off,
                       ra_off, sp_b, sc_slot, sc_c, sc_t, sw_c, sw_t, ss_slot, ss_h, sy_b, k_off, v_off,
                       z_off, b_off, a_off, scale, l2_eps, eps,
                       KERNEL: tl.constexpr, REP: tl.constexpr, REP_P2: tl.constexpr, N_SPLIT: tl.constexpr,
                       DK: tl.constexpr, DV: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr,
                       BV_HEAD: tl.constexpr, FIELDS: tl.constexpr):
        """Value columns [j*BV, (j+1)*BV) of value head h of sequence b, program (h * N_SPLIT + j, b): the slab is
        read, moved through the slot's pending drafts, then its T tokens in order (the decode kernel's step per
        token), written after the first token (always accepted); each token's readout o (rounded) goes to row b*T + t
        of y, tokens 1.. T-1's v columns to the slot's replay rows 0 .. T-2. The last program of the (b, qk-head)
        group to arrive normalises and gates the group's heads in all T rows (_gated_norm_group), writes the group's
        k, b and a entries of the replay rows and resets the counter."""
        prior_done()  # (backend.pdl: the kernels before this one have finished)
        pid, b = tl.program_id(0), tl.program_id(1).to(tl.int64)
        h, j = pid // N_SPLIT, pid % N_SPLIT
        hk = h // REP
        dtype = proj_ptr.dtype.element_ty
        if (pid == 0) & (b == 0):  # this layer's tensors, for the commit (the module docstring)
            entry = table_ptr + row * FIELDS
            tl.store(entry + 0, proj_ptr.to(tl.int64, bitcast=True))
            tl.store(entry + 1, conv_ptr.to(tl.int64, bitcast=True))
        kk, vv = tl.arange(0, BK), j * BV + tl.arange(0, BV)
        km, vm = kk < DK, vv < DV
        slot = tl.load(slots_ptr + b).to(tl.int64)
        ptrs = _slab(state_ptr + slot * ss_slot + h * ss_h, kk, vv, DV)
        S = _load_slab(ptrs, kk, vv, DK, DV, BK, BV)  # (first: its bytes come from HBM)
        n = tl.load(pending_ptr + slot)
        decay_scale = -tl.exp(tl.load(A_log_ptr + h).to(tl.float32))
        bias = tl.load(dt_bias_ptr + h).to(tl.float32)
        tail = conv_ptr + slot * sc_slot
        prow0 = proj_ptr + b * T * sp_b
        rows = replay_ptr + slot * sr_slot
        S = _replay(S, rows, sr_t, n, h, hk, kk, vv, km, vm, decay_scale, bias, l2_eps, rv_off, rb_off, ra_off, DK,
                    DV)
        tl.debug_barrier()  # (every thread's replay loads before the stores into the same rows below)
        # each token's conv window slides along the sequence [tail, the row's T inputs]: one new input a token
        # (its proj row), where loading every window whole took 8 loads a tap (L1TEX waits were 40% of the stalls)
        cq, ck, cv = hk * DK + kk, k_off + hk * DK + kk, v_off + h * DV + vv
        q1, q2, q3 = _tail_inputs(tail, cq, km, sc_c, sc_t, KERNEL)
        k1, k2, k3 = _tail_inputs(tail, ck, km, sc_c, sc_t, KERNEL)
        v1, v2, v3 = _tail_inputs(tail, cv, vm, sc_c, sc_t, KERNEL)
        for t in range(T):
            prow = prow0 + t * sp_b
            uq = tl.load(prow + cq, mask=km, other=0.0).to(tl.float32)
            uk = tl.load(prow + ck, mask=km, other=0.0).to(tl.float32)
            uv = tl.load(prow + cv, mask=vm, other=0.0).to(tl.float32)
            a_raw, b_raw = tl.load(prow + a_off + h), tl.load(prow + b_off + h)
            q = _slide_silu(q1, q2, q3, uq, conv_w_ptr, cq, km, sw_c, sw_t, KERNEL, dtype)
            k = _slide_silu(k1, k2, k3, uk, conv_w_ptr, ck, km, sw_c, sw_t, KERNEL, dtype)
            v = _slide_silu(v1, v2, v3, uv, conv_w_ptr, cv, vm, sw_c, sw_t, KERNEL, dtype)
            q1, q2, q3 = q2, q3, uq
            k1, k2, k3 = k2, k3, uk
            v1, v2, v3 = v2, v3, uv
            q = q * tl.rsqrt(tl.sum(q * q, 0) + l2_eps) * scale
            k = k * tl.rsqrt(tl.sum(k * k, 0) + l2_eps)
            decay = tl.exp(decay_scale * _softplus(a_raw.to(tl.float32) + bias))
            beta = _beta(b_raw)
            S = _rule(S, k, v, decay, beta)
            if t == 0:
                _store_slab(ptrs, S, kk, vv, DK, DV, BK, BV)
            else:
                tl.store(rows + (t - 1) * sr_t + rv_off + h * DV + vv, v.to(dtype), mask=vm)
            o = round_to(tl.sum(S * q[:, None], 0), dtype)
            tl.store(y_ptr + (b * T + t) * sy_b + h * DV + vv, o.to(dtype), mask=vm)
        # arrive: the barrier orders every thread's loads and stores above before the (one-thread) release
        tl.debug_barrier()
        count = count_ptr + b * (tl.num_programs(0) // (REP * N_SPLIT)) + hk
        if tl.atomic_add(count, 1, sem="acq_rel") == REP * N_SPLIT - 1:
            rr = tl.arange(0, REP_P2)
            heads = hk * REP + rr
            for t in range(T):
                _gated_norm_group(y_ptr + (b * T + t) * sy_b, prow0 + t * sp_b + z_off, norm_w_ptr, hk, eps, REP,
                                  REP_P2, DV, BV_HEAD)
                if t > 0:
                    dst = rows + (t - 1) * sr_t
                    k = _window_silu(prow0, sp_b, t, tail, conv_w_ptr, k_off + hk * DK + kk, km, sc_c, sc_t, sw_c,
                                     sw_t, KERNEL, dtype)
                    tl.store(dst + hk * DK + kk, k.to(dtype), mask=km)
                    prow = prow0 + t * sp_b
                    tl.store(dst + rb_off + heads, tl.load(prow + b_off + heads, mask=rr < REP), mask=rr < REP)
                    tl.store(dst + ra_off + heads, tl.load(prow + a_off + heads, mask=rr < REP), mask=rr < REP)
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
    def _commit_kernel(table_ptr, proj0, conv0, slots_ptr, counts_ptr, T, conv_dim, sp_b, sc_slot, sc_c, sc_t,
                       TAIL: tl.constexpr, TAIL_P: tl.constexpr, BLOCK_C: tl.constexpr, FIELDS: tl.constexpr):
        """Channels [c*BLOCK_C, (c+1)*BLOCK_C) of sequence b's conv tail in layer l, program (c, b, l), moved on by
        counts[b] tokens of its verify step (layer l's tensors from row l of the commit table; the *0 arguments give
        their types)."""
        prior_done()  # (backend.pdl: the kernels before this one have finished, the table written)
        c, b, l = tl.program_id(0), tl.program_id(1).to(tl.int64), tl.program_id(2)
        entry = table_ptr + l * FIELDS
        proj_ptr = _address(entry + 0, proj0)
        conv_ptr = _address(entry + 1, conv0)
        ch = c * BLOCK_C + tl.arange(0, BLOCK_C)
        tail = conv_ptr + tl.load(slots_ptr + b).to(tl.int64) * sc_slot
        _move_tail(proj_ptr + b * T * sp_b, sp_b, tail, ch, ch < conv_dim, tl.load(counts_ptr + b), sc_c, sc_t, TAIL,
                   TAIL_P)

    @triton.jit
    def _settle_kernel(state_ptr, slots_ptr, A_log_ptr, dt_bias_ptr, replay_ptr, pending_ptr, sr_slot, sr_t, rv_off,
                       rb_off, ra_off, ss_slot, ss_h, l2_eps, REP: tl.constexpr, N_SPLIT: tl.constexpr,
                       DK: tl.constexpr, DV: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr):
        """Value columns [j*BV, (j+1)*BV) of value head h of sequence b, program (h * N_SPLIT + j, b): the slab moved
        through the slot's pending drafts and written (untouched where none are pending)."""
        prior_done()  # (backend.pdl: the kernels before this one have finished)
        pid, b = tl.program_id(0), tl.program_id(1).to(tl.int64)
        h, j = pid // N_SPLIT, pid % N_SPLIT
        slot = tl.load(slots_ptr + b).to(tl.int64)
        n = tl.load(pending_ptr + slot)
        if n > 0:
            kk, vv = tl.arange(0, BK), j * BV + tl.arange(0, BV)
            km, vm = kk < DK, vv < DV
            ptrs = _slab(state_ptr + slot * ss_slot + h * ss_h, kk, vv, DV)
            S = _load_slab(ptrs, kk, vv, DK, DV, BK, BV)
            decay_scale = -tl.exp(tl.load(A_log_ptr + h).to(tl.float32))
            bias = tl.load(dt_bias_ptr + h).to(tl.float32)
            S = _replay(S, replay_ptr + slot * sr_slot, sr_t, n, h, h // REP, kk, vv, km, vm, decay_scale, bias,
                        l2_eps, rv_off, rb_off, ra_off, DK, DV)
            _store_slab(ptrs, S, kk, vv, DK, DV, BK, BV)
