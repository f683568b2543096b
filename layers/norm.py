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

from layers import backend
from layers.backend import round_to, tl, triton
from layers.linear import make_param


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


def gated_rms_norm_torch(x: torch.Tensor, z: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    dtype = x.dtype
    x32 = x.float()
    y = (x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps)).to(dtype)
    y = weight.float() * y.float()  # weight kept fp32 (checkpoint dtype); HF rounds it to bf16 first
    return (y * F.silu(z.float())).to(dtype)


def rms_norm_fast(x: torch.Tensor, weight: torch.Tensor, eps: float, plain: bool = False) -> torch.Tensor:
    return _launch(x, None, weight, eps, plain)[0]


def add_rms_norm_fast(x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float,
                      plain: bool = False):
    return _launch(x, residual, weight, eps, plain)


def _launch(x, residual, weight, eps, plain):
    shape, n = x.shape, x.shape[-1]
    x2 = x.reshape(-1, n)
    if x2.stride(-1) != 1:
        x2 = x2.contiguous()
    out = torch.empty(x2.shape, dtype=x.dtype, device=x.device)
    res_in = res_out = out  # placeholders, never touched when HAS_RESIDUAL is False
    if residual is not None:
        res_in = residual.reshape(-1, n)
        res_out = torch.empty_like(out)
    rows = x2.shape[0]
    if rows:
        block = triton.next_power_of_2(n)
        _rms_norm_kernel[(rows,)](x2, res_in, res_out, weight, out, n, x2.stride(0), res_in.stride(0), eps,
                                  HAS_RESIDUAL=residual is not None, PLAIN=plain, BLOCK=block,
                                  num_warps=max(1, min(8, block // 256)))
    return out.view(shape), (res_out.view(shape) if residual is not None else None)


if triton is not None:
    @triton.jit
    def _rms_norm_kernel(x_ptr, res_ptr, res_out_ptr, w_ptr, out_ptr, n, sx, sr, eps,
                         HAS_RESIDUAL: tl.constexpr, PLAIN: tl.constexpr, BLOCK: tl.constexpr):
        """One row: s = x (+ residual, rounded to the model dtype, stored); out = s / rms(s) * (1 + w), or with
        PLAIN round(s / rms(s)) * w rounded (the oracle's two roundings in the model dtype)."""
        row = tl.program_id(0).to(tl.int64)
        cols = tl.arange(0, BLOCK)
        mask = cols < n
        s = tl.load(x_ptr + row * sx + cols, mask=mask, other=0.0)
        if HAS_RESIDUAL:
            r = tl.load(res_ptr + row * sr + cols, mask=mask, other=0.0)
            s = round_to(s.to(tl.float32) + r.to(tl.float32), r.dtype)  # the reference's add, rounded once
            tl.store(res_out_ptr + row * n + cols, s.to(r.dtype), mask=mask)
        s = s.to(tl.float32)
        inv = tl.rsqrt(tl.sum(s * s, 0) / n + eps)
        w = tl.load(w_ptr + cols, mask=mask, other=0.0).to(tl.float32)
        dt = out_ptr.dtype.element_ty
        if PLAIN:
            y = round_to(s * inv, dt) * w
        else:
            y = s * inv * (1.0 + w)
        tl.store(out_ptr + row * n + cols, y.to(dt), mask=mask)


class RMSNorm(nn.Module):
    """Zero-centred: y = x / rms(x) * (1 + w); or with plain=True (LLaMA-likes) y = x / rms(x) * w. Used for layer
    norms, the final norm and q/k norms.

    forward(x) -> y;  forward(x, residual) -> (norm(x + residual), x + residual)."""

    def __init__(self, dim: int, eps: float, dtype=None, device=None, plain: bool = False):
        super().__init__()
        self.eps = eps
        self.plain = plain
        self.weight = make_param((dim,), [None], dtype, device)  # replicated
        self.weight.data.fill_(1.0 if plain else 0.0)  # the identity either way
        fast = backend.use_fast()
        self._norm = rms_norm_fast if fast else rms_norm_torch
        self._add_norm = add_rms_norm_fast if fast else add_rms_norm_torch

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None = None):
        if residual is None:
            return self._norm(x, self.weight, self.eps, self.plain)
        return self._add_norm(x, residual, self.weight, self.eps, self.plain)


class GatedRMSNorm(nn.Module):
    """Not zero-centred: y = (x / rms(x)) * w * silu(z), per DeltaNet value head. Weight kept in fp32."""

    def __init__(self, dim: int, eps: float, device=None):
        super().__init__()
        self.eps = eps
        self.weight = make_param((dim,), [None], torch.float32, device)  # replicated
        self.weight.data.fill_(1.0)

    def forward(self, x: torch.Tensor, z: torch.Tensor) -> torch.Tensor:
        return gated_rms_norm_torch(x, z, self.weight, self.eps)
