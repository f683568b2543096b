"""Dense SwiGLU MLP: the feed-forward of the dense Qwen3.5 models and the MoE's shared expert.

TP split by the intermediate dimension: gate/up rows and down columns; the caller all-reduces the partial sums.
gate_proj and up_proj read the same input, so their local shards live in one [2 * I_local, hidden] tensor
(`gate_up`, rows gate then up: layers/linear.py fuse_rows) and one GEMM computes both. With `bias` (Llama's
mlp_bias) the biases are added in the GEMMs; down_proj's only on rank 0 (its partial sums are all-reduced).

    mlp_torch  GEMM, silu, mul, GEMM (the oracle)
    mlp_fast   GEMM, one Triton kernel for silu(gate) * up, GEMM (the GEMMs: linear_fast, a GEMV at decode sizes)

    silu_mul_torch / silu_mul_fast  silu(gate half) * up half, rounded to the model dtype after silu and after the mul
    silu_mul_sums                   the same in a Triton kernel's epilogue, from fp32 GEMM sums (the MoE kernels)
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from dist import parallel
from layers import backend
from layers.backend import pdl, prior_done, round_to, tl, triton
from layers.linear import Linear, even_split, fuse_rows, linear_fast


def mlp_torch(x: torch.Tensor, gate_up: torch.Tensor, down: torch.Tensor, gate_up_bias: torch.Tensor | None = None,
              down_bias: torch.Tensor | None = None, partial: bool = False) -> torch.Tensor:
    return F.linear(silu_mul_torch(F.linear(x, gate_up, gate_up_bias)), down, down_bias)


def mlp_fast(x: torch.Tensor, gate_up: torch.Tensor, down: torch.Tensor, gate_up_bias: torch.Tensor | None = None,
             down_bias: torch.Tensor | None = None, partial: bool = False):
    """partial: the output is a layer boundary's partial sums (linear_fast may push them: a Pushed)."""
    return linear_fast(silu_mul_fast(linear_fast(x, gate_up, gate_up_bias)), down, down_bias, partial=partial)


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
    def _silu_mul_kernel(h_ptr, out_ptr, inter, sh, BLOCK: tl.constexpr):
        prior_done()  # (backend.pdl: the kernels before this one have finished)
        row = tl.program_id(0).to(tl.int64)
        cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
        mask = cols < inter
        g = tl.load(h_ptr + row * sh + cols, mask=mask, other=0.0).to(tl.float32)
        u = tl.load(h_ptr + row * sh + inter + cols, mask=mask, other=0.0).to(tl.float32)
        dt = out_ptr.dtype.element_ty
        s = round_to(g * tl.sigmoid(g), dt)
        tl.store(out_ptr + row * inter + cols, (s * u).to(dt), mask=mask)

    @triton.jit
    def silu_mul_sums(acc_g, acc_u, DTYPE: tl.constexpr):
        """silu(gate) * up in DTYPE from fp32 sums, rounded where the oracle rounds: the GEMM outputs, silu, the
        product."""
        g = round_to(acc_g, DTYPE)
        s = round_to(g * tl.sigmoid(g), DTYPE)
        return (s * round_to(acc_u, DTYPE)).to(DTYPE)
else:  # pragma: no cover
    silu_mul_sums = None


class MLP(nn.Module):
    """sync_free: no implementation needs the host (CUDA graphs may capture it)."""
    sync_free = True

    def __init__(self, hidden: int, intermediate: int, dtype=None, device=None, bias: bool = False):
        super().__init__()
        start, size = even_split(intermediate, parallel.tp_rank(), parallel.tp_size())
        kw = dict(bias=bias, dtype=dtype, device=device)
        self.gate_proj = Linear(hidden, intermediate, rows=[(start, size)], **kw)
        self.up_proj = Linear(hidden, intermediate, rows=[(start, size)], **kw)
        self.down_proj = Linear(intermediate, hidden, cols=[(start, size)], **kw)
        self.gate_up = fuse_rows(self.gate_proj, self.up_proj)  # [2 * size, hidden]; the loader fills the views
        self.gate_up_bias = fuse_rows(self.gate_proj, self.up_proj, attr="bias") if bias else None
        self._mlp = mlp_fast if backend.use_fast() else mlp_torch

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        down_bias = self.down_proj.bias if self.down_proj.adds_bias else None
        return self._mlp(x, self.gate_up, self.down_proj.weight, self.gate_up_bias, down_bias, partial=True)
