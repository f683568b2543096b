"""Dense SwiGLU MLP: the feed-forward of the dense Qwen3.5 models and the MoE's shared expert.

TP split by the intermediate dimension: gate/up rows and down columns; the caller all-reduces the partial sums.
gate_proj and up_proj read the same input, so their local shards live in one [2 * I_local, hidden] tensor
(`gate_up`, rows gate then up: layers/linear.py fuse_rows) and one GEMM computes both. With `bias` (Llama's
mlp_bias) the biases are added in the GEMMs; down_proj's only on rank 0 (its partial sums are all-reduced).

    mlp_torch  GEMM, silu, mul, GEMM (the oracle; silu(gate) * up: layers/activation.py silu_mul_torch)
    mlp_fast   linear_fast twice: gate_up `gated` (silu(gate) * up folded into the decode kernels' epilogue, so at up
               to ROWS_MAX_M rows one launch gives the activation; past them the GEMM, then silu_mul_fast), then down
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from dist import parallel
from layers import backend
from layers.activation import silu_mul_torch
from layers.linear import Linear, even_split, fuse_rows, linear_fast


def mlp_torch(x: torch.Tensor, gate_up: torch.Tensor, down: torch.Tensor, gate_up_bias: torch.Tensor | None = None,
              down_bias: torch.Tensor | None = None, partial: bool = False) -> torch.Tensor:
    return F.linear(silu_mul_torch(F.linear(x, gate_up, gate_up_bias)), down, down_bias)


def mlp_fast(x: torch.Tensor, gate_up: torch.Tensor, down: torch.Tensor, gate_up_bias: torch.Tensor | None = None,
             down_bias: torch.Tensor | None = None, partial: bool = False):
    """partial: the output is a layer boundary's partial sums (linear_fast may push them: a Pushed)."""
    return linear_fast(linear_fast(x, gate_up, gate_up_bias, gated=True), down, down_bias, partial=partial)


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
