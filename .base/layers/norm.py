"""RMSNorm variants of Qwen3.5 (spec §2.1): the zero-centred one (weight stored as a delta around 1) and the gated
one of the DeltaNet output (weight used directly, then multiplied by silu(z)); and the LLaMA-likes' plain one
(`plain=True`: x / rms(x) rounded to the model dtype, then times w in the model dtype, as LlamaRMSNorm does).

The layer norms take the residual stream too: `norm(x, residual)` returns (norm(x + residual), x + residual), the
sum rounded to the model dtype first as the reference's residual add is, so that one kernel replaces an add, a norm
and their casts at every layer boundary.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from dist import allreduce, parallel, push
from dist.push import Pushed
from layers import backend, linear
from layers.backend import pdl, prior_done, rms_norm_row, round_to, tl, triton
from layers.linear import PendingNorm, make_param


def rms_norm_torch(x: torch.Tensor, weight: torch.Tensor, eps: float, plain: bool = False) -> torch.Tensor:
    x32 = x.float()
    y = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps)
    if plain:
        return weight.to(x.dtype) * y.to(x.dtype)  # Llama: cast, then multiply in the model dtype
    return (y * (1.0 + weight.float())).to(x.dtype)  # multiply in fp32, then cast (unlike Llama)


def add_rms_norm_torch(x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float,
                       plain: bool = False):
    """(rms_norm(x + residual), x + residual), the sum in the model dtype."""
    s = x + residual
    return rms_norm_torch(s, weight, eps, plain), s


def gated_rms_norm_torch(x: torch.Tensor, z: torch.Tensor, weight: torch.Tensor, eps: float,
                         out: torch.Tensor | None = None) -> torch.Tensor:
    dtype = x.dtype
    x32 = x.float()
    y = (x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps)).to(dtype)
    y = weight.float() * y.float()  # weight kept fp32 (checkpoint dtype); HF rounds it to bf16 first
    y = (y * F.silu(z.float())).to(dtype)
    return y if out is None else out.copy_(y)


def gated_rms_norm_fast(x: torch.Tensor, z: torch.Tensor, weight: torch.Tensor, eps: float,
                        out: torch.Tensor | None = None) -> torch.Tensor:
    """gated_rms_norm_torch in one launch: x, z [..., H, D] (z may be a strided view, e.g. of the DeltaNet's fused
    projection) -> [..., H, D] in x's dtype (into `out`, contiguous, x's shape, where given); one program per (row,
    block of heads)."""
    shape, D = x.shape, x.shape[-1]
    H = shape[-2] if x.dim() > 1 else 1
    x3, z3 = x.reshape(-1, H, D), z.reshape(-1, H, D)
    if x3.stride(-1) != 1:
        x3 = x3.contiguous()
    if z3.stride(-1) != 1:
        z3 = z3.contiguous()
    out = torch.empty(x3.shape, dtype=x.dtype, device=x.device) if out is None else out.view(x3.shape)
    rows = x3.shape[0]
    if rows:
        block_d = triton.next_power_of_2(D)
        block_h = min(triton.next_power_of_2(H), max(1, 4096 // block_d))
        _gated_rms_norm_kernel[(rows, triton.cdiv(H, block_h))](
            x3, z3, weight, out, H, D, x3.stride(0), x3.stride(1), z3.stride(0), z3.stride(1), eps,
            BLOCK_H=block_h, BLOCK_D=block_d, num_warps=max(1, min(8, block_h * block_d // 512)), **pdl())
    return out.view(shape)


def rms_norm_fast(x: torch.Tensor, weight: torch.Tensor, eps: float, plain: bool = False) -> torch.Tensor:
    return _launch(x, None, weight, eps, plain)[0]


def add_rms_norm_fast(x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float,
                      plain: bool = False):
    return _launch(x, residual, weight, eps, plain)


# The norm kernel's warps per row: one per `per_warp` elements, at most `max_warps` (benchmarks/bench_linear.py --norm
# --sweep times the choices; module level, so that it can).
NORM_CONFIG = {"per_warp": 256, "max_warps": 8}


def _launch(x, residual, weight, eps, plain, out=None, res_out=None):
    """The norm kernel into out and res_out (new tensors where None; given ones are contiguous, x's shape)."""
    shape, n = x.shape, x.shape[-1]
    x2 = x.reshape(-1, n)
    if x2.stride(-1) != 1:
        x2 = x2.contiguous()
    out = torch.empty(x2.shape, dtype=x.dtype, device=x.device) if out is None else out.view(x2.shape)
    res_in = out  # placeholders, never touched when HAS_RESIDUAL is False
    if residual is not None:
        res_in = residual.reshape(-1, n)
        res_out = torch.empty_like(out) if res_out is None else res_out.view(x2.shape)
    else:
        res_out = out
    rows = x2.shape[0]
    if rows:
        block = triton.next_power_of_2(n)
        _rms_norm_kernel[(rows,)](x2, res_in, res_out, weight, out, n, x2.stride(0), res_in.stride(0), eps,
                                  HAS_RESIDUAL=residual is not None, PLAIN=plain, BLOCK=block,
                                  num_warps=max(1, min(NORM_CONFIG["max_warps"], block // NORM_CONFIG["per_warp"])),
                                  **pdl())
    return out.view(shape), (res_out.view(shape) if residual is not None else None)


if triton is not None:
    @triton.jit
    def _rms_norm_kernel(x_ptr, res_ptr, res_out_ptr, w_ptr, out_ptr, n, sx, sr, eps,
                         HAS_RESIDUAL: tl.constexpr, PLAIN: tl.constexpr, BLOCK: tl.constexpr):
        """One row: s = x (+ residual, rounded to the model dtype, stored); out = s / rms(s) * (1 + w), or with
        PLAIN round(s / rms(s)) * w rounded (the oracle's two roundings in the model dtype): backend.rms_norm_row."""
        prior_done()  # (backend.pdl: the kernels before this one have finished)
        row = tl.program_id(0).to(tl.int64)
        cols = tl.arange(0, BLOCK)
        mask = cols < n
        s = tl.load(x_ptr + row * sx + cols, mask=mask, other=0.0)
        rms_norm_row(s, res_ptr + row * sr, res_out_ptr + row * n, w_ptr, out_ptr + row * n, cols, mask, mask, n, eps,
                     HAS_RESIDUAL, PLAIN)

    @triton.jit
    def _gated_rms_norm_kernel(x_ptr, z_ptr, w_ptr, out_ptr, H, D, sx_r, sx_h, sz_r, sz_h, eps,
                               BLOCK_H: tl.constexpr, BLOCK_D: tl.constexpr):
        """Heads [hb * BLOCK_H, ...) of one row: y = x / rms(x) per head, rounded to the model dtype (as the
        reference casts the normed x), then w * y * silu(z) in fp32, rounded once."""
        prior_done()  # (backend.pdl: the kernels before this one have finished)
        r = tl.program_id(0).to(tl.int64)
        h = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)
        d = tl.arange(0, BLOCK_D)
        mask = (h < H)[:, None] & (d < D)[None, :]
        x = tl.load(x_ptr + r * sx_r + h[:, None] * sx_h + d[None, :], mask=mask, other=0.0).to(tl.float32)
        dtype = out_ptr.dtype.element_ty
        y = round_to(x * tl.rsqrt(tl.sum(x * x, 1) / D + eps)[:, None], dtype)
        w = tl.load(w_ptr + d, mask=d < D, other=0.0).to(tl.float32)
        z = tl.load(z_ptr + r * sz_r + h[:, None] * sz_h + d[None, :], mask=mask, other=0.0).to(tl.float32)
        tl.store(out_ptr + (r * H + h[:, None]) * D + d[None, :], ((w[None, :] * y) * (z * tl.sigmoid(z))).to(dtype),
                 mask=mask)


def _compute_pending(p: PendingNorm) -> None:
    if isinstance(p.x, Pushed):
        pull_add_rms_norm(p.x, p.residual, p.weight, p.eps, p.plain, p.out, p.residual_out)
    else:
        _launch(p.x, p.residual, p.weight, p.eps, p.plain, p.out, p.residual_out)


class RMSNorm(nn.Module):
    """Zero-centred: y = x / rms(x) * (1 + w); or with plain=True (LLaMA-likes) y = x / rms(x) * w. Used for layer
    norms, the final norm and q/k norms.

    forward(x) -> y;  forward(x, residual) -> (norm(x + residual), x + residual);
    all_reduce_add(x, residual) and boundary(x, residual): the same at a layer boundary under TP."""

    def __init__(self, dim: int, eps: float, dtype=None, device=None, plain: bool = False):
        super().__init__()
        self.eps = eps
        self.plain = plain
        self.weight = make_param((dim,), [None], dtype, device)  # replicated
        self.weight.data.fill_(1.0 if plain else 0.0)  # the identity either way
        fast = backend.use_fast()
        self._norm = rms_norm_fast if fast else rms_norm_torch
        self._add_norm = add_rms_norm_fast if fast else add_rms_norm_torch
        self._reduce_add_norm = all_reduce_add_rms_norm_fast if fast else all_reduce_add_rms_norm_torch
        self._fast = fast

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None = None):
        if residual is None:
            return self._norm(x, self.weight, self.eps, self.plain)
        return self._add_norm(x, residual, self.weight, self.eps, self.plain)

    def all_reduce_add(self, x: torch.Tensor, residual: torch.Tensor):
        """A layer boundary: x holds this rank's partial sums (row-parallel projections, local experts);
        returns (norm(sum_ranks(x) + residual), sum_ranks(x) + residual)."""
        return self._reduce_add_norm(x, residual, self.weight, self.eps, self.plain)

    def boundary(self, x: torch.Tensor, residual: torch.Tensor | None):
        """all_reduce_add(x, residual), or (self(x), x) for the first layer's input (residual None: the embeddings,
        whole on every rank); where the sublayer's first GEMV can compute the norm itself (the fast kernels at one
        rank, at most linear.FOLD_MAX_M rows: one launch less per layer boundary) the normed rows are a PendingNorm,
        its sum allocated and written by that GEMV (a reader that cannot fold it computes it with the norm kernel,
        as here). Every reader of a PendingNorm goes through linear_fast or linear.computed()."""
        pushed = isinstance(x, Pushed)
        rows = x.rows if pushed else x.numel() // x.shape[-1]
        if not (self._fast and (pushed or parallel.tp_size() == 1) and 0 < rows <= linear.FOLD_MAX_M
                and x.dtype == self.weight.dtype and (pushed or x.is_contiguous())):
            return (self(x), x) if residual is None else self.all_reduce_add(x, residual)
        out = torch.empty(x.shape, dtype=x.dtype, device=x.device)
        res_out = None if residual is None else torch.empty_like(residual)
        pending = PendingNorm(x, residual, self.weight, self.eps, self.plain, out, res_out, _compute_pending)
        return pending, (x if residual is None else res_out)


class GatedRMSNorm(nn.Module):
    """Not zero-centred: y = (x / rms(x)) * w * silu(z), per DeltaNet value head. Weight kept in fp32."""

    def __init__(self, dim: int, eps: float, device=None):
        super().__init__()
        self.eps = eps
        self.weight = make_param((dim,), [None], torch.float32, device)  # replicated
        self.weight.data.fill_(1.0)
        self._norm = gated_rms_norm_fast if backend.use_fast() else gated_rms_norm_torch

    def forward(self, x: torch.Tensor, z: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
        return self._norm(x, z, self.weight, self.eps, out)


# ---------------------------------------------------------------------------------------------------------------
# The layer boundary under tensor parallelism: all-reduce of the partial sums + residual add + RMSNorm.
# At TP=1 / on the CPU / for messages too big for the one-shot path it is parallel.all_reduce then add_rms_norm;
# with a symmetric-memory workspace (dist/allreduce.py) and a small message, one kernel: stage this rank's rows in
# its buffer, barrier, sum every rank's rows in rank order (identical bits on every rank), add the residual, norm,
# barrier (the buffer may be rewritten once every rank has read it).

def all_reduce_add_rms_norm_torch(x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float,
                                  plain: bool = False):
    """x holds this rank's partial sums: (rms_norm(sum_ranks(x) + residual), sum_ranks(x) + residual)."""
    return add_rms_norm_torch(parallel.all_reduce(x), residual, weight, eps, plain)


def all_reduce_add_rms_norm_fast(x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float,
                                 plain: bool = False):
    """One kernel when the one-shot path takes the message (zero-centred norms: the fused kernel has no plain
    variant yet), else the all-reduce and then add_rms_norm_fast; from the inbox when x is a Pushed."""
    if isinstance(x, Pushed):
        return pull_add_rms_norm(x, residual, weight, eps, plain)
    ws = allreduce.current()
    if plain or allreduce.choose(x, ws) != "one_shot":
        return add_rms_norm_fast(parallel.all_reduce(x), residual, weight, eps, plain)
    return fused_all_reduce_add_rms_norm(x, residual, weight, eps, ws)


def fused_all_reduce_add_rms_norm(x, residual, weight, eps, ws):
    """The one-kernel boundary over workspace `ws` (its buffers may be P simulated peers in one process: tests)."""
    n = x.shape[-1]
    allreduce.check_fits(x.numel() * x.element_size(), ws)
    x2, r2 = x.reshape(-1, n), residual.reshape(-1, n)
    out, res_out = torch.empty_like(x2), torch.empty_like(r2)
    rows = x2.shape[0]
    if rows:
        block = triton.next_power_of_2(n)
        _all_reduce_add_rms_norm_kernel[(min(rows, allreduce.MAX_BLOCKS),)](
            x2, r2, res_out, weight, out, ws.table, ws.flag_offset, ws.rank, rows, n, x2.stride(0), r2.stride(0),
            eps, P=ws.world, PP=triton.next_power_of_2(ws.world), MAX_BLOCKS=allreduce.MAX_BLOCKS, BLOCK=block,
            num_warps=max(1, min(8, block // 256)), **pdl())
    return out.view(x.shape), res_out.view(residual.shape)


if triton is not None:
    @triton.jit
    def _all_reduce_add_rms_norm_kernel(x_ptr, res_ptr, res_out_ptr, w_ptr, out_ptr, table, flag_off, rank, rows, n,
                                        sx, sr, eps, P: tl.constexpr, PP: tl.constexpr, MAX_BLOCKS: tl.constexpr,
                                        BLOCK: tl.constexpr):
        """Rows pid, pid + grid, ...: s = sum over ranks of x (fp32, rank order, rounded to the model dtype once,
        as the reference's all-reduced tensor is), then the residual add and the norm of _rms_norm_kernel.
        Offsets stay int32: rows x n is at most the one-shot limit."""
        prior_done()  # (backend.pdl: the kernels before this one have finished)
        dt = x_ptr.dtype.element_ty
        mine = allreduce.peer_buffer(table, rank, dt)
        cols = tl.arange(0, BLOCK)
        mask = cols < n
        first, step = tl.program_id(0), tl.num_programs(0)
        for row in range(first, rows, step):
            tl.store(mine + row * n + cols, tl.load(x_ptr + row * sx + cols, mask=mask), mask=mask)
        allreduce.block_barrier(table, flag_off, rank, 0, P, PP, MAX_BLOCKS)
        for row in range(first, rows, step):
            s = round_to(allreduce.sum_peers(table, row * n + cols, mask, P, dt), dt)
            r = tl.load(res_ptr + row * sr + cols, mask=mask, other=0.0)
            s = round_to(s + r.to(tl.float32), r.dtype)  # the reference's add, rounded once
            tl.store(res_out_ptr + row * n + cols, s.to(r.dtype), mask=mask)
            inv = tl.rsqrt(tl.sum(s * s, 0) / n + eps)
            w = tl.load(w_ptr + cols, mask=mask, other=0.0).to(tl.float32)
            tl.store(out_ptr + row * n + cols, (s * inv * (1.0 + w)).to(out_ptr.dtype.element_ty), mask=mask)
        allreduce.block_barrier(table, flag_off, rank, 1, P, PP, MAX_BLOCKS)  # every rank has read my buffer


def pull_add_rms_norm(p: Pushed, residual: torch.Tensor, weight: torch.Tensor, eps: float, plain: bool = False,
                      out: torch.Tensor | None = None, res_out: torch.Tensor | None = None):
    """The boundary from the inbox (dist/push.py), one kernel: poll for every rank's partial sums, sum them in rank
    order (fp32, rounded once: the one-shot kernel's bits), add the residual, norm. Into out / res_out where given."""
    box, H = p.inbox, p.shape[-1]
    r2 = residual.reshape(-1, H)
    out = torch.empty(p.shape, dtype=p.dtype, device=p.device) if out is None else out
    res_out = torch.empty_like(residual) if res_out is None else res_out
    block = triton.next_power_of_2(H)
    _pull_add_rms_norm_kernel[(p.rows,)](r2, r2.stride(0), res_out, weight, out, H, eps, p.slot,
                                         *push.launch_args(box), P=box.world, PLAIN=plain, BLOCK=block,
                                         num_warps=max(1, min(8, block // 256)), **pdl())
    return out.view(p.shape), res_out.view(residual.shape)


if triton is not None:
    @triton.jit(do_not_specialize=["slot"])
    def _pull_add_rms_norm_kernel(res_ptr, sr, res_out_ptr, w_ptr, out_ptr, H, eps, slot, table, rank,
                                  region_stride, P: tl.constexpr, PLAIN: tl.constexpr, BLOCK: tl.constexpr):
        """One row: the inbox's sum rounded to the model dtype once, then rms_norm_row's add and norm."""
        prior_done()  # (backend.pdl: the kernels before this one have finished)
        row = tl.program_id(0)
        cols = tl.arange(0, BLOCK)
        mask = cols < H
        dt = out_ptr.dtype.element_ty
        s = round_to(push.pull_sum(slot, row, cols, mask, table, rank, region_stride, H, P, dt), dt)
        rms_norm_row(s, res_ptr + row * sr, res_out_ptr + row * H, w_ptr, out_ptr + row * H, cols, mask, mask, H,
                     eps, True, PLAIN)
