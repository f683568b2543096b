"""Partial NeoX rotary embedding (spec §4.1): only the first `rotary_dim` dims of each head rotate, half-split.

Text-only mRoPE (interleaved sections) collapses to plain 1-D RoPE because all three position rows are equal.
cos/sin are computed in fp32 and cast to the activation dtype before use, and the rotation runs in the activation
dtype, as the reference does. The fused attention kernel (layers/attention.py) reads the same cache and rounds the
same way; `apply_rope` (the torch path's rotation, a helper of qk_norm_rope_cache_torch) is its oracle.

The LLaMA-likes' RoPE scalings change only the frequencies (and, for yarn, scale cos/sin), so they are folded into
the same cache; `rope_frequencies` follows transformers' rope init functions step by step. `dynamic` (NTK) in
transformers re-derives the base from the longest position of each forward call, so a token's rotation would depend
on the batch it ran in; here the base is fixed for the longest position the cache holds (the runner's
max_model_len): exactly plain RoPE, as transformers has it, while max_model_len <= max_position_embeddings (the
engine's default limit), and transformers' value for one forward of max_model_len tokens beyond it.
"""
from __future__ import annotations

import math

import torch
from torch import nn


def rope_frequencies(rotary_dim: int, theta: float, scaling: dict | None = None,
                     max_positions: int | None = None) -> tuple[torch.Tensor, float]:
    """(inv_freq [rotary_dim / 2] fp32, attention factor that scales cos and sin) for plain RoPE (`scaling` None)
    or one of the scalings linear, dynamic, llama3, yarn (`scaling`: the config's rope parameters, with
    original_max_position_embeddings filled in; see qwen35/config.py)."""
    dim = rotary_dim
    exponents = torch.arange(0, dim, 2, dtype=torch.int64).float() / dim
    inv_freq = 1.0 / (theta ** exponents)
    if scaling is None:
        return inv_freq, 1.0
    kind = scaling["rope_type"]
    factor = scaling.get("factor")
    original = scaling["original_max_position_embeddings"]
    if kind == "linear":
        return inv_freq / factor, 1.0
    if kind == "dynamic":
        # transformers' forward-time update: seq_len a tensor, so the new base is computed in fp32
        seq_len = torch.tensor(max(max_positions or original, original))
        base = theta * ((factor * seq_len / original) - (factor - 1)) ** (dim / (dim - 2))
        return 1.0 / (base ** exponents), 1.0
    if kind == "llama3":
        low, high = scaling["low_freq_factor"], scaling["high_freq_factor"]
        low_wavelen, high_wavelen = original / low, original / high
        wavelen = 2 * math.pi / inv_freq
        scaled = torch.where(wavelen > low_wavelen, inv_freq / factor, inv_freq)
        smooth = (original / wavelen - low) / (high - low)
        smoothed = (1 - smooth) * scaled / factor + smooth * scaled
        medium = ~(wavelen < high_wavelen) * ~(wavelen > low_wavelen)
        return torch.where(medium, smoothed, scaled), 1.0
    if kind == "yarn":
        return _yarn(dim, theta, scaling, factor, original)
    raise ValueError(f"rope_type {kind!r} is not supported (linear, dynamic, llama3, yarn)")


def _yarn(dim: int, theta: float, scaling: dict, factor, original: int) -> tuple[torch.Tensor, float]:
    """YaRN (arXiv 2309.00071) as transformers computes it: frequencies blended between interpolated and
    extrapolated along a linear ramp over the dims, and an attention factor from `factor` (or mscale)."""
    def mscale_of(scale, mscale=1.0):
        return 1.0 if scale <= 1 else 0.1 * mscale * math.log(scale) + 1.0

    attention = scaling.get("attention_factor")
    if attention is None:
        mscale, mscale_all = scaling.get("mscale"), scaling.get("mscale_all_dim")
        attention = mscale_of(factor, mscale) / mscale_of(factor, mscale_all) if mscale and mscale_all \
            else mscale_of(factor)
    beta_fast, beta_slow = scaling.get("beta_fast") or 32, scaling.get("beta_slow") or 1

    def correction_dim(rotations):
        return dim * math.log(original / (rotations * 2 * math.pi)) / (2 * math.log(theta))

    low, high = correction_dim(beta_fast), correction_dim(beta_slow)
    if scaling.get("truncate", True):
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    if low == high:
        high += 0.001  # no zero-width ramp
    ramp = ((torch.arange(dim // 2, dtype=torch.float32) - low) / (high - low)).clamp(0, 1)
    pos_freqs = theta ** (torch.arange(0, dim, 2).float() / dim)
    extrapolation = 1 - ramp
    inv_freq = (1.0 / (factor * pos_freqs)) * (1 - extrapolation) + (1.0 / pos_freqs) * extrapolation
    return inv_freq, float(attention)


class RotaryEmbedding(nn.Module):
    """The cos/sin cache, shared by every attention layer: `cos`, `sin` [max_positions, rotary_dim] fp32."""

    def __init__(self, rotary_dim: int, theta: float, max_positions: int, device=None, scaling: dict | None = None):
        super().__init__()
        self.rotary_dim = rotary_dim
        inv_freq, attention = rope_frequencies(rotary_dim, theta, scaling, max_positions)
        t = torch.arange(max_positions, dtype=torch.float32)
        freqs = torch.outer(t, inv_freq)  # [P, rotary_dim/2]
        # cache cat(cos, cos) / cat(sin, sin) as in the reference: [P, rotary_dim]
        emb = torch.cat([freqs, freqs], -1)
        self.register_buffer("cos", (emb.cos() * attention).to(device), persistent=False)
        self.register_buffer("sin", (emb.sin() * attention).to(device), persistent=False)


def apply_rope(x: torch.Tensor, positions: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x [N, heads, D] rotated at `positions` [N]; cos/sin the [P, rotary_dim] fp32 cache. Returns a new tensor."""
    rd, half = cos.shape[-1], cos.shape[-1] // 2
    c = cos[positions].to(x.dtype).unsqueeze(1)
    s = sin[positions].to(x.dtype).unsqueeze(1)
    x_rot, x_pass = x[..., :rd], x[..., rd:]
    rotated = torch.cat([-x_rot[..., half:], x_rot[..., :half]], dim=-1)
    return torch.cat([x_rot * c + rotated * s, x_pass], dim=-1)
