"""Partial NeoX rotary embedding (spec §4.1): only the first `rotary_dim` dims of each head rotate, half-split.

Text-only mRoPE (interleaved sections) collapses to plain 1-D RoPE because all three position rows are equal.
cos/sin are computed in fp32 and cast to the activation dtype before use, as the reference does.
"""
import torch
from torch import nn


class RotaryEmbedding(nn.Module):
    def __init__(self, rotary_dim: int, theta: float, max_positions: int, device=None):
        super().__init__()
        self.rotary_dim = rotary_dim
        inv_freq = 1.0 / (theta ** (torch.arange(0, rotary_dim, 2, dtype=torch.float32) / rotary_dim))
        t = torch.arange(max_positions, dtype=torch.float32)
        freqs = torch.outer(t, inv_freq)  # [P, rotary_dim/2]
        # cache cat(cos, cos) / cat(sin, sin) as in the reference: [P, rotary_dim]
        self.register_buffer("cos", torch.cat([freqs.cos(), freqs.cos()], -1).to(device), persistent=False)
        self.register_buffer("sin", torch.cat([freqs.sin(), freqs.sin()], -1).to(device), persistent=False)

    def forward(self, positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor):
        """q: [N, Hq, D], k: [N, Hk, D]; returns rotated copies."""
        cos = self.cos[positions].to(q.dtype).unsqueeze(1)
        sin = self.sin[positions].to(q.dtype).unsqueeze(1)
        return _rotate(q, cos, sin, self.rotary_dim), _rotate(k, cos, sin, self.rotary_dim)


def _rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, rd: int) -> torch.Tensor:
    x_rot, x_pass = x[..., :rd], x[..., rd:]
    half = rd // 2
    rotated = torch.cat([-x_rot[..., half:], x_rot[..., :half]], dim=-1)
    return torch.cat([x_rot * cos + rotated * sin, x_pass], dim=-1)
