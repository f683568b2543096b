"""Gated full attention (spec §4) with a paged KV cache.

TP split: each rank takes a contiguous block of query heads (each head's q_proj rows are [q | gate], so a head
block is a contiguous row block) and the matching o_proj columns. KV heads: split when there are at least as many
as ranks, else each rank keeps (a replica of) the one KV head its query heads use.
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
from layers.linear import Linear, even_split
from layers.norm import RMSNorm
from layers.rotary import RotaryEmbedding


class GatedAttention(nn.Module):
    def __init__(self, cfg, rotary: RotaryEmbedding, dtype=None, device=None):
        super().__init__()
        rank, tp = parallel.tp_rank(), parallel.tp_size()
        H, KV, D, hidden = cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim, cfg.hidden_size
        h_start, self.num_heads = even_split(H, rank, tp)
        if KV >= tp:
            kv_start, self.num_kv_heads = even_split(KV, rank, tp)
        else:  # replicate: all of this rank's query heads share one KV head
            kv_start, self.num_kv_heads = h_start // (H // KV), 1
        self.head_dim = D
        self.scale = D ** -0.5
        self.rotary = rotary
        self.q_proj = Linear(hidden, H * 2 * D, rows=[(h_start * 2 * D, self.num_heads * 2 * D)], dtype=dtype, device=device)
        self.k_proj = Linear(hidden, KV * D, rows=[(kv_start * D, self.num_kv_heads * D)], dtype=dtype, device=device)
        self.v_proj = Linear(hidden, KV * D, rows=[(kv_start * D, self.num_kv_heads * D)], dtype=dtype, device=device)
        self.o_proj = Linear(H * D, hidden, cols=[(h_start * D, self.num_heads * D)], dtype=dtype, device=device)
        self.q_norm = RMSNorm(D, cfg.rms_norm_eps, dtype=dtype, device=device)
        self.k_norm = RMSNorm(D, cfg.rms_norm_eps, dtype=dtype, device=device)
        # [num_blocks, block_size, num_kv_heads, head_dim], allocated by the runner
        self.k_cache: torch.Tensor | None = None
        self.v_cache: torch.Tensor | None = None

    def forward(self, x: torch.Tensor, batch: ForwardBatch) -> torch.Tensor:
        T, D = x.shape[0], self.head_dim
        q, gate = self.q_proj(x).view(T, self.num_heads, 2 * D).split(D, dim=-1)
        gate = gate.reshape(T, self.num_heads * D)
        q = self.q_norm(q)
        k = self.k_norm(self.k_proj(x).view(T, self.num_kv_heads, D))
        v = self.v_proj(x).view(T, self.num_kv_heads, D)
        q, k = self.rotary(batch.positions, q, k)
        # cache post-norm, post-RoPE K and V
        self.k_cache.view(-1, self.num_kv_heads, D)[batch.slot_mapping] = k
        self.v_cache.view(-1, self.num_kv_heads, D)[batch.slot_mapping] = v
        if batch.is_decode:
            decode = paged_decode_attention_triton if use_triton(q) else paged_decode_attention
            o = decode(q, self.k_cache, self.v_cache, batch.block_tables, batch.context_lens, self.scale)
        else:
            o = paged_attention_ref(q, self.k_cache, self.v_cache, batch, self.scale)
        return self.o_proj(o.reshape(T, -1) * torch.sigmoid(gate))


def paged_attention_ref(q, k_cache, v_cache, batch: ForwardBatch, scale: float) -> torch.Tensor:
    """Causal attention of each sequence's new queries over its cached keys, one sequence at a time."""
    block_size, n_kv, D = k_cache.shape[1], k_cache.shape[2], k_cache.shape[3]
    n_heads = q.shape[1]
    out = torch.empty_like(q)
    offset = 0
    for i, (n, start) in enumerate(zip(batch.seq_lens_cpu, batch.start_pos_cpu)):
        ctx = start + n
        blocks = batch.block_tables[i, : (ctx + block_size - 1) // block_size]
        k = k_cache[blocks].reshape(-1, n_kv, D)[:ctx].transpose(0, 1)  # [kv, ctx, D]
        v = v_cache[blocks].reshape(-1, n_kv, D)[:ctx].transpose(0, 1)
        k = k.repeat_interleave(n_heads // n_kv, dim=0)
        v = v.repeat_interleave(n_heads // n_kv, dim=0)
        qi = q[offset: offset + n].transpose(0, 1)  # [h, n, D]
        if start == 0:  # a whole prompt: plain causal, which lets SDPA pick its flash kernel
            o = F.scaled_dot_product_attention(qi.unsqueeze(0), k.unsqueeze(0), v.unsqueeze(0),
                                               is_causal=True, scale=scale)[0]
        else:  # query t (absolute position start + t) sees keys 0..start + t
            mask = torch.arange(ctx, device=q.device)[None, :] <= (start + torch.arange(n, device=q.device))[:, None]
            o = F.scaled_dot_product_attention(qi.unsqueeze(0), k.unsqueeze(0), v.unsqueeze(0),
                                               attn_mask=mask, scale=scale)[0]
        out[offset: offset + n] = o.transpose(0, 1)
        offset += n
    return out


def paged_decode_attention(q, k_cache, v_cache, block_tables, context_lens, scale: float) -> torch.Tensor:
    """One query per sequence over its paged keys, all sequences at once (no host sync; fixed shapes for a given
    block-table width). q: [B, H, D]; block_tables: [B, max_blocks]; context_lens: [B] (keys 0..len-1 visible)."""
    B, H, D = q.shape
    n_kv = k_cache.shape[2]
    k = k_cache[block_tables].flatten(1, 2)                       # [B, L, kv, D]
    v = v_cache[block_tables].flatten(1, 2)
    qg = q.view(B, n_kv, H // n_kv, D).float()                    # query heads grouped by the KV head they read
    scores = torch.einsum("bkgd,blkd->bkgl", qg, k.float()) * scale
    visible = torch.arange(k.shape[1], device=q.device)[None, :] < context_lens[:, None]
    scores = scores.masked_fill(~visible[:, None, None, :], float("-inf"))
    out = torch.einsum("bkgl,blkd->bkgd", scores.softmax(dim=-1), v.float())
    return out.reshape(B, H, D).to(q.dtype)


def use_triton(x: torch.Tensor) -> bool:
    return triton is not None and x.is_cuda


if triton is not None:
    @triton.jit
    def _paged_decode_kernel(q_ptr, k_ptr, v_ptr, tables_ptr, lens_ptr, out_ptr, scale,
                             sq_b, sq_h, sk_blk, sk_tok, sk_h, st_b, so_b, so_h,
                             GROUP: tl.constexpr, BLOCK_G: tl.constexpr, KV_BLOCK: tl.constexpr, D: tl.constexpr):
        """One program per (sequence, KV head): its GROUP query heads walk the sequence's KV blocks with an
        online softmax (fp32 accumulators), reading only the context_len tokens that exist."""
        b, kv = tl.program_id(0), tl.program_id(1)
        ctx = tl.load(lens_ptr + b)
        g = tl.arange(0, BLOCK_G)
        d = tl.arange(0, D)
        t = tl.arange(0, KV_BLOCK)
        heads = kv * GROUP + g
        q = tl.load(q_ptr + b * sq_b + heads[:, None] * sq_h + d[None, :], mask=(g < GROUP)[:, None], other=0.0)
        m = tl.full([BLOCK_G], float("-inf"), tl.float32)
        l = tl.zeros([BLOCK_G], tl.float32)
        acc = tl.zeros([BLOCK_G, D], tl.float32)
        for start in range(0, ctx, KV_BLOCK):
            block = tl.load(tables_ptr + b * st_b + start // KV_BLOCK).to(tl.int64)
            valid = start + t < ctx
            offs = block * sk_blk + t[:, None] * sk_tok + kv * sk_h + d[None, :]
            k = tl.load(k_ptr + offs, mask=valid[:, None], other=0.0)
            v = tl.load(v_ptr + offs, mask=valid[:, None], other=0.0)
            s = tl.dot(q, tl.trans(k)) * scale
            s = tl.where(valid[None, :], s, float("-inf"))
            m_new = tl.maximum(m, tl.max(s, 1))
            p = tl.exp(s - m_new[:, None])
            alpha = tl.exp(m - m_new)
            l = l * alpha + tl.sum(p, 1)
            acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v)
            m = m_new
        out = acc / l[:, None]
        tl.store(out_ptr + b * so_b + heads[:, None] * so_h + d[None, :], out.to(out_ptr.dtype.element_ty),
                 mask=(g < GROUP)[:, None])


def paged_decode_attention_triton(q, k_cache, v_cache, block_tables, context_lens, scale: float) -> torch.Tensor:
    """Same contract as paged_decode_attention; reads each sequence's keys once, whatever the table width."""
    B, H, D = q.shape
    n_kv = k_cache.shape[2]
    group = H // n_kv
    out = torch.empty_like(q)
    _paged_decode_kernel[(B, n_kv)](
        q, k_cache, v_cache, block_tables, context_lens, out, scale,
        q.stride(0), q.stride(1), k_cache.stride(0), k_cache.stride(1), k_cache.stride(2), block_tables.stride(0),
        out.stride(0), out.stride(1),
        GROUP=group, BLOCK_G=max(16, triton.next_power_of_2(group)), KV_BLOCK=k_cache.shape[1], D=D, num_warps=4)
    return out
