"""Dense SwiGLU MLP: the feed-forward of the dense Qwen3.5 models and the MoE's shared expert.

TP split by the intermediate dimension: gate/up rows and down columns; the caller all-reduces the partial sums.
"""
import torch
import torch.nn.functional as F
from torch import nn

from dist import parallel
from layers.linear import Linear, even_split


class MLP(nn.Module):
    def __init__(self, hidden: int, intermediate: int, dtype=None, device=None):
        super().__init__()
        start, size = even_split(intermediate, parallel.tp_rank(), parallel.tp_size())
        self.gate_proj = Linear(hidden, intermediate, rows=[(start, size)], dtype=dtype, device=device)
        self.up_proj = Linear(hidden, intermediate, rows=[(start, size)], dtype=dtype, device=device)
        self.down_proj = Linear(intermediate, hidden, cols=[(start, size)], dtype=dtype, device=device)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))
