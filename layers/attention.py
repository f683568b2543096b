"""Gated full attention (spec §4) with a paged KV cache, and the plain attention of the LLaMA-likes.

The options come from the config: the sigmoid output gate (Qwen3.5; q_proj rows per head [q | gate]), the per-head
q/k RMSNorm (Qwen3.5 zero-centred, Qwen3 plain; Llama and Qwen2 none), q/k/v biases (Qwen2; added in the fused
GEMM), an o_proj bias (Llama/Qwen3 attention_bias), the rotary dims (partial for Qwen3.5).

TP split: each rank takes a contiguous block of query heads (each head's q_proj rows are [q | gate] or [q], so a
head block is a contiguous row block) and the matching o_proj columns. KV heads: split when there are at least as
many as ranks, else each rank keeps (a replica of) the one KV head its query heads use.

A step runs, per layer: one GEMM for q (+gate) | k | v (the three weights fused by rows), one op for the q/k
RMSNorm + partial RoPE + paged K/V write, the attention with the sigmoid output gate applied to its output, and
o_proj. Each op has a torch oracle `<op>_torch` and a Triton version `<op>_fast` with the same signature; the layer
binds one set at construction (layers/backend.py). Decode attention splits each sequence's context across
programs (flash-decoding) so that a few long sequences still fill the GPU; the split count depends only on shapes,
so a CUDA graph can hold it. Prefill and mixed steps (any step that is not all decodes) run one varlen causal flash
attention over the packed batch that reads every key from the paged cache, decode rows included; its oracle is a
per-sequence SDPA loop.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from dist import parallel
from layers import backend
from layers.backend import dot_precision, next_may_start, pdl, prior_done, round_to, tl, triton
from layers.forward_batch import ForwardBatch
from layers.linear import Linear, even_split, fuse_rows, linear_fast, linear_torch
from layers.norm import RMSNorm, rms_norm_torch
from layers.rotary import RotaryEmbedding, apply_rope
from layers.varlen import block_of, seq_tile

# decode split-K: least tiles a split takes before another split gets work, and the most splits per (sequence, KV
# head); per head_dim (the entry of the smallest listed dim >= it) and rows (up to `most` rows, None: any): tokens
# per inner iteration, warps, pipeline stages, and how many programs per SM the split count aims for.
# `python -m benchmarks.sweep_decode_attention --shapes 32/8x64,16/2x256,8/1x256 --batches 1,8,32,64` (1x H200,
# 2026-11-28, L2 cold, context 1024): Llama-1B's 32/8 heads x 64 10.9 -> 8.3 us at batch 1 with 64-token tiles,
# 128 above as tuned before (1x H100, 2026-11-27); Qwen3.5's head_dim 256, TP=1 / TP=2 heads, 64-token tiles and 4
# programs per SM to 8 rows (13.3 / 18.1 -> 12.3 / 15.7 us at batch 1 / 8 at TP=1; at the TP=4 shape 14.9 -> 11.6 at
# batch 1, 2026-11-27), 32 with 3 stages above (28.8 / 42.4 -> 26.8 / 41.2 at batch 32 / 64); Llama-3B's 24/8 x 128
# as tuned on the H100.
MIN_TILES_PER_SPLIT = 2
MAX_SPLITS = 128
# The merge loads CHUNK parts of every head at once (MERGE_ELEMENTS fp32 a warp, 64 registers a thread), where it had
# waited on one part after another: 1x H200, 2026-11-29, the sweep at the current settings, L2 cold, batch 1: 11.0 ->
# 10.1 us (32/8x64), 11.3 -> 10.4 (4/1x256), 12.2 -> 11.8 (8/1x256), 12.7 both (16/2x256); batch 8-64 from 0.2 us
# slower to 1.0 faster.
MERGE_ELEMENTS = 2048
DECODE_CONFIG = {64: ((1, dict(tile=64, warps=4, stages=2, per_sm=2)),
                      (None, dict(tile=128, warps=4, stages=3, per_sm=2))),
                 128: ((None, dict(tile=64, warps=4, stages=3, per_sm=2)),),
                 256: ((8, dict(tile=64, warps=4, stages=2, per_sm=4)),
                       (None, dict(tile=32, warps=4, stages=3, per_sm=2)))}
DECODE_TILE = 32  # (the tests' and the launch's default tile)
# prefill kernel tiles by head_dim (the entry for the smallest listed dim >= head_dim; module level so that
# benchmarks/bench_attention.py can sweep them). At head_dim 256 a bf16 [64, 256] Q tile plus double-buffered K and V
# tiles of 32 keys take 96 KB of shared memory, and the fp32 [64, 256] accumulator 64 registers a thread over 8 warps.
PREFILL_CONFIG = {64: dict(block_m=64, block_n=64, num_warps=4, num_stages=2),
                  128: dict(block_m=64, block_n=64, num_warps=4, num_stages=2),
                  256: dict(block_m=64, block_n=32, num_warps=8, num_stages=2)}
LOG2E = 1.4426950408889634


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
        self.eps = cfg.rms_norm_eps
        self.rotary = rotary
        # the options default to Qwen3.5's (gate, zero-centred q/k norm, no biases) for configs that lack them
        self.gated = getattr(cfg, "attn_output_gate", True)
        self.plain_norm = not getattr(cfg, "zero_centred_norms", True)
        has_qkv_bias, has_o_bias = getattr(cfg, "qkv_bias", False), getattr(cfg, "o_bias", False)
        Q = 2 * D if self.gated else D  # q_proj rows per head
        qkv_bias = dict(bias=has_qkv_bias, dtype=dtype, device=device)
        self.q_proj = Linear(hidden, H * Q, rows=[(h_start * Q, self.num_heads * Q)], **qkv_bias)
        self.k_proj = Linear(hidden, KV * D, rows=[(kv_start * D, self.num_kv_heads * D)], **qkv_bias)
        self.v_proj = Linear(hidden, KV * D, rows=[(kv_start * D, self.num_kv_heads * D)], **qkv_bias)
        self.o_proj = Linear(H * D, hidden, cols=[(h_start * D, self.num_heads * D)], bias=has_o_bias, dtype=dtype,
                             device=device)
        self.q_norm = self.k_norm = None
        if getattr(cfg, "qk_norm", True):
            self.q_norm = RMSNorm(D, cfg.rms_norm_eps, dtype=dtype, device=device, plain=self.plain_norm)
            self.k_norm = RMSNorm(D, cfg.rms_norm_eps, dtype=dtype, device=device, plain=self.plain_norm)
        # rows: per local head [q | gate] (or [q]), then the local KV heads' k, then their v (split_qkv reads this)
        self.qkv_weight = fuse_rows(self.q_proj, self.k_proj, self.v_proj)
        self.qkv_bias = fuse_rows(self.q_proj, self.k_proj, self.v_proj, attr="bias") if has_qkv_bias else None
        # [num_blocks, block_size, num_kv_heads, head_dim], allocated by the runner
        self.k_cache: torch.Tensor | None = None
        self.v_cache: torch.Tensor | None = None
        fast = backend.use_fast()
        self._in_linear = linear_fast if fast else linear_torch
        self._norm_rope_cache = qk_norm_rope_cache_fast if fast else qk_norm_rope_cache_torch
        self._decode = paged_decode_attention_fast if fast else paged_decode_attention_torch
        self._prefill = paged_prefill_attention_fast if fast else paged_prefill_attention_torch

    def forward(self, x: torch.Tensor, batch: ForwardBatch) -> torch.Tensor:
        qkv = self._in_linear(x, self.qkv_weight, self.qkv_bias)
        qw, kw = (None, None) if self.q_norm is None else (self.q_norm.weight, self.k_norm.weight)
        q = self._norm_rope_cache(qkv, batch.positions, batch.slot_mapping, qw, kw, self.rotary.cos, self.rotary.sin,
                                  self.k_cache, self.v_cache, self.eps, self.gated, self.plain_norm)
        gate = split_qkv(qkv, self.num_kv_heads, self.head_dim, self.gated)[1]  # None without the output gate
        if batch.is_decode or batch.verify_tokens:  # (a verify step's rows carry their own tables and lengths)
            o = self._decode(q, self.k_cache, self.v_cache, batch.block_tables, batch.context_lens, self.scale, gate)
        else:
            o = self._prefill(q, self.k_cache, self.v_cache, batch, self.scale, gate)
        return self.o_proj(o)

    def write_kv(self, x: torch.Tensor, positions: torch.Tensor, slot_mapping: torch.Tensor) -> None:
        """K and V of x's rows (this layer's input, normed) into the cache at `positions` / `slot_mapping`, without the
        queries: the K/V rows of the fused projection only (a view of its weight), then the same norm, RoPE and
        cache write as forward (the kernel takes a projection of no query heads). The MTP head's KV on steps that
        draft nothing (qwen35/mtp.py write_kv)."""
        rows = self.num_heads * (2 * self.head_dim if self.gated else self.head_dim)
        kv = self._in_linear(x, self.qkv_weight[rows:], None if self.qkv_bias is None else self.qkv_bias[rows:])
        kw = None if self.k_norm is None else self.k_norm.weight
        self._norm_rope_cache(kv, positions, slot_mapping, kw, kw, self.rotary.cos, self.rotary.sin, self.k_cache,
                              self.v_cache, self.eps, self.gated, self.plain_norm)


def split_qkv(qkv: torch.Tensor, num_kv_heads: int, head_dim: int, gated: bool = True):
    """Views (q, gate, k, v) of the fused projection [T, H*2D + 2*KV*D]: q, gate [T, H, D] (strided: each head's
    rows are [q_h | gate_h], spec §4), k, v [T, KV, D]. Without the gate ([T, H*D + 2*KV*D]) gate is None."""
    T, D = qkv.shape[0], head_dim
    Q = 2 * D if gated else D
    H = (qkv.shape[1] - 2 * num_kv_heads * D) // Q
    if gated:
        q, gate = qkv[:, : H * Q].view(T, H, Q).split(D, dim=-1)
    else:
        q, gate = qkv[:, : H * Q].view(T, H, D), None
    k, v = qkv[:, H * Q:].view(T, 2, num_kv_heads, D).unbind(1)
    return q, gate, k, v


# ------------------------------------------------------------------------------ q/k norm + RoPE + KV-cache write
def qk_norm_rope_cache_torch(qkv, positions, slot_mapping, q_norm_weight, k_norm_weight, cos, sin, k_cache, v_cache,
                             eps: float, gated: bool = True, plain_norm: bool = False) -> torch.Tensor:
    """RMSNorm of q and k heads (zero-centred, or plain with `plain_norm`; none when the weights are None), partial
    RoPE at `positions`, K (post-norm, post-RoPE) and V written to the paged cache at `slot_mapping`. qkv:
    [T, H*2D + 2*KV*D] ([T, H*D + 2*KV*D] when not `gated`); caches [blocks, block_size, KV, D]. Returns q [T, H, D]
    in the model dtype."""
    n_kv, D = k_cache.shape[2], k_cache.shape[3]
    q, _, k, v = split_qkv(qkv, n_kv, D, gated)
    if q_norm_weight is not None:
        q, k = rms_norm_torch(q, q_norm_weight, eps, plain_norm), rms_norm_torch(k, k_norm_weight, eps, plain_norm)
    q = apply_rope(q, positions, cos, sin)
    k = apply_rope(k, positions, cos, sin)
    k_cache.view(-1, n_kv, D)[slot_mapping] = k
    v_cache.view(-1, n_kv, D)[slot_mapping] = v
    return q


def qk_norm_rope_cache_fast(qkv, positions, slot_mapping, q_norm_weight, k_norm_weight, cos, sin, k_cache, v_cache,
                            eps: float, gated: bool = True, plain_norm: bool = False) -> torch.Tensor:
    """One launch, one program per (token, q or KV head)."""
    n_kv, D = k_cache.shape[2], k_cache.shape[3]
    T = qkv.shape[0]
    Q = 2 * D if gated else D
    H = (qkv.shape[1] - 2 * n_kv * D) // Q
    q = torch.empty(T, H, D, dtype=qkv.dtype, device=qkv.device)
    if T:
        kc, vc = k_cache.view(-1, n_kv, D), v_cache.view(-1, n_kv, D)
        block = triton.next_power_of_2(D)
        has_norm = q_norm_weight is not None
        qw, kw = (q_norm_weight, k_norm_weight) if has_norm else (qkv, qkv)  # placeholders, never read
        _norm_rope_cache_kernel[(T, H + n_kv)](
            qkv, positions, slot_mapping, qw, kw, cos, sin, q, kc, vc, eps,
            qkv.stride(0), cos.stride(0), kc.stride(0), kc.stride(1),
            H=H, KV=n_kv, D=D, Q=Q, RD=cos.shape[1], BLOCK_D=block, HAS_NORM=has_norm, PLAIN=plain_norm,
            num_warps=max(1, min(4, block // 128)), **pdl())
    return q


if triton is not None:
    @triton.jit
    def _normed(x, inv, w, PLAIN: tl.constexpr, dtype: tl.constexpr):
        """The q/k RMSNorm's output as the oracle rounds it: x * inv * (1 + w) rounded once (zero-centred), or
        round(round(x * inv) * w) (plain, Llama-style)."""
        if PLAIN:
            return round_to(round_to(x * inv, dtype) * w, dtype)
        return round_to(x * inv * (1.0 + w), dtype)

    @triton.jit
    def _norm_rope_cache_kernel(qkv_ptr, pos_ptr, slot_ptr, qw_ptr, kw_ptr, cos_ptr, sin_ptr, q_ptr, kc_ptr, vc_ptr,
                                eps, s_qkv, s_cos, s_slot, s_kvh,
                                H: tl.constexpr, KV: tl.constexpr, D: tl.constexpr, Q: tl.constexpr,
                                RD: tl.constexpr, BLOCK_D: tl.constexpr, HAS_NORM: tl.constexpr,
                                PLAIN: tl.constexpr):
        """Program (t, h): h < H is query head h, else KV head h - H (its K row is normed and rotated, its V row
        copied). Q: a query head's row count (2D with the gate rows after it, D without). Every rounding the torch
        oracle does in the model dtype is done here too: the norm's output (and its product with w when PLAIN),
        cos and sin, each product of the rotation and their sum."""
        prior_done()  # (backend.pdl: the kernels before this one have finished)
        t = tl.program_id(0).to(tl.int64)
        h = tl.program_id(1)
        dtype = q_ptr.dtype.element_ty
        d = tl.arange(0, BLOCK_D)
        in_head = d < D
        rotates = d < RD
        half = RD // 2
        partner = tl.where(d < half, d + half, d - half)  # the other half of the rotated pair (d < RD only)
        row = qkv_ptr + t * s_qkv
        if h < H:
            src = row + h * Q
            w_ptr = qw_ptr
        else:
            src = row + H * Q + (h - H) * D
            w_ptr = kw_ptr
        x = tl.load(src + d, mask=in_head, other=0.0).to(tl.float32)
        xp = tl.load(src + partner, mask=rotates, other=0.0).to(tl.float32)
        if HAS_NORM:
            inv = tl.rsqrt(tl.sum(x * x, 0) / D + eps)
            w = tl.load(w_ptr + d, mask=in_head, other=0.0).to(tl.float32)
            wp = tl.load(w_ptr + partner, mask=rotates, other=0.0).to(tl.float32)
            y = _normed(x, inv, w, PLAIN, dtype)
            yp = _normed(xp, inv, wp, PLAIN, dtype)
        else:
            y, yp = x, xp
        pos = tl.load(pos_ptr + t)
        c = round_to(tl.load(cos_ptr + pos * s_cos + d, mask=rotates, other=0.0), dtype)
        s = round_to(tl.load(sin_ptr + pos * s_cos + d, mask=rotates, other=0.0), dtype)
        rot = tl.where(d < half, -yp, yp)
        a = round_to(y * c, dtype)
        b = round_to(rot * s, dtype)
        out = tl.where(rotates, a + b, y).to(dtype)
        if h < H:
            tl.store(q_ptr + (t * H + h) * D + d, out, mask=in_head)
        else:
            slot = tl.load(slot_ptr + t).to(tl.int64)
            dst = slot * s_slot + (h - H) * s_kvh + d
            tl.store(kc_ptr + dst, out, mask=in_head)
            v = tl.load(row + H * Q + KV * D + (h - H) * D + d, mask=in_head, other=0.0)
            tl.store(vc_ptr + dst, v, mask=in_head)


# -------------------------------------------------------------------------------------------- output gate
def apply_output_gate(o: torch.Tensor, gate: torch.Tensor | None) -> torch.Tensor:
    """o * sigmoid(gate) as [T, H*D] in the model dtype (spec §4: elementwise, before o_proj); o itself as
    [T, H*D] when there is no gate (None). The torch paths' gate; the kernels apply it in their epilogue."""
    T = o.shape[0]
    if gate is None:
        return o.reshape(T, -1)
    return o.reshape(T, -1) * torch.sigmoid(gate.reshape(T, -1))


# ------------------------------------------------------------------------------------- prefill / mixed steps
def paged_prefill_attention_torch(q, k_cache, v_cache, batch: ForwardBatch, scale: float, gate) -> torch.Tensor:
    """Causal attention of each sequence's new queries over its cached keys, one sequence at a time, gated:
    [T, H*D]. q, gate: [T, H, D]."""
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
    return out.reshape(out.shape[0], -1) if gate is None else apply_output_gate(out, gate)


def paged_prefill_attention_fast(q, k_cache, v_cache, batch: ForwardBatch, scale: float, gate) -> torch.Tensor:
    """paged_prefill_attention_torch in one launch: a varlen causal flash attention over the packed batch.

    One program per (block of BLOCK_M new queries of one sequence, query head): the sequence's keys 0 .. its last
    query's position are gathered from the paged cache through its block table (the new tokens' K/V were written
    there by qk_norm_rope_cache before this runs, so chunked and prefix-hit prefills see their cached pages),
    BLOCK_N at a time, with an online softmax in fp32; key tiles that every query of the block sees skip the causal
    mask. Rows of one token on a cached context (the decode rows of a mixed step) are sequences like any other, so
    a mixed step is one launch. The grid, H * (cdiv(T, BLOCK_M) + B), comes from shapes alone (no host sync); the
    programs for one query block's heads are adjacent, so the GROUP heads of a KV head read its tiles from L2.
    gate None: no output gate."""
    T, H, D = q.shape
    block_size, n_kv = k_cache.shape[1], k_cache.shape[2]
    B = batch.num_seqs
    out = torch.empty(T, H * D, dtype=q.dtype, device=q.device)
    if T == 0:
        return out
    cfg = prefill_config(D)
    kc, vc = k_cache.view(-1, n_kv, D), v_cache.view(-1, n_kv, D)
    g = q if gate is None else gate  # placeholder pointer when there is no gate (never read)
    assert q.stride(2) == 1 and g.stride(2) == 1
    tables = batch.block_tables
    _prefill_kernel[(H * (triton.cdiv(T, cfg["block_m"]) + B),)](
        q, kc, vc, batch.cu_seqlens, batch.start_pos, tables, g, out, B, scale * LOG2E,
        q.stride(0), q.stride(1), kc.stride(0), kc.stride(1), tables.stride(0), g.stride(0), g.stride(1),
        H=H, GROUP=H // n_kv, D=D, BLOCK_D=triton.next_power_of_2(D), BLOCK_SIZE=block_size,
        BLOCK_M=cfg["block_m"], BLOCK_N=cfg["block_n"], BLOCK_B=seq_tile(B),
        HAS_GATE=gate is not None, PREC=dot_precision(q.dtype),
        num_warps=cfg["num_warps"], num_stages=cfg["num_stages"], **pdl())
    return out


def prefill_config(head_dim: int) -> dict:
    """Tiles of the prefill kernel for this head_dim: PREFILL_CONFIG's entry for the smallest listed dim >= it."""
    return next((c for d, c in sorted(PREFILL_CONFIG.items()) if d >= head_dim), PREFILL_CONFIG[max(PREFILL_CONFIG)])


if triton is not None:
    @triton.jit
    def _prefill_tile(q, m_i, l_i, acc, k_ptr, v_ptr, table, j0, pos, kv_end, kvh, s_slot, s_kvh, qk_scale,
                      d, dmask, BLOCK_SIZE: tl.constexpr, BLOCK_N: tl.constexpr, CAUSAL: tl.constexpr,
                      PREC: tl.constexpr):
        """Online-softmax update of one query block with keys j0 .. j0 + BLOCK_N - 1 (those >= kv_end masked; with
        CAUSAL also those past each query's position). Scores are in log2 units (qk_scale = scale * log2 e)."""
        j = j0 + tl.arange(0, BLOCK_N)
        jv = j < kv_end
        page = tl.load(table + j // BLOCK_SIZE, mask=jv, other=0).to(tl.int64)
        offs = (page * BLOCK_SIZE + j % BLOCK_SIZE) * s_slot + kvh * s_kvh
        kv_mask = jv[:, None] & dmask[None, :]
        k = tl.load(k_ptr + offs[:, None] + d[None, :], mask=kv_mask, other=0.0)
        v = tl.load(v_ptr + offs[:, None] + d[None, :], mask=kv_mask, other=0.0)
        s = tl.dot(q, tl.trans(k), input_precision=PREC) * qk_scale
        if CAUSAL:
            s = tl.where((j[None, :] <= pos[:, None]) & jv[None, :], s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, 1))
        p = tl.exp2(s - m_new[:, None])
        alpha = tl.exp2(m_i - m_new)
        l_i = l_i * alpha + tl.sum(p, 1)
        acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=PREC)
        return m_new, l_i, acc

    # the step's metadata (sequences, where their rows start, the block tables' width) stays out of the compile key
    @triton.jit(do_not_specialize=["cu_ptr", "start_ptr", "tables_ptr", "B", "st_b"])
    def _prefill_kernel(q_ptr, k_ptr, v_ptr, cu_ptr, start_ptr, tables_ptr, gate_ptr, out_ptr, B, qk_scale,
                        sq_t, sq_h, s_slot, s_kvh, st_b, sg_t, sg_h,
                        H: tl.constexpr, GROUP: tl.constexpr, D: tl.constexpr, BLOCK_D: tl.constexpr,
                        BLOCK_SIZE: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                        BLOCK_B: tl.constexpr, HAS_GATE: tl.constexpr, PREC: tl.constexpr):
        """Program (query block, head h), blocks in reverse order so that the long causal blocks start first.
        Query i of sequence b sits at absolute position start_b + i and sees keys 0 .. start_b + i."""
        prior_done()  # (backend.pdl: the kernels before this one have finished)
        pid = tl.program_id(0)
        h = pid % H
        b, blk = block_of(cu_ptr, tl.num_programs(0) // H - 1 - pid // H, B, BLOCK_M, BLOCK_B, False)
        if b >= B:
            return
        kvh = h // GROUP
        lo = tl.load(cu_ptr + b)
        n = tl.load(cu_ptr + b + 1) - lo
        start = tl.load(start_ptr + b)
        i = blk * BLOCK_M + tl.arange(0, BLOCK_M)
        pos = start + i
        d = tl.arange(0, BLOCK_D)
        dmask = d < D
        tok = (lo + i).to(tl.int64)
        mask = (i < n)[:, None] & dmask[None, :]
        q = tl.load(q_ptr + tok[:, None] * sq_t + h * sq_h + d[None, :], mask=mask, other=0.0)
        m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
        l_i = tl.zeros([BLOCK_M], tl.float32)
        acc = tl.zeros([BLOCK_M, BLOCK_D], tl.float32)
        table = tables_ptr + b.to(tl.int64) * st_b
        kv_end = start + tl.minimum(n, (blk + 1) * BLOCK_M)        # one past the block's last query position
        full_end = (start + blk * BLOCK_M) // BLOCK_N * BLOCK_N    # keys below it are seen by every query
        for j0 in range(0, full_end, BLOCK_N):
            m_i, l_i, acc = _prefill_tile(q, m_i, l_i, acc, k_ptr, v_ptr, table, j0, pos, kv_end, kvh, s_slot,
                                          s_kvh, qk_scale, d, dmask, BLOCK_SIZE, BLOCK_N, False, PREC)
        # the rest: each query sees at least key full_end (<= its position), so no row is all -inf
        for j0 in range(full_end, kv_end, BLOCK_N):
            m_i, l_i, acc = _prefill_tile(q, m_i, l_i, acc, k_ptr, v_ptr, table, j0, pos, kv_end, kvh, s_slot,
                                          s_kvh, qk_scale, d, dmask, BLOCK_SIZE, BLOCK_N, True, PREC)
        o = acc / l_i[:, None]
        dst = out_ptr + tok[:, None] * (H * D) + h * D + d[None, :]
        if HAS_GATE:
            gate = tl.load(gate_ptr + tok[:, None] * sg_t + h * sg_h + d[None, :], mask=mask, other=0.0)
            tl.store(dst, _apply_gate(o, gate), mask=mask)
        else:
            tl.store(dst, o.to(out_ptr.dtype.element_ty), mask=mask)


# ------------------------------------------------------------------------------------------ decode attention
def paged_decode_attention_torch(q, k_cache, v_cache, block_tables, context_lens, scale: float, gate) -> torch.Tensor:
    """One query per sequence over its paged keys, all sequences at once (no host sync; fixed shapes for a given
    block-table width), gated: [B, H*D]. q, gate: [B, H, D] (gate None: no gate); block_tables: [B, max_blocks];
    context_lens: [B] (keys 0..len-1 visible)."""
    B, H, D = q.shape
    n_kv = k_cache.shape[2]
    k = k_cache[block_tables].flatten(1, 2)                       # [B, L, kv, D]
    v = v_cache[block_tables].flatten(1, 2)
    qg = q.view(B, n_kv, H // n_kv, D).float()                    # query heads grouped by the KV head they read
    scores = torch.einsum("bkgd,blkd->bkgl", qg, k.float()) * scale
    visible = torch.arange(k.shape[1], device=q.device)[None, :] < context_lens[:, None]
    scores = scores.masked_fill(~visible[:, None, None, :], float("-inf"))
    out = torch.einsum("bkgl,blkd->bkgd", scores.softmax(dim=-1), v.float())
    return apply_output_gate(out.reshape(B, H, D).to(q.dtype), gate)


def paged_decode_attention_fast(q, k_cache, v_cache, block_tables, context_lens, scale: float, gate) -> torch.Tensor:
    """Flash-decoding: each (sequence, KV head) context is cut into `decode_splits(...)` parts (a value that depends
    only on shapes), each part one program; the last program of a (sequence, KV head) to finish merges the parts of
    its query heads and applies the gate (if any), in the same launch. With one split each program applies the gate
    itself."""
    cfg = decode_config(q.shape[2], q.shape[0])
    splits = decode_splits(q.shape[0], k_cache.shape[2], block_tables.shape[1] * k_cache.shape[1], q.device,
                           cfg["tile"], cfg["per_sm"])
    return paged_decode_launch(q, k_cache, v_cache, block_tables, context_lens, scale, gate, splits, tile=cfg["tile"],
                               warps=cfg["warps"], stages=cfg["stages"])


def decode_variant_rows(max_rows: int, kv_heads: int, max_tokens: int, head_dim: int,
                        device: torch.device) -> list[int]:
    """Row counts whose paged_decode_attention_fast launches meet every kernel variant a launch of 1..max_rows rows
    can (the split count picks the variant: its power-of-two bound, and whether it is 1 or a multiple of 16), the
    smallest of each: what a warm-up runs so that no variant compiles mid-serving (a verify step decodes
    batch x (k + 1) rows, any count up to max_num_seqs x (K + 1)); the settings by rows (decode_config) are part of
    the variant."""
    seen = {}
    for rows in range(1, max_rows + 1):
        cfg = decode_config(head_dim, rows)
        s = decode_splits(rows, kv_heads, max_tokens, device, cfg["tile"], cfg["per_sm"])
        seen.setdefault((tuple(sorted(cfg.items())), triton.next_power_of_2(s), s == 1, s % 16 == 0), rows)
    return sorted(seen.values())


def decode_config(head_dim: int, rows: int) -> dict:
    """The decode kernel's settings for this head_dim and row count: DECODE_CONFIG's entry for the smallest listed
    dim >= head_dim (else the largest), its first setting whose row bound takes `rows`."""
    table = next((c for d, c in sorted(DECODE_CONFIG.items()) if d >= head_dim), DECODE_CONFIG[max(DECODE_CONFIG)])
    return next(cfg for most, cfg in table if most is None or rows <= most)


def decode_splits(batch: int, kv_heads: int, max_tokens: int, device: torch.device, tile: int = DECODE_TILE,
                  per_sm: int = 2) -> int:
    """Enough programs to fill the GPU (per_sm per SM over batch * kv_heads), but no more splits than the widest
    possible context can give MIN_TILES_PER_SPLIT tiles of `tile` tokens each, and at most MAX_SPLITS."""
    want = -(-per_sm * backend.sm_count(device) // (batch * kv_heads))
    most = -(-max_tokens // (tile * MIN_TILES_PER_SPLIT))
    return max(1, min(want, most, MAX_SPLITS))


def paged_decode_launch(q, k_cache, v_cache, block_tables, context_lens, scale: float, gate, splits: int,
                        tile: int = DECODE_TILE, min_tiles: int = MIN_TILES_PER_SPLIT, warps: int = 4,
                        stages: int = 2, merge_chunk: int | None = None) -> torch.Tensor:
    """paged_decode_attention_fast with the split count and tile size given (tests run every split path; the
    benchmark sweeps tiles, warps and stages). merge_chunk: parts the merge loads at once (default: as many as
    MERGE_ELEMENTS a warp allows)."""
    B, H, D = q.shape
    block_size, n_kv = k_cache.shape[1], k_cache.shape[2]
    group = H // n_kv
    out = torch.empty(B, H * D, dtype=q.dtype, device=q.device)
    if B == 0:
        return out
    kc, vc = k_cache.view(-1, n_kv, D), v_cache.view(-1, n_kv, D)
    lse = part = out  # placeholders: with one split the attention kernel writes `out` directly
    if splits > 1:
        lse = torch.empty(B, H, splits, dtype=torch.float32, device=q.device)
        part = torch.empty(B, H, splits, D, dtype=torch.float32, device=q.device)
    block_d = triton.next_power_of_2(D)
    has_gate = gate is not None
    if not has_gate:
        gate = q  # a placeholder, never read
    assert q.stride(2) == 1 and gate.stride(2) == 1
    counters = backend.arrival_counters(B * n_kv, q.device) if splits > 1 else out  # (placeholder: never read)
    merge_g = triton.next_power_of_2(group)
    block_s = triton.next_power_of_2(splits)
    chunk = merge_chunk or max(1, min(block_s, MERGE_ELEMENTS * warps // (merge_g * block_d)))
    _decode_split_kernel[(B, n_kv, splits)](
        q, kc, vc, block_tables, context_lens, gate, out, lse, part, counters, scale, splits,
        q.stride(0), q.stride(1), kc.stride(0), kc.stride(1), block_tables.stride(0), gate.stride(0), gate.stride(1),
        GROUP=group, BLOCK_G=max(16, merge_g), MERGE_G=merge_g, D=D, BLOCK_D=block_d, BLOCK_SIZE=block_size,
        TILE=tile, MIN_TILES=min_tiles, BLOCK_S=block_s, CHUNK=chunk, ONE_SPLIT=splits == 1,
        HAS_GATE=has_gate, PREC=dot_precision(q.dtype), EARLY=backend.early_launch(B), num_warps=warps,
        num_stages=stages, **pdl())
    return out


if triton is not None:
    @triton.jit
    def _split_tokens(ctx, splits, TILE: tl.constexpr, MIN_TILES: tl.constexpr):
        """Tokens per split for a context of ctx tokens: the context spread evenly over the splits in whole tiles,
        but at least MIN_TILES tiles each (a short context uses fewer splits; the rest are empty)."""
        return tl.maximum(MIN_TILES, tl.cdiv(tl.cdiv(ctx, TILE), splits)) * TILE

    @triton.jit
    def _apply_gate(o, gate):
        """o * sigmoid(gate) with the oracle's roundings (o, the sigmoid and the product in the gate's dtype)."""
        dtype = gate.dtype
        g = round_to(tl.sigmoid(gate.to(tl.float32)), dtype)
        return (round_to(o, dtype) * g).to(dtype)

    @triton.jit
    def _decode_split_kernel(q_ptr, k_ptr, v_ptr, tables_ptr, lens_ptr, gate_ptr, out_ptr, lse_ptr, part_ptr,
                             count_ptr, scale, splits, sq_b, sq_h, s_slot, s_kvh, st_b, sg_b, sg_h,
                             GROUP: tl.constexpr, BLOCK_G: tl.constexpr, D: tl.constexpr, BLOCK_D: tl.constexpr,
                             BLOCK_SIZE: tl.constexpr, TILE: tl.constexpr, MIN_TILES: tl.constexpr,
                             BLOCK_S: tl.constexpr, CHUNK: tl.constexpr, MERGE_G: tl.constexpr,
                             ONE_SPLIT: tl.constexpr, HAS_GATE: tl.constexpr, PREC: tl.constexpr,
                             EARLY: tl.constexpr):
        """Program (b, kv head, split): the GROUP query heads of one KV head over one contiguous part of sequence
        b's context, TILE tokens at a time (gathered through the block table), with an online softmax in fp32.
        One split: normalise, gate and store the output. Several: store the part's normalised output and its
        log-sum-exp (an empty part stores lse = -inf, a neutral partial, and no output), then count itself in; the
        last of the (b, kv head)'s programs to arrive merges the non-empty parts (_merge_splits) and resets the
        counter. No float atomics: the merge adds the parts in split order whatever the order of arrival."""
        prior_done()  # (backend.pdl: the kernels before this one have finished)
        if EARLY:  # (backend.early_launch: the GEMV after this kernel loads its weights while it runs)
            next_may_start()
        b = tl.program_id(0).to(tl.int64)
        kvh = tl.program_id(1)
        split = tl.program_id(2)
        H = tl.num_programs(1) * GROUP
        ctx = tl.load(lens_ptr + b)
        per = _split_tokens(ctx, splits, TILE, MIN_TILES)
        start = split * per
        end = tl.minimum(ctx, start + per)
        g = tl.arange(0, BLOCK_G)
        d = tl.arange(0, BLOCK_D)
        t = tl.arange(0, TILE)
        heads = kvh * GROUP + g
        mask = (g < GROUP)[:, None] & (d < D)[None, :]
        q = tl.load(q_ptr + b * sq_b + heads[:, None] * sq_h + d[None, :], mask=mask, other=0.0)
        m = tl.full([BLOCK_G], float("-inf"), tl.float32)
        l = tl.zeros([BLOCK_G], tl.float32)
        acc = tl.zeros([BLOCK_G, BLOCK_D], tl.float32)
        for t0 in range(start, end, TILE):
            tok = t0 + t
            valid = tok < end
            block = tl.load(tables_ptr + b * st_b + tok // BLOCK_SIZE, mask=valid, other=0).to(tl.int64)
            offs = (block * BLOCK_SIZE + tok % BLOCK_SIZE) * s_slot + kvh * s_kvh
            kv_mask = valid[:, None] & (d < D)[None, :]
            k = tl.load(k_ptr + offs[:, None] + d[None, :], mask=kv_mask, other=0.0)
            v = tl.load(v_ptr + offs[:, None] + d[None, :], mask=kv_mask, other=0.0)
            s = tl.dot(q, tl.trans(k), input_precision=PREC) * scale
            s = tl.where(valid[None, :], s, float("-inf"))
            m_new = tl.maximum(m, tl.max(s, 1))
            p = tl.exp(s - m_new[:, None])
            alpha = tl.exp(m - m_new)
            l = l * alpha + tl.sum(p, 1)
            acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=PREC)
            m = m_new
        l_safe = tl.where(l > 0, l, 1.0)
        o = acc / l_safe[:, None]
        if ONE_SPLIT:
            if HAS_GATE:
                gate = tl.load(gate_ptr + b * sg_b + heads[:, None] * sg_h + d[None, :], mask=mask, other=0.0)
                res = _apply_gate(o, gate)
            else:
                res = o.to(out_ptr.dtype.element_ty)
            tl.store(out_ptr + b * H * D + heads[:, None] * D + d[None, :], res, mask=mask)
        else:
            rows = (b * H + heads) * splits + split
            tl.store(lse_ptr + rows, tl.where(l > 0, m + tl.log(l_safe), float("-inf")), mask=g < GROUP)
            if end > start:
                tl.store(part_ptr + rows[:, None] * D + d[None, :], o, mask=mask)
            # arrive: the barrier orders every thread's stores above before the (one-thread) release
            tl.debug_barrier()
            count = count_ptr + b * tl.num_programs(1) + kvh
            if tl.atomic_add(count, 1, sem="acq_rel") == splits - 1:
                _merge_splits(lse_ptr, part_ptr, gate_ptr, out_ptr, b, kvh * GROUP, tl.cdiv(ctx, per), splits, H,
                              sg_b, sg_h, GROUP, D, MERGE_G, BLOCK_D, BLOCK_S, CHUNK, HAS_GATE)
                tl.store(count, 0)

    @triton.jit
    def _merge_splits(lse_ptr, part_ptr, gate_ptr, out_ptr, b, head0, n, splits, H, sg_b, sg_h, GROUP: tl.constexpr,
                      D: tl.constexpr, MERGE_G: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_S: tl.constexpr,
                      CHUNK: tl.constexpr, HAS_GATE: tl.constexpr):
        """The output of query heads head0 .. head0 + GROUP - 1 of sequence b: the n non-empty parts (their count
        follows from the context length exactly as the parts were cut) weighted by exp(lse), then the gate. The
        parts were stored by other programs: read from L2 (.cg), CHUNK parts of every head in one load, so that a
        merge of n parts waits on ceil(n / CHUNK) round trips, not n; the weighted parts are summed in a fixed order
        whatever the order of arrival."""
        g = tl.arange(0, MERGE_G)
        d = tl.arange(0, BLOCK_D)
        hmask = g < GROUP
        mask = hmask[:, None] & (d < D)[None, :]
        base = (b * H + head0 + g) * splits
        s_idx = tl.arange(0, BLOCK_S)
        lse = tl.load(lse_ptr + base[:, None] + s_idx[None, :], mask=hmask[:, None] & (s_idx < n)[None, :],
                      other=float("-inf"), cache_modifier=".cg")
        top = tl.where(hmask, tl.max(lse, 1), 0.0)  # (rows past the group: all -inf, kept finite)
        total = tl.sum(tl.exp(lse - top[:, None]), 1)
        c = tl.arange(0, CHUNK)
        acc = tl.zeros([MERGE_G, BLOCK_D], tl.float32)
        for s0 in range(0, n, CHUNK):
            s = s0 + c
            live = hmask[:, None] & (s < n)[None, :]
            w = tl.exp(tl.load(lse_ptr + base[:, None] + s[None, :], mask=live, other=float("-inf"),
                               cache_modifier=".cg") - top[:, None])
            parts = tl.load(part_ptr + (base[:, None, None] + s[None, :, None]) * D + d[None, None, :],
                            mask=live[:, :, None] & (d < D)[None, None, :], other=0.0, cache_modifier=".cg")
            acc += tl.sum(w[:, :, None] * parts, 1)
        o = acc / tl.where(hmask, total, 1.0)[:, None]
        heads = head0 + g
        dst = out_ptr + b * H * D + heads[:, None] * D + d[None, :]
        if HAS_GATE:
            gate = tl.load(gate_ptr + b * sg_b + heads[:, None] * sg_h + d[None, :], mask=mask, other=0.0)
            tl.store(dst, _apply_gate(o, gate), mask=mask)
        else:
            tl.store(dst, o.to(out_ptr.dtype.element_ty), mask=mask)
