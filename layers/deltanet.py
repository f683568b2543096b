"""Gated DeltaNet (spec §3): projections, causal depthwise conv with a cached tail, and the gated delta rule with
an fp32 recurrent state per sequence, addressed by state slot.

TP split: each rank takes a contiguous block of key heads and the value heads that use them (v-head j reads
qk-head j // (Hv/Hk), so a block of Hv/tp value heads maps onto a block of Hk/tp key heads). The q, k and v row
blocks of in_proj_qkv (and the conv channels, which follow them one to one) are each split that way; z, b, a,
A_log and dt_bias follow the value heads; out_proj is split by input columns and all-reduced by the caller.

The four input projections read the same x: one GEMM computes proj = u | z | b | a (layers/linear.py fuse_rows),
with u = q | k | v the conv's input. Then:
- decode (every sequence feeds one token onto its state): one op, `decode_torch` (the oracle) or `decode_fast`
  (one Triton kernel: conv step + SiLU, l2-norms, decay and beta, delta rule in place, readout, gated RMSNorm);
- any other step (`mixed_torch`, the per-sequence reference, or `mixed_fast`): the decode rows take the decode op
  in one batch; the other sequences take the chunked (UT transform) form, in the varlen prefill kernels of
  layers/deltanet_prefill.py with the gates and the gated norm one kernel each (fast), or sequence by sequence
  (torch).
The recurrent and chunked forms compute the same function (as the reference, which uses each in its phase).
"""
from __future__ import annotations

import itertools
from typing import NamedTuple

import torch
import torch.nn.functional as F
from torch import nn

from dist import parallel
from layers import backend
from layers.backend import next_may_start, pdl, prior_done, round_to, tl, triton
from layers.deltanet_prefill import (CHUNK, L2_EPS, causal_conv1d_varlen_fast, chunk_delta_rule_varlen_fast,
                                     chunked_gated_delta_rule, l2norm)
from layers.forward_batch import ForwardBatch
from layers.linear import Linear, even_split, fuse_rows, linear_fast, linear_torch, make_param
from layers.norm import GatedRMSNorm, gated_rms_norm_torch

# Launch settings of decode_fast (module level so that the benchmark can sweep them; the signatures stay equal).
# block_v: value columns of a head per program (its fp32 state slab is [dk, block_v]; smaller slabs put more
# programs in flight at small batches and more state loads in flight per SM at large ones); warps: per program,
# capped so that every thread holds 32 slab elements or more (decode_launch). From `batched_from` rows on, the
# batched_* values: `python -m benchmarks.bench_deltanet --sweep` (1x H200, 2026-11-26, the state slab loaded first)
# gave 32 x 4 warps at one row (5.4 us; 64 x 2 not in the best four), the two within 0.1 us at 2 rows, and 64 x 2
# best from 4 rows (7.8 against 8.1 us at 4, 11.1 / 13.8 at 8, 44.9 / 52.0 at 32, 82.7 / 97.1 at 64: 79% of the
# copy rate against 67%).
DECODE_CONFIG = {"block_v": 32, "warps": 4, "batched_from": 4, "batched_block_v": 64, "batched_warps": 2}


# ------------------------------------------------------------------------------------------- shared torch math
def split_proj(proj: torch.Tensor, conv_dim: int, num_v_heads: int, dv: int):
    """proj [T, conv_dim + Hv*dv + 2*Hv] -> views u [T, conv_dim], z [T, Hv, dv], b [T, Hv], a [T, Hv]."""
    u, z, b, a = proj.split([conv_dim, num_v_heads * dv, num_v_heads, num_v_heads], -1)
    return u, z.unflatten(-1, (num_v_heads, dv)), b, a


def gates_torch(a: torch.Tensor, b: torch.Tensor, A_log: torch.Tensor, dt_bias: torch.Tensor):
    """(g, beta) in fp32: g = -exp(A_log) * softplus(a + dt_bias) (the log decay, <= 0, all fp32);
    beta = sigmoid(b) in the model dtype, then fp32 (spec §3.2)."""
    g = -A_log.float().exp() * F.softplus(a.float() + dt_bias.float())
    return g, b.sigmoid().float()


def gates_fast(a: torch.Tensor, b: torch.Tensor, A_log: torch.Tensor, dt_bias: torch.Tensor):
    """gates_torch in one launch (a, b [T, Hv], may be strided views of the fused projection); softplus as torch's
    (threshold 20) and the decode kernel's."""
    T, H = a.shape
    g = torch.empty(T, H, dtype=torch.float32, device=a.device)
    beta = torch.empty(T, H, dtype=torch.float32, device=a.device)
    if T:
        block_h = triton.next_power_of_2(H)
        block_t = max(1, 1024 // block_h)
        _gates_kernel[(triton.cdiv(T, block_t),)](a, b, A_log, dt_bias, g, beta, T, H, a.stride(0), b.stride(0),
                                                  BLOCK_T=block_t, BLOCK_H=block_h, num_warps=4, **pdl())
    return g, beta


def split_qkv(c: torch.Tensor, num_k_heads: int, num_v_heads: int, dk: int, dv: int):
    """Conv output [n, C] -> q (l2-normed, scaled by dk^-0.5), k (l2-normed), v in fp32, per value head: [n, Hv, d]."""
    n = c.shape[0]
    q, kv = c.split([num_k_heads * dk, num_k_heads * dk + num_v_heads * dv], -1)
    rep = num_v_heads // num_k_heads
    q = (l2norm(q.float().view(n, -1, dk)) * dk ** -0.5).repeat_interleave(rep, dim=1)
    return (q, *split_kv(kv, num_k_heads, num_v_heads, dk, dv))


def split_kv(kv: torch.Tensor, num_k_heads: int, num_v_heads: int, dk: int, dv: int):
    """The k and v channels of a conv output [n, Hk*dk + Hv*dv] -> k (l2-normed), v in fp32: [n, Hv, d]."""
    n = kv.shape[0]
    k, v = kv.split([num_k_heads * dk, num_v_heads * dv], -1)
    k = l2norm(k.float().view(n, -1, dk)).repeat_interleave(num_v_heads // num_k_heads, dim=1)
    return k, v.float().view(n, -1, dv)


def conv_column(window: torch.Tensor, conv_weight: torch.Tensor) -> torch.Tensor:
    """The conv's output column over `window` [B, C, K] (each channel's K tap inputs, oldest first): accumulated in
    fp32 and rounded like a conv1d in the window's dtype, then SiLU: [B, C] in the window's dtype."""
    return F.silu((window.float() * conv_weight[:, 0, :].float()).sum(-1).to(window.dtype))


def conv_column_qkv(window: torch.Tensor, conv_weight: torch.Tensor, Hk: int, Hv: int, dk: int, dv: int):
    """q, k, v (split_qkv) of conv_column(window)."""
    return split_qkv(conv_column(window, conv_weight), Hk, Hv, dk, dv)


def replay_torch(state: torch.Tensor, rows: torch.Tensor, n: torch.Tensor, A_log: torch.Tensor,
                 dt_bias: torch.Tensor, Hk: int, dk: int) -> torch.Tensor:
    """B states [B, Hv, dk, dv] (fp32) after the first n[b] of their replay rows [B, K, Hk*dk + Hv*dv + 2*Hv]
    (layers/deltanet_verify.py: a verify step's accepted drafts, held back from the state): each row the token's
    conv output at its k and v channels, then its b and a, so the update is the token's own, bit for bit."""
    Hv, dv = state.shape[1], state.shape[3]
    for t in range(rows.shape[1]):
        kv, b, a = rows[:, t].split([Hk * dk + Hv * dv, Hv, Hv], -1)
        k, v = split_kv(kv, Hk, Hv, dk, dv)
        g, beta = gates_torch(a, b, A_log, dt_bias)
        state = torch.where((t < n)[:, None, None, None], delta_rule_step(state, k, v, g, beta), state)
    return state


def delta_rule_step(state: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor):
    """One token of the gated delta rule on B states [B, H, dk, dv] (fp32): decay by exp(g), then move the state's
    readout at k towards v by beta. Returns the new states."""
    state = state * g.exp()[:, :, None, None]
    delta = (v - torch.einsum("bhkv,bhk->bhv", state, k)) * beta[..., None]
    return state + k[..., None] * delta[:, :, None, :]


def recurrent_gated_delta_rule(q, k, v, g, beta, state):
    """q, k: [n, H, dk]; v: [n, H, dv]; g, beta: [n, H]; state: [H, dk, dv]; all fp32. Returns (o [n, H, dv], state)."""
    out = torch.empty_like(v)
    for t in range(q.shape[0]):
        state = state * g[t].exp()[:, None, None]
        predicted = torch.einsum("hkv,hk->hv", state, k[t])
        delta = (v[t] - predicted) * beta[t][:, None]
        state = state + k[t][:, :, None] * delta[:, None, :]
        out[t] = torch.einsum("hkv,hk->hv", state, q[t])
    return out, state


def _dims(conv_state: torch.Tensor, ssm_state: torch.Tensor):
    """(Hk, Hv, dk, dv, conv_dim) of this rank, read off the caches: the op needs no config."""
    conv_dim, (Hv, dk, dv) = conv_state.shape[1], ssm_state.shape[1:]
    return (conv_dim - Hv * dv) // (2 * dk), Hv, dk, dv, conv_dim


def decode_torch(proj, conv_state, ssm_state, slots, conv_weight, A_log, dt_bias, norm_weight, eps: float,
                 out: torch.Tensor | None = None, replay: torch.Tensor | None = None,
                 pending: torch.Tensor | None = None):
    """One token for each of B sequences on existing states -> y [B, Hv*dv] in proj's dtype, ready for out_proj
    (written into `out`, a contiguous [B, Hv*dv] view, where given).

    proj [B, conv_dim + Hv*dv + 2*Hv] is the fused projection u | z | b | a; conv_state [slots, conv_dim, K-1]
    (raw inputs, oldest first) and ssm_state [slots, Hv, dk, dv] (fp32) are updated in place at `slots` [B].
    With speculation, each state first takes its slot's pending replay rows (replay [slots, K, ...], pending
    [slots]: layers/deltanet_verify.py; pending is left for the caller to clear). All sequences at once, no host
    sync (CUDA-graph safe)."""
    Hk, Hv, dk, dv, conv_dim = _dims(conv_state, ssm_state)
    u, z, b, a = split_proj(proj, conv_dim, Hv, dv)
    g, beta = gates_torch(a, b, A_log, dt_bias)
    window = torch.cat([conv_state[slots], u.unsqueeze(-1)], dim=-1)              # [B, C, K]
    conv_state[slots] = window[..., 1:]
    q, k, v = conv_column_qkv(window, conv_weight, Hk, Hv, dk, dv)                 # the conv's last column
    state = ssm_state[slots]
    if replay is not None:
        state = replay_torch(state, replay[slots], pending[slots], A_log, dt_bias, Hk, dk)
    state = delta_rule_step(state, k, v, g, beta)                                   # [B, H, dk, dv]
    ssm_state[slots] = state
    o = torch.einsum("bhkv,bhk->bhv", state, q).to(u.dtype)
    y = gated_rms_norm_torch(o, z, norm_weight, eps).flatten(1)
    return y if out is None else out.copy_(y)


def decode_fast(proj, conv_state, ssm_state, slots, conv_weight, A_log, dt_bias, norm_weight, eps: float,
                out: torch.Tensor | None = None, replay: torch.Tensor | None = None,
                pending: torch.Tensor | None = None):
    """decode_torch in one Triton kernel. Program (h * n_split + j, b) owns value columns [j*BV, (j+1)*BV) of value
    head h of sequence b: the [dk, BV] slab of its fp32 state, read once and written once in place (the delta rule is
    column-separable given k, q, beta, the decay and the slab's v columns). Each program computes in-program the conv
    step + SiLU of the channels it reads (the q and k channels of its qk-head, its own v columns) from the cached
    tail and the new proj column, then the l2-norms, decay and beta, the rule and the readout o (rounded to the model
    dtype), which it stores in y unnormalised.

    The REP * n_split programs of one (sequence, qk-head) form a group that shares two things the programs cannot
    split: the q/k conv tail (every program reads it, so it may be shifted only after all have) and the gated RMSNorm
    (it needs all dv outputs of each head). Each program counts itself in the group's counter (an int atomic with
    release/acquire, after a CTA barrier); the one that arrives last shifts the q/k tail, normalises and gates the
    group's REP heads of y, and resets the counter to zero for the next launch. Its own v tail columns each program
    shifts itself, so every tail channel is written exactly once. No float atomics: the results do not depend on the
    order the programs run in, and the launch settings depend on shapes only (CUDA-graph safe). With `replay`, each
    program first moves its slab through its slot's pending replay rows (decode_torch), a variant of its own."""
    Hk, Hv, dk, dv, conv_dim = _dims(conv_state, ssm_state)
    B = proj.shape[0]
    y = torch.empty(B, Hv * dv, dtype=proj.dtype, device=proj.device) if out is None else out
    if B == 0:
        return y
    BK = triton.next_power_of_2(dk)
    BV, warps = decode_launch(dk, dv, B)
    n_split = triton.cdiv(dv, BV)
    z_off = conv_dim
    b_off = z_off + Hv * dv
    rep = Hv // Hk
    _decode_kernel[(Hv * n_split, B)](
        proj, conv_state, conv_weight, ssm_state, slots, A_log, dt_bias, norm_weight, y,
        backend.arrival_counters(B * Hk, proj.device), *replay_args(replay, pending, proj, Hk, Hv, dk, dv),
        proj.stride(0), *conv_state.stride(), conv_weight.stride(0), conv_weight.stride(2), *state_args(ssm_state),
        y.stride(0), Hk * dk, 2 * Hk * dk, z_off, b_off, b_off + Hv, dk ** -0.5, L2_EPS, eps,
        KERNEL=conv_weight.shape[-1], REP=rep, REP_P2=triton.next_power_of_2(rep), N_SPLIT=n_split, DK=dk, DV=dv,
        BK=BK, BV=BV, BV_HEAD=triton.next_power_of_2(dv), REPLAY=replay is not None, EARLY=backend.early_launch(B),
        num_warps=warps, **pdl())
    return y


def state_args(ssm_state: torch.Tensor) -> tuple[int, int]:
    """The slot and head strides of the recurrent states [slots, Hv, dk, dv], whose [dk, dv] slabs the kernels
    address as contiguous (_slab)."""
    if ssm_state.stride(3) != 1 or ssm_state.stride(2) != ssm_state.shape[3]:
        raise ValueError(f"the recurrent states must be contiguous in (dk, dv); strides {ssm_state.stride()}")
    return ssm_state.stride(0), ssm_state.stride(1)


def replay_width(Hk: int, Hv: int, dk: int, dv: int) -> int:
    """A replay row's entries (replay_torch): k and v channels of the conv output, b, a."""
    return Hk * dk + Hv * dv + 2 * Hv


def replay_key_heads(ssm_state: torch.Tensor, replay: torch.Tensor) -> int:
    """Hk of a layer, read off its states [slots, Hv, dk, dv] and replay rows (replay_width inverted)."""
    Hv, dk, dv = ssm_state.shape[1:]
    return (replay.shape[-1] - Hv * (dv + 2)) // dk


def replay_args(replay: torch.Tensor | None, pending: torch.Tensor | None, like: torch.Tensor, Hk: int, Hv: int,
                dk: int, dv: int) -> tuple:
    """The replay arguments of the decode, verify and settle kernels: (rows, pending, slot stride, row stride, and
    the v, b, a offsets in a row: replay_torch's layout); stand-ins (never read) without replay."""
    if replay is None:
        return like, like, 0, 0, 0, 0, 0
    if replay.shape[-1] != replay_width(Hk, Hv, dk, dv) or replay.stride(2) != 1:
        raise ValueError(f"replay rows of {replay.shape[-1]} entries (stride {replay.stride(2)}); this layer's are "
                         f"{replay_width(Hk, Hv, dk, dv)}, contiguous")
    v_off = Hk * dk
    b_off = v_off + Hv * dv
    return replay, pending, replay.stride(0), replay.stride(1), v_off, b_off, b_off + Hv


def decode_launch(dk: int, dv: int, rows: int = 1) -> tuple[int, int]:
    """(value columns per program, warps) of decode_fast for `rows` sequences from DECODE_CONFIG and the head dims:
    the slab is capped at the head, and the warps so that each thread holds at least 32 state elements."""
    c = DECODE_CONFIG
    block_v, warps = (c["batched_block_v"], c["batched_warps"]) if rows >= c["batched_from"] else (c["block_v"],
                                                                                                 c["warps"])
    BK = triton.next_power_of_2(dk)
    BV = min(block_v, triton.next_power_of_2(dv))
    return BV, max(1, min(warps, BK * BV // 1024))


# -------------------------------------------------------------------------------------------------- the layer
class GatedDeltaNet(nn.Module):
    def __init__(self, cfg, dtype=None, device=None):
        super().__init__()
        rank, tp = parallel.tp_rank(), parallel.tp_size()
        Hk, Hv = cfg.linear_num_key_heads, cfg.linear_num_value_heads
        dk, dv, hidden = cfg.linear_key_head_dim, cfg.linear_value_head_dim, cfg.hidden_size
        k_start, self.num_k_heads = even_split(Hk, rank, tp)
        v_start, self.num_v_heads = even_split(Hv, rank, tp)
        self.dk, self.dv, self.kernel = dk, dv, cfg.linear_conv_kernel_dim
        kd, vd = Hk * dk, Hv * dv
        qkv_rows = [(k_start * dk, self.num_k_heads * dk), (kd + k_start * dk, self.num_k_heads * dk),
                    (2 * kd + v_start * dv, self.num_v_heads * dv)]
        self.conv_dim = sum(size for _, size in qkv_rows)
        v_heads = [(v_start, self.num_v_heads)]
        self.in_proj_qkv = Linear(hidden, 2 * kd + vd, rows=qkv_rows, dtype=dtype, device=device)
        self.in_proj_z = Linear(hidden, vd, rows=[(v_start * dv, self.num_v_heads * dv)], dtype=dtype, device=device)
        self.in_proj_b = Linear(hidden, Hv, rows=v_heads, dtype=dtype, device=device)
        self.in_proj_a = Linear(hidden, Hv, rows=v_heads, dtype=dtype, device=device)
        # [conv_dim + Hv*dv + 2*Hv, hidden]: one GEMM gives proj = u | z | b | a (split_proj); the loader fills views
        self.in_proj = fuse_rows(self.in_proj_qkv, self.in_proj_z, self.in_proj_b, self.in_proj_a)
        self.conv1d = nn.Module()
        self.conv1d.weight = make_param((2 * kd + vd, 1, self.kernel), [qkv_rows, None, None], dtype, device)
        # A_log is released in fp32 and kept so (as vLLM/SGLang do); the decay is computed in fp32
        self.A_log = make_param((Hv,), [v_heads], torch.float32, device)
        self.dt_bias = make_param((Hv,), [v_heads], dtype, device)
        self.norm = GatedRMSNorm(dv, cfg.rms_norm_eps, device=device)
        self.out_proj = Linear(vd, hidden, cols=[(v_start * dv, self.num_v_heads * dv)], dtype=dtype, device=device)
        # per-slot caches, allocated by the runner:
        # conv_state [slots, conv_dim, kernel-1] (raw pre-conv inputs), ssm_state [slots, Hv_local, dk, dv] fp32;
        # with speculation, replay [slots, K, replay_width] (model dtype) and pending [slots] int64, shared by the
        # layers: a verify step's accepted drafts, held back from the state (layers/deltanet_verify.py)
        self.conv_state: torch.Tensor | None = None
        self.ssm_state: torch.Tensor | None = None
        self.replay: torch.Tensor | None = None
        self.pending: torch.Tensor | None = None
        fast = backend.use_fast()
        self._in_linear = linear_fast if fast else linear_torch
        self._decode_op = decode_fast if fast else decode_torch
        self._mixed = self.mixed_fast if fast else self.mixed_torch
        from layers.deltanet_verify import (commit_fast, commit_torch, settle_fast, settle_torch, verify_fast,
                                            verify_torch)
        self._verify_op = verify_fast if fast else verify_torch
        self._commit_op = commit_fast if fast else commit_torch
        self._settle_op = settle_fast if fast else settle_torch
        self._pending = None  # a verify step (deltanet_verify.VerifyStep), kept for commit
        self.commit_row = 0  # this layer's place among the model's DeltaNet layers (commit: the model sets it)

    def forward(self, x: torch.Tensor, batch: ForwardBatch) -> torch.Tensor:
        proj = self._in_linear(x, self.in_proj)
        if batch.verify_tokens:
            y = self.verify(proj, batch.state_slots, batch.verify_tokens)
        else:
            y = self.decode(proj, batch.state_slots) if batch.is_decode else self._mixed(proj, batch)
        return self.out_proj(y)

    def verify(self, proj: torch.Tensor, slots: torch.Tensor, T: int) -> torch.Tensor:
        """A verify step (T tokens per sequence, rows contiguous): outputs, the state after the pending drafts and the
        first token, the other tokens' replay rows; the tails move on at commit (layers/deltanet_verify.py)."""
        from layers.deltanet_verify import VerifyStep
        if self.replay is None or self.replay.shape[1] < T - 1:
            raise RuntimeError(f"a verify step of {T} tokens needs replay rows for {T - 1} drafts per slot "
                               f"(this layer holds {0 if self.replay is None else self.replay.shape[1]})")
        self._pending = VerifyStep(proj, self.conv_state, slots, T, self.commit_row)
        return self._verify_op(proj, self.conv_state, self.ssm_state, slots, self.conv1d.weight, self.A_log,
                               self.dt_bias, self.norm.weight, self.norm.eps, T, self.replay, self.pending,
                               self.commit_row)

    def decode(self, proj: torch.Tensor, slots: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
        """The decode op of this layer's kernel set on its caches and weights: proj [B, ...] -> y [B, Hv*dv] (into
        `out` where given), each state after its slot's pending drafts."""
        return self._decode_op(proj, self.conv_state, self.ssm_state, slots, self.conv1d.weight, self.A_log,
                               self.dt_bias, self.norm.weight, self.norm.eps, out, self.replay, self.pending)

    def settle(self, slots: torch.Tensor) -> None:
        """Move the states of `slots` through their pending drafts (the caller then clears pending: settle)."""
        if self.replay is not None:
            self._settle_op(self.ssm_state, slots, self.replay, self.pending, self.A_log, self.dt_bias)

    def mixed_torch(self, proj: torch.Tensor, batch: ForwardBatch) -> torch.Tensor:
        """Reference for any step, sequence by sequence: the chunked rule for new sequences and chunks, the recurrent
        rule for one token on a state (as the reference model does in each phase). proj [T, ...] -> y [T, Hv*dv].
        The batch's checkpoints also leave the conv tail and the state after their position in their slot (the
        rule runs in pieces split there: chunk multiples from the sequence's start, so the chunks are the same)."""
        u, z, b, a = split_proj(proj, self.conv_dim, self.num_v_heads, self.dv)
        g, beta = gates_torch(a, b, self.A_log, self.dt_bias)
        o = torch.empty(proj.shape[0], self.num_v_heads, self.dv, dtype=proj.dtype, device=proj.device)
        marks: dict[int, list[tuple[int, int]]] = {}
        for row, pos, dst in batch.checkpoints_cpu:
            marks.setdefault(row, []).append((pos, dst))
        offset = 0
        for row, (n, start, slot) in enumerate(zip(batch.seq_lens_cpu, batch.start_pos_cpu, batch.state_slots_cpu)):
            sl = slice(offset, offset + n)
            cuts = sorted(marks.get(row, ()))
            q, k, v = self._qkv(self._conv(u[sl], slot, start == 0, [(pos - start, dst) for pos, dst in cuts]))
            state = self._zero_state(proj.device) if start == 0 else self._settled_state(slot)
            if n == 1 and start > 0:
                o[sl], state = recurrent_gated_delta_rule(q, k, v, g[sl], beta[sl], state)
            else:
                done = 0
                for end, dst in cuts + [(start + n, None)]:
                    piece = slice(done, end - start)
                    o_piece, state = chunked_gated_delta_rule(q[piece], k[piece], v[piece], g[sl][piece],
                                                              beta[sl][piece], state, CHUNK)
                    o[offset + done:offset + end - start] = o_piece.to(proj.dtype)
                    if dst is not None:
                        self.ssm_state[dst] = state
                    done = end - start
            self.ssm_state[slot] = state
            offset += n
        return gated_rms_norm_torch(o, z, self.norm.weight, self.norm.eps).flatten(1)

    def mixed_fast(self, proj: torch.Tensor, batch: ForwardBatch) -> torch.Tensor:
        """mixed_torch batched by kind of row (no device sync): the decode rows (one token on a state) through the
        decode op in one call, the other sequences through the varlen prefill kernels, as mixed_split (once per step)
        divides them. A step without decode rows passes the batch's own tensors (no copy); otherwise each kind's rows
        are a slice when they are contiguous (the scheduler puts the decodes first), else gathered."""
        split = mixed_split(batch, proj.device)
        if split is None:
            return self._chunked(proj, batch.cu_seqlens, batch.start_pos, batch.state_slots, batch.checkpoints)
        y = torch.empty(proj.shape[0], self.num_v_heads * self.dv, dtype=proj.dtype, device=proj.device)

        def into(rows, op):  # op(proj rows, out): a slice of y is written in place (no copy launch)
            if isinstance(rows, slice):
                op(proj[rows], y[rows])
            else:
                y[rows] = op(proj[rows], None)
        into(split.decode_rows, lambda p, out: self.decode(p, split.decode_slots, out))
        if split.chunk_rows is not None:
            into(split.chunk_rows, lambda p, out: self._chunked(p, split.cu_seqlens, split.start_pos, split.slots,
                                                                split.checkpoints, out))
        return y

    def _chunked(self, proj: torch.Tensor, cu_seqlens, start_pos, slots, checkpoints=None,
                 out: torch.Tensor | None = None) -> torch.Tensor:
        """A packed run of whole sequences (prompts, prompt chunks; cu_seqlens, start_pos, slots on the device)
        through the varlen kernels: gates, conv with the tails by slot, the chunked delta rule with the states by
        slot (layers/deltanet_prefill.py), the gated norm: five launches. proj [n, ...] -> y [n, Hv*dv].
        checkpoints: [k, 3] (sequence, position, slot) of the prefix cache, or None; out: y's rows, where given."""
        u, z, b, a = split_proj(proj, self.conv_dim, self.num_v_heads, self.dv)
        g, beta = gates_fast(a, b, self.A_log, self.dt_bias)
        c = causal_conv1d_varlen_fast(u, cu_seqlens, start_pos, self.conv_state, slots, self.conv1d.weight,
                                      checkpoints)
        kd = self.num_k_heads * self.dk
        q, k, v = c.split([kd, kd, self.num_v_heads * self.dv], -1)
        o = chunk_delta_rule_varlen_fast(q.unflatten(-1, (self.num_k_heads, self.dk)),
                                         k.unflatten(-1, (self.num_k_heads, self.dk)),
                                         v.unflatten(-1, (self.num_v_heads, self.dv)), g, beta, cu_seqlens,
                                         start_pos, self.ssm_state, slots, self.dk ** -0.5, checkpoints)
        return self.norm(o, z, None if out is None else out.view(o.shape)).flatten(1)

    def _qkv(self, c: torch.Tensor):
        return split_qkv(c, self.num_k_heads, self.num_v_heads, self.dk, self.dv)

    def _settled_state(self, slot: int) -> torch.Tensor:
        """A slot's state after its pending drafts (mixed_torch: a decode row; other rows have none pending)."""
        state = self.ssm_state[slot]
        if self.replay is None:
            return state
        at = torch.tensor([slot], device=state.device)
        return replay_torch(state[None], self.replay[at], self.pending[at], self.A_log, self.dt_bias,
                            self.num_k_heads, self.dk)[0]

    def _zero_state(self, device) -> torch.Tensor:
        return torch.zeros(self.num_v_heads, self.dk, self.dv, dtype=torch.float32, device=device)

    def _conv(self, u: torch.Tensor, slot, fresh: bool, tails_at=()) -> torch.Tensor:
        """Causal depthwise conv of one sequence's new inputs u [n, C] after its cached tail; updates the tail, and
        writes the tail it had after its first `rel` new tokens into slot `dst` for each (rel, dst) of tails_at."""
        tail_len = self.kernel - 1
        prev = torch.zeros(self.conv_dim, tail_len, dtype=u.dtype, device=u.device) if fresh else self.conv_state[slot]
        seq = torch.cat([prev, u.t()], dim=1)                     # [C, tail + n]
        for rel, dst in tails_at:
            self.conv_state[dst] = seq[:, rel:rel + tail_len]
        self.conv_state[slot] = seq[:, -tail_len:]
        y = F.conv1d(seq.unsqueeze(0), self.conv1d.weight, groups=self.conv_dim)[0]  # valid conv: [C, n]
        return F.silu(y).t()


class MixedSplit(NamedTuple):
    """A mixed step's rows as the DeltaNet layers take them: the decode rows (packed rows, slots) and the other
    sequences (packed rows, their offsets, start positions, slots, checkpoints renumbered to them; None if none)."""
    decode_rows: slice | torch.Tensor
    decode_slots: torch.Tensor
    chunk_rows: slice | torch.Tensor | None
    cu_seqlens: torch.Tensor | None     # int32
    start_pos: torch.Tensor | None      # int32
    slots: torch.Tensor | None
    checkpoints: torch.Tensor | None    # [k, 3]


def commit(layers: list[GatedDeltaNet], counts: torch.Tensor) -> None:
    """After a verify step: move every layer's conv tails on by each sequence's first counts[b] tokens ([B] int64,
    on the device); with the fast kernels one launch for all of them (layers[i].commit_row must be i: the model's
    DeltaNet layers in order). The states take the accepted drafts later (pending = counts - 1: the caller's)."""
    steps = []
    for m in layers:
        if m._pending is None:
            raise RuntimeError("commit without a verify step")
        steps.append(m._pending)
        m._pending = None
    if steps:
        layers[0]._commit_op(steps, counts)


def allocate_replay(layers: list[GatedDeltaNet], slots: int, drafts: int, dtype, device) -> torch.Tensor:
    """Speculation's per-slot buffers for `drafts` drafts a verify step: each layer's replay rows and the pending
    counts the layers share (returned); all zero."""
    pending = torch.zeros(slots, dtype=torch.int64, device=device)
    for m in layers:
        m.replay = torch.zeros(slots, drafts, replay_width(m.num_k_heads, m.num_v_heads, m.dk, m.dv), dtype=dtype,
                               device=device)
        m.pending = pending
    return pending


def settle(layers: list[GatedDeltaNet], slots: torch.Tensor) -> None:
    """Move the states of `slots` through their pending drafts in every layer and clear them (before a state is
    copied: a prefix-cache snapshot)."""
    if layers and layers[0].pending is not None and slots.numel():
        for m in layers:
            m.settle(slots)
        layers[0].pending.index_fill_(0, slots, 0)


def replayed(layers: list[GatedDeltaNet], batch: ForwardBatch) -> None:
    """After a step that is not a verify step: every layer has moved the states of its rows' slots through their
    pending drafts (decode rows; other rows have none), so those are cleared."""
    if layers and layers[0].pending is not None and not batch.verify_tokens:
        layers[0].pending.index_fill_(0, batch.state_slots, 0)  # (no host scalar: a CUDA graph captures it)


def mixed_split(batch: ForwardBatch, device: torch.device) -> MixedSplit | None:
    """The batch's split into decode rows and prefill sequences (None: no decode rows), from its host lists, made
    once per step (batch.derived) in one host-to-device copy of pinned integers: 30 layers each building it had
    cost ~5 small copies a layer."""
    if "deltanet" in batch.derived:
        return batch.derived["deltanet"]
    lens, starts, slots = batch.seq_lens_cpu, batch.start_pos_cpu, batch.state_slots_cpu
    on_state = [n == 1 and start > 0 for n, start in zip(lens, starts)]
    decodes = [i for i, d in enumerate(on_state) if d]
    chunked = [i for i, d in enumerate(on_state) if not d]
    split = None
    if decodes:
        offsets = [0, *itertools.accumulate(lens)]
        fields = [[slots[i] for i in decodes]]
        decode_rows = _rows_of(decodes, offsets, fields)
        if chunked:
            fields += [[0, *itertools.accumulate(lens[i] for i in chunked)], [starts[i] for i in chunked],
                       [slots[i] for i in chunked]]
            index = {row: i for i, row in enumerate(chunked)}  # checkpoints renumbered to the prefill sequences
            fields.append([v for row, pos, dst in batch.checkpoints_cpu for v in (index[row], pos, dst)])
            chunk_rows = _rows_of(chunked, offsets, fields)
        sizes = [len(f) for f in fields]
        host = torch.tensor([v for f in fields for v in f], dtype=torch.int64, pin_memory=device.type == "cuda")
        parts = iter(host.to(device, non_blocking=True).split(sizes))
        decode_slots = next(parts)
        if isinstance(decode_rows, int):
            decode_rows = next(parts)
        if not chunked:
            split = MixedSplit(decode_rows, decode_slots, None, None, None, None, None)
        else:
            cu, start, chunk_slots, checkpoints = next(parts), next(parts), next(parts), next(parts)
            if isinstance(chunk_rows, int):
                chunk_rows = next(parts)
            split = MixedSplit(decode_rows, decode_slots, chunk_rows, cu.to(torch.int32), start.to(torch.int32),
                               chunk_slots, checkpoints.view(-1, 3) if batch.checkpoints_cpu else None)
    batch.derived["deltanet"] = split
    return split


def _rows_of(seqs: list[int], offsets: list[int], fields: list[list[int]]) -> slice | int:
    """The packed rows of sequences `seqs` (ascending): a slice when they are adjacent, else their row numbers are
    appended to `fields` (to be copied with them) and the field's position returned."""
    lo, hi = offsets[seqs[0]], offsets[seqs[-1] + 1]
    if hi - lo == sum(offsets[i + 1] - offsets[i] for i in seqs):
        return slice(lo, hi)
    fields.append([t for i in seqs for t in range(offsets[i], offsets[i + 1])])
    return len(fields) - 1


# ------------------------------------------------------------------------------------------------ Triton kernels
if triton is not None:
    @triton.jit
    def _log1p(x):
        """log(1 + x) without losing small x: log(w) * x / (w - 1) with w = 1 + x rounded (Goldberg)."""
        w = 1.0 + x
        d = w - 1.0
        return tl.where(d == 0.0, x, tl.log(w) * (x / tl.where(d == 0.0, 1.0, d)))

    @triton.jit
    def _softplus(x):
        """softplus as torch's (threshold 20), fp32."""
        return tl.where(x > 20.0, x, _log1p(tl.exp(tl.minimum(x, 20.0))))

    @triton.jit
    def _beta(b_raw):
        """beta = sigmoid(b) rounded to b's dtype, fp32 (spec §3.2)."""
        return round_to(tl.sigmoid(b_raw.to(tl.float32)), b_raw.dtype)

    @triton.jit
    def _gates_kernel(a_ptr, b_ptr, A_log_ptr, dt_bias_ptr, g_ptr, beta_ptr, T, H, sa, sb,
                      BLOCK_T: tl.constexpr, BLOCK_H: tl.constexpr):
        """BLOCK_T tokens: g = -exp(A_log) * softplus(a + dt_bias) in fp32, beta = sigmoid(b) rounded to b's dtype
        (the decode kernel computes the same inline)."""
        prior_done()  # (backend.pdl: the kernels before this one have finished)
        t = (tl.program_id(0) * BLOCK_T + tl.arange(0, BLOCK_T)).to(tl.int64)
        h = tl.arange(0, BLOCK_H)
        hm = h < H
        mask = (t < T)[:, None] & hm[None, :]
        x = tl.load(a_ptr + t[:, None] * sa + h[None, :], mask=mask, other=0.0).to(tl.float32) + \
            tl.load(dt_bias_ptr + h, mask=hm, other=0.0).to(tl.float32)[None, :]
        g = -tl.exp(tl.load(A_log_ptr + h, mask=hm, other=0.0).to(tl.float32))[None, :] * _softplus(x)
        beta = _beta(tl.load(b_ptr + t[:, None] * sb + h[None, :], mask=mask, other=0.0))
        tl.store(g_ptr + t[:, None] * H + h[None, :], g, mask=mask)
        tl.store(beta_ptr + t[:, None] * H + h[None, :], beta, mask=mask)

    @triton.jit
    def _conv_silu(prow, tail, w_ptr, ch, mask, ss_c, ss_t, sw_c, sw_t, KERNEL: tl.constexpr, DTYPE: tl.constexpr):
        """The conv's new column at channels `ch` as decode_torch computes it: taps 0..K-2 on the cached tail (oldest
        first), tap K-1 on the new input, accumulated in fp32 in that order and rounded to DTYPE (conv1d's output),
        then SiLU rounded again. fp32 result."""
        acc = tl.zeros(ch.shape, dtype=tl.float32)
        for j in tl.static_range(KERNEL - 1):
            acc += tl.load(tail + ch * ss_c + j * ss_t, mask=mask, other=0.0).to(tl.float32) * \
                tl.load(w_ptr + ch * sw_c + j * sw_t, mask=mask, other=0.0).to(tl.float32)
        acc += tl.load(prow + ch, mask=mask, other=0.0).to(tl.float32) * \
            tl.load(w_ptr + ch * sw_c + (KERNEL - 1) * sw_t, mask=mask, other=0.0).to(tl.float32)
        y = round_to(acc, DTYPE)
        return round_to(y * tl.sigmoid(y), DTYPE)

    @triton.jit
    def _shift_tail(prow, tail, ch, mask, ss_c, ss_t, KERNEL: tl.constexpr):
        """The cached tail of channels `ch` moves left by one in place and takes the new input (raw, model dtype)."""
        for j in tl.static_range(KERNEL - 2):
            tl.store(tail + ch * ss_c + j * ss_t, tl.load(tail + ch * ss_c + (j + 1) * ss_t, mask=mask), mask=mask)
        tl.store(tail + ch * ss_c + (KERNEL - 2) * ss_t, tl.load(prow + ch, mask=mask), mask=mask)

    @triton.jit
    def _slab(head_ptr, kk, vv, DV: tl.constexpr):
        """Pointers of a [BK, BV] slab of one head's state, contiguous [dk, dv] (state_args checks): the row stride
        a constant, so the addresses are one base and immediates. With the strides as arguments and a mask, every
        element's address and predicate stayed live from the slab's load to its store (255 registers and spills at
        64 columns x 2 warps, 1x H200)."""
        return head_ptr + kk[:, None] * DV + vv[None, :]

    @triton.jit
    def _load_slab(ptrs, kk, vv, DK: tl.constexpr, DV: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr):
        if (BK == DK) and (DV % BV == 0):  # every element is the state's (the model's head dims): no mask
            return tl.load(ptrs)
        else:
            return tl.load(ptrs, mask=(kk < DK)[:, None] & (vv < DV)[None, :], other=0.0)

    @triton.jit
    def _store_slab(ptrs, S, kk, vv, DK: tl.constexpr, DV: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr):
        if (BK == DK) and (DV % BV == 0):
            tl.store(ptrs, S)
        else:
            tl.store(ptrs, S, mask=(kk < DK)[:, None] & (vv < DV)[None, :])

    @triton.jit
    def _rule(S, k, v, decay, beta):
        """The gated delta rule on a slab: S = exp(g) S; S += k (beta (v - S^T k))^T (k l2-normed, fp32)."""
        S = S * decay
        delta = (v - tl.sum(S * k[:, None], 0)) * beta
        return S + k[:, None] * delta[None, :]

    @triton.jit
    def _replay(S, rows, sr_t, n, h, hk, kk, vv, km, vm, decay_scale, bias, l2_eps, rv_off, rb_off, ra_off,
                DK: tl.constexpr, DV: tl.constexpr):
        """The slab after the first n of its slot's replay rows (replay_torch: each a token's k and v conv channels,
        b and a, as its own step computed them; the same update, bit for bit)."""
        for t in range(n):
            row = rows + t * sr_t
            k = tl.load(row + hk * DK + kk, mask=km, other=0.0).to(tl.float32)
            v = tl.load(row + rv_off + h * DV + vv, mask=vm, other=0.0).to(tl.float32)
            k = k * tl.rsqrt(tl.sum(k * k, 0) + l2_eps)
            decay = tl.exp(decay_scale * _softplus(tl.load(row + ra_off + h).to(tl.float32) + bias))
            S = _rule(S, k, v, decay, _beta(tl.load(row + rb_off + h)))
        return S

    @triton.jit
    def _decode_kernel(proj_ptr, conv_ptr, conv_w_ptr, state_ptr, slots_ptr, A_log_ptr, dt_bias_ptr, norm_w_ptr, y_ptr,
                       count_ptr, replay_ptr, pending_ptr, sr_slot, sr_t, rv_off, rb_off, ra_off,
                       sp_b, sc_slot, sc_c, sc_t, sw_c, sw_t, ss_slot, ss_h, sy_b,
                       k_off, v_off, z_off, b_off, a_off, scale, l2_eps, eps,
                       KERNEL: tl.constexpr, REP: tl.constexpr, REP_P2: tl.constexpr, N_SPLIT: tl.constexpr,
                       DK: tl.constexpr, DV: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr,
                       BV_HEAD: tl.constexpr, REPLAY: tl.constexpr, EARLY: tl.constexpr):
        """Value columns [j*BV, (j+1)*BV) of value head h of sequence b, program (h * N_SPLIT + j, b):
            q, k, v = silu(conv step) of the proj row's u (q, k of qk-head h // REP, v of these columns);
            q, k = l2norm(q) * scale, l2norm(k);  g = -exp(A_log) softplus(a + dt_bias);  beta = sigmoid(b) (model
            dtype);  S = exp(g) S;  S += k (beta (v - S^T k))^T;  o = S^T q (rounded), stored in y;
        then, by the last program of the (b, qk-head) group to arrive: the q/k tail shift and, for each of its REP
        heads, y = (o / rms(o), rounded) * w * silu(z) (gated RMSNorm, spec §2.1)."""
        prior_done()  # (backend.pdl: the kernels before this one have finished)
        if EARLY:  # (backend.early_launch: the GEMV after this kernel loads its weights while it runs)
            next_may_start()
        pid, b = tl.program_id(0), tl.program_id(1).to(tl.int64)
        h, j = pid // N_SPLIT, pid % N_SPLIT
        hk = h // REP
        dtype = y_ptr.dtype.element_ty
        kk, vv = tl.arange(0, BK), j * BV + tl.arange(0, BV)
        km, vm = kk < DK, vv < DV
        slot = tl.load(slots_ptr + b).to(tl.int64)
        prow = proj_ptr + b * sp_b
        tail = conv_ptr + slot * sc_slot
        # the state slab first: its bytes (from HBM) are in flight while the conv step and the gates are computed
        ptrs = _slab(state_ptr + slot * ss_slot + h * ss_h, kk, vv, DV)
        S = _load_slab(ptrs, kk, vv, DK, DV, BK, BV)
        q = _conv_silu(prow, tail, conv_w_ptr, hk * DK + kk, km, sc_c, sc_t, sw_c, sw_t, KERNEL, dtype)
        k = _conv_silu(prow, tail, conv_w_ptr, k_off + hk * DK + kk, km, sc_c, sc_t, sw_c, sw_t, KERNEL, dtype)
        v = _conv_silu(prow, tail, conv_w_ptr, v_off + h * DV + vv, vm, sc_c, sc_t, sw_c, sw_t, KERNEL, dtype)
        q = q * tl.rsqrt(tl.sum(q * q, 0) + l2_eps) * scale
        k = k * tl.rsqrt(tl.sum(k * k, 0) + l2_eps)
        decay_scale = -tl.exp(tl.load(A_log_ptr + h).to(tl.float32))
        bias = tl.load(dt_bias_ptr + h).to(tl.float32)
        decay = tl.exp(decay_scale * _softplus(tl.load(prow + a_off + h).to(tl.float32) + bias))
        beta = _beta(tl.load(prow + b_off + h))
        if REPLAY:  # (after this token's inputs: their loads are in flight with the slab's)
            S = _replay(S, replay_ptr + slot * sr_slot, sr_t, tl.load(pending_ptr + slot), h, hk, kk, vv, km, vm,
                        decay_scale, bias, l2_eps, rv_off, rb_off, ra_off, DK, DV)
        S = _rule(S, k, v, decay, beta)
        _store_slab(ptrs, S, kk, vv, DK, DV, BK, BV)
        o = round_to(tl.sum(S * q[:, None], 0), dtype)
        tl.store(y_ptr + b * sy_b + h * DV + vv, o.to(dtype), mask=vm)
        _shift_tail(prow, tail, v_off + h * DV + vv, vm, sc_c, sc_t, KERNEL)  # these v channels are this program's

        # arrive: the barrier orders every thread's loads and stores above before the (one-thread) release
        tl.debug_barrier()
        count = count_ptr + b * (tl.num_programs(0) // (REP * N_SPLIT)) + hk
        if tl.atomic_add(count, 1, sem="acq_rel") == REP * N_SPLIT - 1:
            # every program of the group has read the q/k tail and stored its o columns
            _shift_tail(prow, tail, hk * DK + kk, km, sc_c, sc_t, KERNEL)
            _shift_tail(prow, tail, k_off + hk * DK + kk, km, sc_c, sc_t, KERNEL)
            _gated_norm_group(y_ptr + b * sy_b, prow + z_off, norm_w_ptr, hk, eps, REP, REP_P2, DV, BV_HEAD)
            tl.store(count, 0)

    @triton.jit
    def _gated_norm_group(y_row, z_row, norm_w_ptr, hk, eps, REP: tl.constexpr, REP_P2: tl.constexpr,
                          DV: tl.constexpr, BV_HEAD: tl.constexpr):
        """One token's REP value heads of qk-head hk, in place in its row of y: y = (o / rms(o), rounded) * w *
        silu(z) (gated RMSNorm, spec §2.1; gated_rms_norm_fast's bits). o comes through L2: other programs (other
        SMs) stored parts of it."""
        rr, dd = tl.arange(0, REP_P2), tl.arange(0, BV_HEAD)
        heads = hk * REP + rr
        hmask = (rr < REP)[:, None] & (dd < DV)[None, :]
        out = y_row + heads[:, None] * DV + dd[None, :]
        dtype = y_row.dtype.element_ty
        o = tl.load(out, mask=hmask, other=0.0, cache_modifier=".cg").to(tl.float32)
        o = round_to(o * tl.rsqrt(tl.sum(o * o, 1) / DV + eps)[:, None], dtype)
        z = tl.load(z_row + heads[:, None] * DV + dd[None, :], mask=hmask, other=0.0).to(tl.float32)
        w = tl.load(norm_w_ptr + dd, mask=dd < DV, other=0.0).to(tl.float32)
        tl.store(out, ((w[None, :] * o) * (z * tl.sigmoid(z))).to(dtype), mask=hmask)
