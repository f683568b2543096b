"""SwiGLU's activation, silu(gate) * up, rounded to the model dtype where the torch path rounds: after the GEMM that
gives gate and up, after silu, after the mul. Its own module so that the GEMM kernels (layers/linear.py, which
layers/mlp.py imports) can take it into their epilogue as the MoE kernels do.

    silu_mul_torch / silu_mul_fast  silu(gate half) * up half of a [..., 2I] GEMM output (silu_mul_fast: the dense
                                    MLP past the decode kernels' rows, linear_fast gated)
    silu_mul_sums                   the same in a Triton kernel's epilogue, from fp32 GEMM sums (the dense MLP's GEMV
                                    and rows kernel, the MoE kernels); the one statement of the rounding rule
                                    (silu_mul_fast's kernel calls it too)
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from layers.backend import pdl, prior_done, round_to, tl, triton


def silu_mul_torch(h: torch.Tensor) -> torch.Tensor:
    """silu(h[..., :I]) * h[..., I:] in h's dtype (torch rounds after silu and after the mul)."""
    gate, up = h.chunk(2, dim=-1)
    return F.silu(gate) * up


def silu_mul_fast(h: torch.Tensor) -> torch.Tensor:
    """silu(h[..., :I]) * h[..., I:], rounded to h's dtype where the torch path rounds (after silu, after the mul)."""
    inter = h.shape[-1] // 2
    h2 = h.reshape(-1, 2 * inter)
    out = torch.empty(h2.shape[0], inter, dtype=h.dtype, device=h.device)
    if h2.shape[0]:
        block = min(1024, triton.next_power_of_2(inter))
        _silu_mul_kernel[(h2.shape[0], triton.cdiv(inter, block))](h2, out, inter, h2.stride(0), BLOCK=block, **pdl())
    return out.view(*h.shape[:-1], inter)


if triton is not None:
    @triton.jit
    def silu_mul_sums(acc_g, acc_u, DTYPE: tl.constexpr):
        """silu(gate) * up in DTYPE from fp32 sums, rounded where the oracle rounds: the GEMM outputs, silu, the
        product."""
        g = round_to(acc_g, DTYPE)
        s = round_to(g * tl.sigmoid(g), DTYPE)
        return (s * round_to(acc_u, DTYPE)).to(DTYPE)

    @triton.jit
    def _silu_mul_kernel(h_ptr, out_ptr, inter, sh, BLOCK: tl.constexpr):
        prior_done()  # (backend.pdl: the kernels before this one have finished)
        row = tl.program_id(0).to(tl.int64)
        cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
        mask = cols < inter
        g = tl.load(h_ptr + row * sh + cols, mask=mask, other=0.0).to(tl.float32)
        u = tl.load(h_ptr + row * sh + inter + cols, mask=mask, other=0.0).to(tl.float32)
        # (g and u hold GEMM outputs already in the model dtype: silu_mul_sums' first roundings leave them as they are)
        tl.store(out_ptr + row * inter + cols, silu_mul_sums(g, u, out_ptr.dtype.element_ty), mask=mask)
else:  # pragma: no cover
    silu_mul_sums = None
