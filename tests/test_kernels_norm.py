"""The norm kernels (layers/norm.py) against their torch oracles.

Fused residual add + RMSNorm: CPU through Triton's interpreter in fp32 (max |diff| <= 1e-5, the residual sum exact),
GPU in bf16 (the residual sum bit-exact, the normed output within one bf16 ulp: max |diff| <= 2^-7 relative to
|y| <= 8). Gated RMSNorm (DeltaNet output): CPU fp32 max |diff| <= 1e-5 on O(1..10) outputs, with z a strided view
as the layer passes it, head counts and head dims that are not powers of two; GPU bf16 at the real shapes: >= 99%
of elements bit-equal and max |diff| <= 2 bf16 ulps of the largest output (the normed x is rounded to bf16 inside,
and a flipped rounding moves the product by an ulp or two).
"""
import pytest
import torch
import torch.nn.functional as F

from layers.norm import (GatedRMSNorm, RMSNorm, add_rms_norm_fast, add_rms_norm_torch, gated_rms_norm_fast,
                         gated_rms_norm_torch, rms_norm_fast, rms_norm_torch)
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


@pytest.mark.parametrize("rows,N", [(1, 37), (2, 5), (2, 37)])
@pytest.mark.parametrize("residual,plain,bias", [(True, False, False), (False, False, True), (True, True, True)])
@pytest.mark.parametrize("gated", [False, True])
def test_norm_folded_into_the_gemv(rows, N, residual, plain, bias, gated):
    """RMSNorm.boundary at decode sizes with the fast kernels: a PendingNorm, computed by the GEMV that reads it
    (linear_fast) in its prologue at one row, and at two where the grid is small (5 columns: 5 programs; 37: 10,
    more than FOLD_MAX_PROGRAMS_PER_SM per SM of the 4 the CPU counts, so the norm kernel runs first): its output,
    the normed rows and the residual sum equal the norm kernel's followed by the GEMV (fp32 through the interpreter:
    the same arithmetic, so the same bits), and the norm is not run again when read after (linear.computed).
    gated: the dense MLP's gate_up (2N rows) and silu(gate) * up from the GEMV's epilogue, the same programs a column
    block (each its gate and up rows), so the same fold; its bits those of silu_mul_fast over the plain GEMV."""
    from layers import linear as lin
    from layers.activation import silu_mul_fast, silu_mul_torch

    x, r, w = case(rows, 96, torch.float32, "cpu", seed=rows)
    gen = torch.Generator().manual_seed(7)
    rows_w = 2 * N if gated else N
    weight, b = torch.randn(rows_w, 96, generator=gen) * 0.2, torch.randn(rows_w, generator=gen)
    b = b if bias else None
    with backend.use_kernels("fast"):
        m = RMSNorm(96, 1e-6, plain=plain)
    m.weight.data.copy_(w + 1 if plain else w)
    want_h, want_sum = (m(x), x) if not residual else m(x, r)
    pending, total = m.boundary(x, r if residual else None)
    assert isinstance(pending, lin.PendingNorm) and not pending.done
    launches, kernel = [], pending.compute
    pending.compute = lambda p: (launches.append(p), kernel(p))
    y = lin.linear_fast(pending, weight, b, gated=gated)
    assert y.shape == (rows, N) and pending.done and len(launches) == (rows == 2 and N == 37)
    assert torch.equal(pending.out, want_h) and torch.equal(total, want_sum)
    assert torch.equal(lin.computed(pending), want_h) and len(launches) <= 1
    act, act_fast = (silu_mul_torch, silu_mul_fast) if gated else (lambda h: h, lambda h: h)
    assert torch.equal(y, act_fast(lin.linear_fast(want_h, weight, b)))
    assert (y - act(F.linear(want_h, weight, b))).abs().max().item() <= 1e-4


def test_pending_norm_read_by_other_paths():
    """Past the GEMV's limits (more rows than it takes: then the rows kernel; a weight too wide for it: F.linear) or
    read by anything but linear_fast, the PendingNorm is computed by the norm kernel, once; past FOLD_MAX_M rows,
    with the torch kernels or at TP > 1 without an inbox, boundary() is all_reduce_add itself."""
    from layers import linear as lin

    x, r, w = case(2, 64, torch.float32, "cpu", seed=3)
    with backend.use_kernels("fast"):
        m = RMSNorm(64, 1e-6)
    m.weight.data.copy_(w)
    want_h, want_sum = m(x, r)
    pending, total = m.boundary(x, r)
    weight = torch.randn(5, 64)
    y = lin.linear_fast(pending, weight, gemv_rows=1)  # 2 rows > gemv_rows: the rows kernel over the computed norm
    assert pending.done and torch.equal(pending.out, want_h) and torch.equal(total, want_sum)
    assert torch.equal(y, lin.rows_gemm(want_h, weight))
    wide = torch.randn(5, lin.GEMV_MAX_K + 64)  # K past the GEMV's at its rows: F.linear over the computed norm
    xw, rw, ww = case(1, lin.GEMV_MAX_K + 64, torch.float32, "cpu", seed=6)
    with backend.use_kernels("fast"):
        mw = RMSNorm(lin.GEMV_MAX_K + 64, 1e-6)
    mw.weight.data.copy_(ww)
    pw, _ = mw.boundary(xw, rw)
    assert torch.equal(lin.linear_fast(pw, wide), F.linear(mw(xw, rw)[0], wide))
    x4, r4, _ = case(lin.FOLD_MAX_M + 1, 64, torch.float32, "cpu", seed=4)
    h4, s4 = m.boundary(x4, r4)
    assert isinstance(h4, torch.Tensor) and torch.equal(h4, m(x4, r4)[0]) and torch.equal(s4, x4 + r4)
    x8, r8, _ = case(8, 64, torch.float32, "cpu", seed=5)  # up to FOLD_MAX_M rows a PendingNorm, computed by the
    pending8, s8 = m.boundary(x8, r8)                       # norm kernel for a GEMV that cannot fold it
    assert isinstance(pending8, lin.PendingNorm)
    assert torch.equal(lin.linear_fast(pending8, weight), lin.rows_gemm(m(x8, r8)[0], weight))
    assert torch.equal(pending8.out, m(x8, r8)[0]) and torch.equal(s8, x8 + r8)
    with backend.use_kernels("torch"):
        t = RMSNorm(64, 1e-6)
    t.weight.data.copy_(w)
    assert isinstance(t.boundary(x, r)[0], torch.Tensor)


def gated_case(T, H, D, dtype, device, seed=0):
    """x [T, H, D] (scaled so that the norm matters), z a strided [T, H, D] view of a wider row, fp32 weight."""
    gen = torch.Generator().manual_seed(seed)
    x = (torch.randn(T, H, D, generator=gen) * 3).to(dtype).to(device)
    z = (torch.randn(T, H * D + 7, generator=gen) * 2).to(dtype).to(device)[:, 5:5 + H * D].unflatten(-1, (H, D))
    w = (torch.rand(D, generator=gen) + 0.5).to(device)
    return x, z, w


@pytest.mark.parametrize("T,H,D", [(1, 1, 16), (5, 3, 24), (9, 32, 16), (4, 2, 128)])
def test_gated_rms_norm_fast_equals_torch(T, H, D):
    x, z, w = gated_case(T, H, D, torch.float32, "cpu", seed=T + H + D)
    want = gated_rms_norm_torch(x, z, w, 1e-6)
    got = gated_rms_norm_fast(x, z, w, 1e-6)
    assert got.shape == want.shape == (T, H, D) and got.dtype == want.dtype
    assert want.abs().max() > 0.5
    assert (got - want).abs().max().item() <= 1e-5


def test_gated_module_binds_the_kernel_set():
    x, z, w = gated_case(3, 2, 16, torch.float32, "cpu")
    for kernels, fn in (("torch", gated_rms_norm_torch), ("fast", gated_rms_norm_fast)):
        with backend.use_kernels(kernels):
            m = GatedRMSNorm(16, 1e-6)
        m.weight.data.copy_(w)
        assert m._norm is fn
        assert (m(x, z) - gated_rms_norm_torch(x, z, w, 1e-6)).abs().max().item() <= 1e-5


@pytest.mark.gpu
@pytest.mark.parametrize("T,H", [(1, 32), (8192, 32), (1000, 4)])  # TP=1 and TP=8 local value heads
def test_gpu_gated_rms_norm_bf16(T, H):
    x, z, w = gated_case(T, H, 128, torch.bfloat16, "cuda", seed=T)
    want = gated_rms_norm_torch(x, z, w, 1e-6)
    got = gated_rms_norm_fast(x, z, w, 1e-6)
    assert (got == want).float().mean().item() >= 0.99
    assert (got.float() - want.float()).abs().max().item() <= 2 * 2 ** -8 * want.float().abs().max().item()


@pytest.mark.gpu
@pytest.mark.parametrize("rows", [1, 64, 8192])
def test_gpu_add_rms_norm_bf16(rows):
    x, r, w = case(rows, 2048, torch.bfloat16, "cuda", seed=rows)
    y0, s0 = add_rms_norm_torch(x, r, w, 1e-6)
    y1, s1 = add_rms_norm_fast(x, r, w, 1e-6)
    assert torch.equal(s0, s1)
    assert (y0.float() - y1.float()).abs().max().item() <= 2 ** -7 * 8
    assert (y0 == y1).float().mean().item() >= 0.99


@pytest.mark.gpu
@pytest.mark.parametrize("rows", [1, 2])
@pytest.mark.parametrize("N", [257, 12352])  # the router | shared gate, the DeltaNet input projection (TP=1)
def test_gpu_norm_folded_into_the_gemv_bf16(rows, N):
    """bf16 at the real hidden size: the residual sum the GEMV stores bit-exact; the normed rows within one bf16 ulp
    of the norm kernel's, >= 99% bit-equal (the fp32 sum of squares may be summed in another order); the GEMV's
    output within 2^-6 relative to its scale of F.linear over the norm kernel's rows."""
    from layers import linear as lin

    x, r, w = case(rows, 2048, torch.bfloat16, "cuda", seed=rows)
    with backend.use_kernels("fast"):
        m = RMSNorm(2048, 1e-6, dtype=torch.bfloat16, device="cuda")
    m.weight.data.copy_(w)
    want_h, want_sum = m(x, r)
    weight = torch.randn(N, 2048, device="cuda", dtype=torch.bfloat16) * 0.05
    pending, total = m.boundary(x, r)
    assert isinstance(pending, lin.PendingNorm)
    y = lin.linear_fast(pending, weight)
    assert pending.done and torch.equal(total, want_sum)
    assert (pending.out.float() - want_h.float()).abs().max().item() <= 2 ** -7 * 8
    assert (pending.out == want_h).float().mean().item() >= 0.99
    ref = F.linear(want_h, weight).float()
    assert (y.float() - ref).abs().max().item() <= 2 ** -6 * ref.abs().max().item()
