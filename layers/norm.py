"""RMSNorm variants of Qwen3.5 (spec §2.1): the zero-centred one (weight stored as a delta around 1) and the gated
one of the DeltaNet output (weight used directly, then multiplied by silu(z))."""
import torch
import torch.nn.functional as F
from torch import nn

from layers.linear import make_param


def rms_norm_ref(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    x32 = x.float()
    y = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps)
    return (y * (1.0 + weight.float())).to(x.dtype)  # multiply in fp32, then cast (unlike Llama)


def gated_rms_norm_ref(x: torch.Tensor, z: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    dtype = x.dtype
    x32 = x.float()
    y = (x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps)).to(dtype)
    y = weight.float() * y.float()  # weight kept fp32 (checkpoint dtype); HF rounds it to bf16 first
    return (y * F.silu(z.float())).to(dtype)


class RMSNorm(nn.Module):
    """Zero-centred: y = x / rms(x) * (1 + w). Used for layer norms, the final norm and q/k norms."""

    def __init__(self, dim: int, eps: float, dtype=None, device=None):
        super().__init__()
        self.eps = eps
        self.weight = make_param((dim,), [None], dtype, device)  # replicated
        self.weight.data.zero_()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return rms_norm_ref(x, self.weight, self.eps)


class GatedRMSNorm(nn.Module):
    """Not zero-centred: y = (x / rms(x)) * w * silu(z), per DeltaNet value head. Weight kept in fp32."""

    def __init__(self, dim: int, eps: float, device=None):
        super().__init__()
        self.eps = eps
        self.weight = make_param((dim,), [None], torch.float32, device)  # replicated
        self.weight.data.fill_(1.0)

    def forward(self, x: torch.Tensor, z: torch.Tensor) -> torch.Tensor:
        return gated_rms_norm_ref(x, z, self.weight, self.eps)
