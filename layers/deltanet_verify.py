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
import torch.nn.functional as F

from layers.backend import round_to, tl, triton
from layers.deltanet import _dims, _log1p, gates_torch, split_proj, split_qkv
from layers.norm import gated_rms_norm_torch


def _windows(proj, conv_state, slots, conv_dim, Hv, dv, T):
    """(u, z, b, a) as [B, T, ...] and the conv's input sequence [B, C, K-1 + T] (cached tail, then the T inputs)."""
    B = proj.shape[0] // T
    u, z, b, a = split_proj(proj.view(B, T, -1), conv_dim, Hv, dv)
    seq = torch.cat([conv_state[slots], u.transpose(1, 2)], dim=-1)
    return u, z, b, a, seq


def _token(seq, t, K, conv_weight, dtype, dims):
    """q, k, v of token t of every row (decode_torch's conv column and l2-norms): window seq[..., t:t+K]."""
    Hk, Hv, dk, dv = dims
    window = seq[..., t:t + K]
    c = F.silu((window.float() * conv_weight[:, 0, :].float()).sum(-1).to(dtype))
    return split_qkv(c, Hk, Hv, dk, dv)


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
        q, k, v = _token(seq, t, K, conv_weight, u.dtype, (Hk, Hv, dk, dv))
        state = state * g.exp()[:, :, None, None]
        delta = (v - torch.einsum("bhkv,bhk->bhv", state, k)) * beta[..., None]
        state = state + k[..., None] * delta[:, :, None, :]
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
        _, k, v = _token(seq, t, K, conv_weight, u.dtype, (Hk, Hv, dk, dv))
        new = state * g.exp()[:, :, None, None]
        delta = (v - torch.einsum("bhkv,bhk->bhv", new, k)) * beta[..., None]
        new = new + k[..., None] * delta[:, :, None, :]
        state = torch.where((t < counts)[:, None, None, None], new, state)
    ssm_state[slots] = state
    # the tail after n tokens: inputs n .. n + K - 2 of the sequence [tail, T inputs]
    at = counts[:, None] + torch.arange(K - 1, device=seq.device)[None, :]
    conv_state[slots] = seq.gather(2, at[:, None, :].expand(-1, seq.shape[1], -1))


verify_fast = verify_torch
commit_fast = commit_torch
