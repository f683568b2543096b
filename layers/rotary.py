"""Partial NeoX rotary embedding (spec §4.1): only the first `rotary_dim` dims of each head rotate, half-split.

Text-only mRoPE (interleaved sections) collapses to plain 1-D RoPE because all three position rows are equal.
cos/sin are computed in fp32 and cast to the activation dtype before use, and the rotation runs in the activation
dtype, as the reference does. The fused attention kernel (layers/attention.py) reads the same cache and rounds the
same way; `rope_torch` is its oracle.
"""
import torch
from torch import nn


class RotaryEmbedding(nn.Module):
    """The cos/sin cache, shared by every attention layer: `cos`, `sin` [max_positions, rotary_dim] fp32."""

    def __init__(self, rotary_dim: int, theta: float, max_positions: int, device=None):
        super().__init__()
        self.rotary_dim = rotary_dim
        inv_freq = 1.0 / (theta ** (torch.arange(0, rotary_dim, 2, dtype=torch.float32) / rotary_dim))
        t = torch.arange(max_positions, dtype=torch.float32)
        freqs = torch.outer(t, inv_freq)  # [P, rotary_dim/2]
        # cache cat(cos, cos) / cat(sin, sin) as in the reference: [P, rotary_dim]
        self.register_buffer("cos", torch.cat([freqs.cos(), freqs.cos()], -1).to(device), persistent=False)
        self.register_buffer("sin", torch.cat([freqs.sin(), freqs.sin()], -1).to(device), persistent=False)


def rope_torch(x: torch.Tensor, positions: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x [N, heads, D] rotated at `positions` [N]; cos/sin the [P, rotary_dim] fp32 cache. Returns a new tensor."""
    rd, half = cos.shape[-1], cos.shape[-1] // 2
    c = cos[positions].to(x.dtype).unsqueeze(1)
    s = sin[positions].to(x.dtype).unsqueeze(1)
    x_rot, x_pass = x[..., :rd], x[..., rd:]
    rotated = torch.cat([-x_rot[..., half:], x_rot[..., :half]], dim=-1)
    return torch.cat([x_rot * c + rotated * s, x_pass], dim=-1)
