"""Gated DeltaNet (spec §3): projections, causal depthwise conv with a cached tail, and the gated delta rule with
an fp32 recurrent state per sequence, addressed by state slot.

TP split: each rank takes a contiguous block of key heads and the value heads that use them (v-head j reads
qk-head j // (Hv/Hk), so a block of Hv/tp value heads maps onto a block of Hk/tp key heads). The q, k and v row
blocks of in_proj_qkv (and the conv channels, which follow them one to one) are each split that way; z, b, a,
A_log and dt_bias follow the value heads; out_proj is split by input columns and all-reduced by the caller.

Two algorithms, as in the reference: a chunked (UT transform) form for any call that feeds several tokens, and the
token-by-token recurrence for single-token decode on an existing state. Both compute the same function.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

try:  # Triton comes with CUDA builds of torch; the CPU path never needs it
    import triton
    import triton.language as tl
except ImportError:
    triton = None

from dist import parallel
from layers.forward_batch import ForwardBatch
from layers.linear import Linear, even_split, make_param
from layers.norm import GatedRMSNorm


def l2norm(x: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    return x * torch.rsqrt((x * x).sum(dim=-1, keepdim=True) + eps)


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


def chunk_gated_delta_rule(q, k, v, g, beta, state, chunk: int = 64):
    """Same contract as recurrent_gated_delta_rule, computed chunk by chunk.

    Within a chunk, the delta-rule updates form a unit lower-triangular system (I + tril(diag(beta) K K^T * decay))
    whose solution gives the chunk's effective values; between chunks only the [dk, dv] state is carried.
    """
    n, H, dk = k.shape
    pad = (-n) % chunk
    # [H, n, d], padded with inert steps (k = v = beta = 0, g = 0 leaves the state unchanged)
    q, k, v = (F.pad(x.transpose(0, 1), (0, 0, 0, pad)) for x in (q, k, v))
    g, beta = (F.pad(x.transpose(0, 1), (0, pad)) for x in (g, beta))
    nc = (n + pad) // chunk
    q, k, v = (x.reshape(H, nc, chunk, -1) for x in (q, k, v))
    g, beta = g.reshape(H, nc, chunk), beta.reshape(H, nc, chunk)

    gcum = g.cumsum(-1)                                          # log decay from chunk start to each step
    causal = torch.ones(chunk, chunk, dtype=torch.bool, device=q.device).tril()
    decay = (gcum[..., :, None] - gcum[..., None, :]).masked_fill(~causal, float("-inf")).exp()  # [H,nc,C,C]
    k_beta = k * beta[..., None]
    system = (k_beta @ k.transpose(-1, -2)) * decay
    u = torch.linalg.solve_triangular(system, v * beta[..., None], upper=False, unitriangular=True)
    w = torch.linalg.solve_triangular(system, k_beta * gcum.exp()[..., None], upper=False, unitriangular=True)
    intra = (q @ k.transpose(-1, -2)) * decay                    # within-chunk attention, decay applied
    q_decayed = q * gcum.exp()[..., None]
    k_to_end = k * (gcum[..., -1:] - gcum).exp()[..., None]
    chunk_decay = gcum[..., -1].exp()                            # [H, nc]

    out = torch.empty_like(v)
    for c in range(nc):
        v_new = u[:, c] - w[:, c] @ state                         # the part of the values the state does not predict
        out[:, c] = q_decayed[:, c] @ state + intra[:, c] @ v_new
        state = state * chunk_decay[:, c, None, None] + k_to_end[:, c].transpose(-1, -2) @ v_new
    out = out.reshape(H, nc * chunk, -1)[:, :n].transpose(0, 1)
    return out, state


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
        self.conv1d = nn.Module()
        self.conv1d.weight = make_param((2 * kd + vd, 1, self.kernel), [qkv_rows, None, None], dtype, device)
        # A_log is released in fp32 and kept so (as vLLM/SGLang do); the decay is computed in fp32
        self.A_log = make_param((Hv,), [v_heads], torch.float32, device)
        self.dt_bias = make_param((Hv,), [v_heads], dtype, device)
        self.norm = GatedRMSNorm(dv, cfg.rms_norm_eps, device=device)
        self.out_proj = Linear(vd, hidden, cols=[(v_start * dv, self.num_v_heads * dv)], dtype=dtype, device=device)
        # per-slot caches, allocated by the runner:
        # conv_state [slots, conv_dim, kernel-1] (raw pre-conv inputs), ssm_state [slots, Hv_local, dk, dv] fp32
        self.conv_state: torch.Tensor | None = None
        self.ssm_state: torch.Tensor | None = None

    def forward(self, x: torch.Tensor, batch: ForwardBatch) -> torch.Tensor:
        T = x.shape[0]
        u = self.in_proj_qkv(x)                                   # [T, conv_dim]
        z = self.in_proj_z(x).view(T, self.num_v_heads, self.dv)
        beta = self.in_proj_b(x).sigmoid().float()
        g = -self.A_log.float().exp() * F.softplus(self.in_proj_a(x).float() + self.dt_bias.float())
        if batch.is_decode:
            decode = self._decode_triton if (triton is not None and x.is_cuda) else self._decode
            out = decode(u, g, beta, batch.state_slots)
        else:
            out = self._mixed_batched(u, g, beta, batch)
        y = self.norm(out, z).reshape(T, -1)
        return self.out_proj(y)

    def _split_qkv(self, c: torch.Tensor):
        """Conv output [n, C] -> q (l2-normed, scaled), k (l2-normed), v in fp32, per value head: [n, Hv, d]."""
        n = c.shape[0]
        q, k, v = c.split([self.num_k_heads * self.dk, self.num_k_heads * self.dk, self.num_v_heads * self.dv], -1)
        rep = self.num_v_heads // self.num_k_heads
        q = (l2norm(q.float().view(n, -1, self.dk)) * self.dk ** -0.5).repeat_interleave(rep, dim=1)
        k = l2norm(k.float().view(n, -1, self.dk)).repeat_interleave(rep, dim=1)
        return q, k, v.float().view(n, -1, self.dv)

    def _decode(self, u: torch.Tensor, g: torch.Tensor, beta: torch.Tensor, slots: torch.Tensor) -> torch.Tensor:
        """One token for each of B sequences on existing states, all at once: no host sync, no per-sequence loop
        (CUDA-graph safe). Gathers each sequence's conv tail and recurrent state by slot, steps, scatters back."""
        window = torch.cat([self.conv_state[slots], u.unsqueeze(-1)], dim=-1)       # [B, C, kernel]
        self.conv_state[slots] = window[..., 1:]
        # the conv's last output column, accumulated in fp32 and rounded like a conv1d in the model dtype
        c = F.silu((window.float() * self.conv1d.weight[:, 0, :].float()).sum(-1).to(u.dtype))
        q, k, v = self._split_qkv(c)
        state = self.ssm_state[slots] * g.exp()[:, :, None, None]                   # [B, H, dk, dv]
        delta = (v - torch.einsum("bhkv,bhk->bhv", state, k)) * beta[..., None]
        state = state + k[..., None] * delta[:, :, None, :]
        self.ssm_state[slots] = state
        return torch.einsum("bhkv,bhk->bhv", state, q).to(u.dtype)

    def _decode_triton(self, u: torch.Tensor, g: torch.Tensor, beta: torch.Tensor, slots: torch.Tensor) -> torch.Tensor:
        """_decode in two kernels that update the conv tail and the recurrent state in place: the state is read and
        written once (the torch version moves it about ten times), and ~40 small launches become 2."""
        B, C = u.shape
        c = torch.empty_like(u)
        w = self.conv1d.weight
        _conv_step_kernel[(B, triton.cdiv(C, 512))](
            u, self.conv_state, w, slots, c, C, u.stride(0), self.conv_state.stride(0), self.conv_state.stride(1),
            w.stride(0), c.stride(0), KERNEL=self.kernel, BLOCK_C=512)
        out = torch.empty(B, self.num_v_heads, self.dv, dtype=u.dtype, device=u.device)
        st = self.ssm_state
        block_v = min(32, self.dv)
        _delta_step_kernel[(B, self.num_v_heads, self.dv // block_v)](
            c, g, beta, st, slots, out, c.stride(0), g.stride(0), st.stride(0), st.stride(1), st.stride(2),
            out.stride(0), out.stride(1), self.num_k_heads * self.dk, 2 * self.num_k_heads * self.dk,
            self.dk ** -0.5, REP=self.num_v_heads // self.num_k_heads, DK=self.dk, DV=self.dv, BV=block_v)
        return out

    def _mixed(self, u: torch.Tensor, g: torch.Tensor, beta: torch.Tensor, batch: ForwardBatch) -> torch.Tensor:
        """Reference: sequence by sequence, chunked for several tokens, recurrent for one token on a state."""
        out = torch.empty(u.shape[0], self.num_v_heads, self.dv, dtype=u.dtype, device=u.device)
        offset = 0
        for i, (n, start) in enumerate(zip(batch.seq_lens_cpu, batch.start_pos_cpu)):
            sl = slice(offset, offset + n)
            slot = batch.state_slots_cpu[i]
            q, k, v = self._split_qkv(self._conv(u[sl], slot, fresh=start == 0))
            if start == 0:
                state = torch.zeros(self.num_v_heads, self.dk, self.dv, dtype=torch.float32, device=u.device)
            else:
                state = self.ssm_state[slot]
            rule = recurrent_gated_delta_rule if (n == 1 and start > 0) else chunk_gated_delta_rule
            o, state = rule(q, k, v, g[sl], beta[sl], state)
            self.ssm_state[slot] = state
            out[sl] = o.to(u.dtype)
            offset += n
        return out

    def _mixed_batched(self, u: torch.Tensor, g: torch.Tensor, beta: torch.Tensor, batch: ForwardBatch) -> torch.Tensor:
        """_mixed with one chunked delta rule for all multi-token sequences: they are padded to the longest and
        stacked along the head axis (heads are independent), so the chunk loop runs once, not once per sequence.
        Padding steps have k = v = beta = 0 and g = 0, which leave the state unchanged."""
        H = self.num_v_heads
        out = torch.empty(u.shape[0], H, self.dv, dtype=u.dtype, device=u.device)
        chunked, offset = [], 0
        for i, (n, start) in enumerate(zip(batch.seq_lens_cpu, batch.start_pos_cpu)):
            sl, slot = slice(offset, offset + n), batch.state_slots_cpu[i]
            q, k, v = self._split_qkv(self._conv(u[sl], slot, fresh=start == 0))
            offset += n
            if n == 1 and start > 0:  # a decode inside a mixed step: the recurrent form, as the reference
                o, self.ssm_state[slot] = recurrent_gated_delta_rule(q, k, v, g[sl], beta[sl], self.ssm_state[slot])
                out[sl] = o.to(u.dtype)
            else:
                chunked.append((sl, slot, start, q, k, v))
        if not chunked:
            return out
        L = max(c[3].shape[0] for c in chunked)

        def stack(xs):  # [n_i, H, ...] each -> [L, len * H, ...], zero-padded at the end
            return torch.cat([F.pad(x, (0, 0) * (x.dim() - 1) + (0, L - x.shape[0])) for x in xs], dim=1)

        zeros = torch.zeros(H, self.dk, self.dv, dtype=torch.float32, device=u.device)
        init = torch.cat([zeros if start == 0 else self.ssm_state[slot] for _, slot, start, *_ in chunked])
        o, state = chunk_gated_delta_rule(
            stack([c[3] for c in chunked]), stack([c[4] for c in chunked]), stack([c[5] for c in chunked]),
            stack([g[c[0]] for c in chunked]), stack([beta[c[0]] for c in chunked]), init)
        slots = torch.tensor([c[1] for c in chunked], device=u.device)
        self.ssm_state[slots] = state.view(len(chunked), H, self.dk, self.dv)
        for j, (sl, *_rest) in enumerate(chunked):
            out[sl] = o[: sl.stop - sl.start, j * H:(j + 1) * H].to(u.dtype)
        return out

    def _conv(self, u: torch.Tensor, slot, fresh: bool) -> torch.Tensor:
        """Causal depthwise conv of one sequence's new inputs u [n, C] after its cached tail; updates the tail."""
        tail_len = self.kernel - 1
        prev = torch.zeros(self.conv_dim, tail_len, dtype=u.dtype, device=u.device) if fresh else self.conv_state[slot]
        seq = torch.cat([prev, u.t()], dim=1)                     # [C, tail + n]
        self.conv_state[slot] = seq[:, -tail_len:]
        y = F.conv1d(seq.unsqueeze(0), self.conv1d.weight, groups=self.conv_dim)[0]  # valid conv: [C, n]
        return F.silu(y).t()


if triton is not None:
    @triton.jit
    def _conv_step_kernel(u_ptr, state_ptr, w_ptr, slots_ptr, out_ptr, C, su_b, ss_slot, ss_c, sw_c, so_b,
                          KERNEL: tl.constexpr, BLOCK_C: tl.constexpr):
        """Causal depthwise conv of one new column per sequence: taps 0..K-2 read the cached tail (oldest first),
        tap K-1 the new input; the tail shifts left by one in place. Output silu(conv), rounded as the model's."""
        b, cb = tl.program_id(0), tl.program_id(1)
        c = cb * BLOCK_C + tl.arange(0, BLOCK_C)
        mask = c < C
        slot = tl.load(slots_ptr + b).to(tl.int64)
        base = state_ptr + slot * ss_slot + c * ss_c
        x_new = tl.load(u_ptr + b * su_b + c, mask=mask, other=0.0)
        acc = x_new.to(tl.float32) * tl.load(w_ptr + c * sw_c + (KERNEL - 1), mask=mask, other=0.0).to(tl.float32)
        for j in tl.static_range(KERNEL - 1):
            acc += tl.load(base + j, mask=mask, other=0.0).to(tl.float32) * \
                tl.load(w_ptr + c * sw_c + j, mask=mask, other=0.0).to(tl.float32)
        for j in tl.static_range(KERNEL - 2):
            tl.store(base + j, tl.load(base + j + 1, mask=mask), mask=mask)
        tl.store(base + (KERNEL - 2), x_new, mask=mask)
        y = acc.to(out_ptr.dtype.element_ty).to(tl.float32)
        tl.store(out_ptr + b * so_b + c, (y * tl.sigmoid(y)).to(out_ptr.dtype.element_ty), mask=mask)

    @triton.jit
    def _delta_step_kernel(c_ptr, g_ptr, beta_ptr, state_ptr, slots_ptr, out_ptr, sc_b, sg_b, ss_slot, ss_h, ss_k,
                           so_b, so_h, key_off, val_off, scale,
                           REP: tl.constexpr, DK: tl.constexpr, DV: tl.constexpr, BV: tl.constexpr):
        """One gated delta-rule step for (sequence, value head, block of BV value columns), state in place (fp32):
        S = exp(g) S;  S += k (beta (v - S^T k))^T;  o = S^T q, with q, k l2-normalised (q also scaled)."""
        b, h, vb = tl.program_id(0), tl.program_id(1), tl.program_id(2)
        hk = h // REP
        kk = tl.arange(0, DK)
        vv = vb * BV + tl.arange(0, BV)
        slot = tl.load(slots_ptr + b).to(tl.int64)
        row = c_ptr + b * sc_b
        q = tl.load(row + hk * DK + kk).to(tl.float32)
        k = tl.load(row + key_off + hk * DK + kk).to(tl.float32)
        v = tl.load(row + val_off + h * DV + vv).to(tl.float32)
        q = q * tl.rsqrt(tl.sum(q * q, 0) + 1e-6) * scale
        k = k * tl.rsqrt(tl.sum(k * k, 0) + 1e-6)
        decay = tl.exp(tl.load(g_ptr + b * sg_b + h))
        beta = tl.load(beta_ptr + b * sg_b + h)
        ptrs = state_ptr + slot * ss_slot + h * ss_h + kk[:, None] * ss_k + vv[None, :]
        S = tl.load(ptrs) * decay
        delta = (v - tl.sum(S * k[:, None], 0)) * beta
        S = S + k[:, None] * delta[None, :]
        tl.store(ptrs, S)
        o = tl.sum(S * q[:, None], 0)
        tl.store(out_ptr + b * so_b + h * so_h + vv, o.to(out_ptr.dtype.element_ty))
