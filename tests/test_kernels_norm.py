"""The fused residual add + RMSNorm kernel (layers/norm.py) against its torch oracle: CPU through Triton's
interpreter in fp32 (max |diff| <= 1e-5, the residual sum exact), GPU in bf16 (the residual sum bit-exact, the
normed output within one bf16 ulp: max |diff| <= 2^-7 relative to |y| <= 8)."""
import pytest
import torch

from layers.norm import RMSNorm, add_rms_norm_fast, add_rms_norm_torch, rms_norm_fast, rms_norm_torch
from layers import backend


def case(rows, n, dtype, device, seed=0):
    gen = torch.Generator().manual_seed(seed)
    x, r = (torch.randn(rows, n, generator=gen).to(dtype).to(device) for _ in range(2))
    w = (torch.randn(n, generator=gen) * 0.2).to(dtype).to(device)
    return x, r, w


@pytest.mark.parametrize("rows,n", [(1, 64), (5, 48), (3, 2048)])
def test_add_rms_norm_fast_equals_torch(rows, n):
    x, r, w = case(rows, n, torch.float32, "cpu", seed=n)
    y0, s0 = add_rms_norm_torch(x, r, w, 1e-6)
    y1, s1 = add_rms_norm_fast(x, r, w, 1e-6)
    assert torch.equal(s0, s1)
    assert (y0 - y1).abs().max().item() <= 1e-5
    assert (rms_norm_torch(x, w, 1e-6) - rms_norm_fast(x, w, 1e-6)).abs().max().item() <= 1e-5


def test_norm_of_heads_and_strided_rows():
    """q/k-norm shapes [T, heads, D] and a strided row view."""
    gen = torch.Generator().manual_seed(1)
    x = torch.randn(4, 3, 2 * 32, generator=gen)[..., :32]
    w = torch.randn(32, generator=gen) * 0.2
    assert (rms_norm_torch(x, w, 1e-6) - rms_norm_fast(x, w, 1e-6)).abs().max().item() <= 1e-5


def test_module_binds_the_kernel_set():
    x, r, w = case(2, 16, torch.float32, "cpu")
    for kernels in ("torch", "fast"):
        with backend.use_kernels(kernels):
            m = RMSNorm(16, 1e-6)
        m.weight.data.copy_(w)
        y, s = m(x, r)
        assert torch.equal(s, x + r)
        assert (y - add_rms_norm_torch(x, r, w, 1e-6)[0]).abs().max().item() <= 1e-5


@pytest.mark.gpu
@pytest.mark.parametrize("rows", [1, 64, 8192])
def test_gpu_add_rms_norm_bf16(rows):
    x, r, w = case(rows, 2048, torch.bfloat16, "cuda", seed=rows)
    y0, s0 = add_rms_norm_torch(x, r, w, 1e-6)
    y1, s1 = add_rms_norm_fast(x, r, w, 1e-6)
    assert torch.equal(s0, s1)
    assert (y0.float() - y1.float()).abs().max().item() <= 2 ** -7 * 8
    assert (y0 == y1).float().mean().item() >= 0.99
