"""The decode GEMMs of layers/linear.py against F.linear (linear_torch): the GEMV kernel (linear_fast, every projection
at up to GEMV_MAX_M rows), the rows kernel (rows_gemm, linear_fast's from there up to ROWS_MAX_M) and the skinny
split-K GEMM (skinny_gemm, the MoE router's up to SKINNY_MAX_M).

CPU (fp32, Triton through the interpreter): the GEMV at M = 1..4 rows (a row tile with rows past M), N
that no column block divides, K not a power of two, a bias, 3-D and strided inputs; the skinny GEMM at M = 1..5,
16, 17, 40 and 64 rows, partial output and reduction tiles, several K steps, split K: equal to F.linear within 1e-5
relative to the output's scale (fp32, only the order of the sums differs); the rows kernel at 3-16 rows likewise
(several and partial K steps, partial column blocks, a bias, each block_n), and linear_fast taking it there but not
past ROWS_MAX_M rows or ROWS_MAX_BYTES; past their row limits, the bits of F.linear itself. Gated (the dense MLP's
gate_up, silu(gate) * up in the epilogue of the GEMV and of the rows kernel), fp32 and fp16 (bf16 within two ulps:
the interpreter truncates its casts): the bits of silu_mul_fast over the plain kernel's output where the kernel's
tiles are the same, within the tolerance of silu_mul_torch over F.linear everywhere.
GPU (`-m gpu`, bf16, the real Qwen3.5-35B-A3B router, input and out projections at the TP=1 and TP=8 shards): the
kernels accumulate in fp32 and round once to bf16, so every element is within half a bf16 ulp of the exact product of
the bf16 inputs (fp64) and 99% are that product rounded to bf16; 99% are bit-identical to F.linear's where F.linear
rounds correctly too. The gated GEMV at the Llama-1B / 3B MLP shapes: the bits of silu_mul_fast over the plain GEMV.
"""
import pytest
import torch
import torch.nn.functional as F

from layers import backend
from layers import linear as lin
from layers.activation import silu_mul_fast, silu_mul_torch
from layers.backend import triton
from tests.compare import rel

pytestmark = pytest.mark.skipif(triton is None, reason="needs triton")


def scaled_err(y, ref) -> float:
    return ((y.float() - ref.float()).abs().max() / ref.float().abs().max()).item()


@pytest.mark.parametrize("M", [1, 2, 3, 4, 5, 16, 17, 40, 64])  # row tiles of 16, 32 and 64
def test_skinny_equals_f_linear(M, monkeypatch):
    monkeypatch.setitem(lin.SKINNY_CONFIG, "block_k", 32)  # 300 = 9 full steps + a partial one
    gen = torch.Generator().manual_seed(M)
    x, w = torch.randn(M, 300, generator=gen), torch.randn(37, 300, generator=gen)
    y, ref = lin.skinny_gemm(x, w), F.linear(x, w)
    assert y.shape == ref.shape and y.dtype == ref.dtype
    assert scaled_err(y, ref) <= 1e-5


@pytest.mark.parametrize("block_n,block_k", [(16, 16), (32, 64), (64, 512)])
def test_skinny_block_settings(block_n, block_k, monkeypatch):
    monkeypatch.setitem(lin.SKINNY_CONFIG, "block_n", block_n)
    monkeypatch.setitem(lin.SKINNY_CONFIG, "block_k", block_k)
    gen = torch.Generator().manual_seed(block_n)
    x, w = torch.randn(3, 200, generator=gen), torch.randn(70, 200, generator=gen)
    assert scaled_err(lin.skinny_gemm(x, w), F.linear(x, w)) <= 1e-5


@pytest.mark.parametrize("split", [1, 2, 3, 4, 16])
def test_skinny_split_k(split, monkeypatch):
    """K summed in `split` shares (the last program to arrive adds the partials in share order): equal to F.linear
    within the tolerance, the same bits from run to run, and the arrival counters back at zero after each call (a
    CUDA graph replays the kernel with no reset in between). A split of 3 leaves the last share short, 16 is more
    than the 10 K steps (clamped)."""
    monkeypatch.setitem(lin.SKINNY_CONFIG, "block_k", 32)  # 300 = 9 full steps + a partial one
    monkeypatch.setitem(lin.SKINNY_CONFIG, "split", split)
    gen = torch.Generator().manual_seed(split)
    x, w = torch.randn(5, 300, generator=gen), torch.randn(37, 300, generator=gen)
    y = lin.skinny_gemm(x, w)
    assert scaled_err(y, F.linear(x, w)) <= 1e-5
    assert torch.equal(lin.skinny_gemm(x, w), y)
    used = min(split, 10)
    assert lin._split_k(3, 300, 32, x.device) == used
    if used > 1:
        assert not lin._split_scratch(x.device, used, lin.SKINNY_MAX_M, 48)[1].any()


def test_split_k_from_shape(monkeypatch):
    """split 0: the largest power of two with at most two programs per SM, within K's steps."""
    monkeypatch.setattr(lin.backend, "sm_count", lambda device: 132)
    assert lin._split_k(128, 4096, 256, torch.device("cpu")) == 2    # an out projection's 2,048 columns
    assert lin._split_k(17, 2048, 256, torch.device("cpu")) == 8     # the router's 257
    assert lin._split_k(17, 512, 256, torch.device("cpu")) == 2      # no more shares than K steps
    assert lin._split_k(800, 2048, 256, torch.device("cpu")) == 1


@pytest.mark.parametrize("M", [1, 2, 3, 4])
@pytest.mark.parametrize("N,K", [(37, 300), (8, 32), (5, 1000), (70, 64)])
def test_gemv_equals_f_linear(M, N, K):
    """Row tiles of 1, 2 and 4 (3 rows: one past M), column blocks of 1..16 (37 and 5 columns: a partial block), K
    padded to a power of two, with and without a bias."""
    gen = torch.Generator().manual_seed(M * 1000 + N)
    x, w, b = torch.randn(M, K, generator=gen), torch.randn(N, K, generator=gen), torch.randn(N, generator=gen)
    y, ref = lin.linear_fast(x, w, gemv_rows=4), F.linear(x, w)
    assert y.shape == ref.shape and y.dtype == ref.dtype
    assert scaled_err(y, ref) <= 1e-5
    assert scaled_err(lin.linear_fast(x, w, b, gemv_rows=4), F.linear(x, w, b)) <= 1e-5


@pytest.mark.parametrize("M", [1, 3, 8, 16])
@pytest.mark.parametrize("N,K", [(37, 300), (257, 64)])
def test_gemv_row_grid_equals_f_linear(M, N, K):
    """The GEMV's row grid (a program per column block and row: the MoE router's from 3 tokens), with and without a
    bias: within 1e-5 of F.linear, and the same bits as the GEMV over each row alone (the same sums per row)."""
    gen = torch.Generator().manual_seed(M * 7 + N)
    x, w, b = torch.randn(M, K, generator=gen), torch.randn(N, K, generator=gen), torch.randn(N, generator=gen)
    y = lin.linear_fast(x, w, b, gemv_rows=16, rows_in_grid=True)
    assert y.shape == (M, N) and scaled_err(y, F.linear(x, w, b)) <= 1e-5
    assert torch.equal(y, torch.cat([lin.linear_fast(x[i:i + 1], w, b) for i in range(M)]))


@pytest.mark.parametrize("tile,warps", [(512, 1), (2048, 1), (4096, 2), (16384, 4)])
def test_gemv_tile_settings(tile, warps, monkeypatch):
    """Each tile, gated too (half the columns a program, their gate and up rows; at a tile under K's one column,
    two rows)."""
    monkeypatch.setitem(lin.GEMV_CONFIG, "tile_1", tile)
    monkeypatch.setitem(lin.GEMV_CONFIG, "tile", tile)
    monkeypatch.setitem(lin.GEMV_CONFIG, "warps", warps)
    gen = torch.Generator().manual_seed(tile)
    w = torch.randn(70, 1000, generator=gen)
    for x in (torch.randn(1, 1000, generator=gen), torch.randn(2, 1000, generator=gen)):
        assert scaled_err(lin.linear_fast(x, w), F.linear(x, w)) <= 1e-5
        assert torch.equal(lin.linear_fast(x, w, gated=True), silu_mul_fast(lin.linear_fast(x, w)))


def test_gemv_block_n_from_shape(monkeypatch):
    """The most columns whose weights fit the tile, halved until the grid has two programs per SM (on a GPU: the
    rule takes the device only to count SMs and to tell the CPU apart, so no GPU is needed here)."""
    monkeypatch.setattr(lin.backend, "sm_count", lambda device: 132)
    gpu = torch.device("cuda")
    assert lin.gemv_block_n(12352, 2048, 8192, gpu) == 4   # the DeltaNet in-projection: 3,088 programs
    assert lin.gemv_block_n(12352, 2048, 2048, gpu) == 1   # at one row's tile: 12,352
    assert lin.gemv_block_n(2048, 4096, 8192, gpu) == 2    # an out projection: 1,024
    assert lin.gemv_block_n(257, 2048, 8192, gpu) == 1     # the router: 257
    assert lin.gemv_block_n(2048, 16384, 8192, gpu) == 1   # K past the tile: one row a program
    assert lin.gemv_block_n(257, 2048, 16384, gpu, rows=8) == 8  # the router's row grid at 8 rows: 264 programs
    assert lin.gemv_block_n(257, 2048, 16384, gpu, rows=2) == 1  # at 2 rows: 514 (2 columns: 258, too few)


def test_gemv_block_n_on_the_cpu_takes_few_programs():
    """Through the interpreter a vocabulary's columns go in at most CPU_MAX_PROGRAMS programs (up to CPU_MAX_TILE
    elements each); shapes of up to that many blocks keep the GPU's tiling."""
    cpu = torch.device("cpu")
    assert lin.gemv_block_n(248320, 64, 2048, cpu) == lin.CPU_MAX_TILE // 64  # the tiny model's LM head
    assert lin.gemv_block_n(70, 1000, 2048, cpu) == 2                         # 35 programs, as on a GPU
    assert lin.gemv_block_n(12352, 2048, 8192, cpu) == 128                     # 3,088 -> 97 programs (the tile)
    assert lin.gemv_block_n(1 << 20, 1 << 14, 8192, cpu) == 16                 # the tile's bound


def test_gemv_3d_strided_and_past_its_limits():
    gen = torch.Generator().manual_seed(3)
    w = torch.randn(24, 40, generator=gen)
    x3 = torch.randn(1, 3, 40, generator=gen)
    assert scaled_err(lin.linear_fast(x3, w), F.linear(x3, w)) <= 1e-5
    x_t = torch.randn(40, 2, generator=gen).t()      # features strided: copied once
    assert scaled_err(lin.linear_fast(x_t, w), F.linear(x_t, w)) <= 1e-5
    rows = torch.randn(60, 40, generator=gen)[10:34]  # a row block of a bigger weight (fuse_rows views)
    assert scaled_err(lin.linear_fast(x3, rows), F.linear(x3, rows)) <= 1e-5
    many = torch.randn(lin.ROWS_MAX_M + 1, 40, generator=gen)
    assert torch.equal(lin.linear_fast(many, w), F.linear(many, w))
    assert lin.linear_fast(torch.zeros(0, 40), w).shape == (0, 24)
    with pytest.raises(ValueError, match="features"):
        lin.linear_fast(torch.zeros(2, 31), w)


@pytest.mark.parametrize("M", [3, 5, 8, 16])
@pytest.mark.parametrize("N,K,bias", [(37, 300, False), (70, 64, True), (16, 1000, True)])
def test_rows_kernel_equals_f_linear(M, N, K, bias, monkeypatch):
    """K in 128-wide steps (300: two and a partial one; 64: one partial), column blocks of 16 with a partial one,
    a bias; linear_fast takes the rows kernel from GEMV_MAX_M + 1 rows (the same bits as rows_gemm)."""
    monkeypatch.setitem(lin.ROWS_CONFIG, "block_k", 128)
    gen = torch.Generator().manual_seed(M * N)
    x, w = torch.randn(M, K, generator=gen), torch.randn(N, K, generator=gen)
    b = torch.randn(N, generator=gen) if bias else None
    y = lin.rows_gemm(x, w, b)
    assert y.shape == (M, N) and scaled_err(y, F.linear(x, w, b)) <= 1e-5
    assert torch.equal(lin.linear_fast(x, w, b), y)


@pytest.mark.parametrize("block_n,block_k,stages", [(16, 512, 4), (32, 64, 2), (64, 256, 3)])
def test_rows_kernel_block_settings(block_n, block_k, stages, monkeypatch):
    """Each tile, gated too: half the columns a program, their gate and up rows, at least 16 columns; where those
    are the plain kernel's 16 (the same tl.dot tiles, so the same sums) the bits of silu_mul_fast over it, else
    within fp32 tolerance (the sums may be ordered by the tile's shape: whether they are depends on the
    interpreter's matmul, so the bits are promised only for the same tiles)."""
    monkeypatch.setitem(lin.ROWS_CONFIG, "block_n", block_n)
    monkeypatch.setitem(lin.ROWS_CONFIG, "block_k", block_k)
    monkeypatch.setitem(lin.ROWS_CONFIG, "stages", stages)
    gen = torch.Generator().manual_seed(block_n)
    x, w = torch.randn(2, 3, 200, generator=gen), torch.randn(70, 200, generator=gen)  # (3-D: 6 rows)
    assert scaled_err(lin.rows_gemm(x, w), F.linear(x, w)) <= 1e-5
    gated = lin.rows_gemm(x, w, gated=True)
    assert gated.shape == (2, 3, 35) and scaled_err(gated, silu_mul_torch(F.linear(x, w))) <= 1e-5
    if block_n == 16:
        assert torch.equal(gated, silu_mul_fast(lin.rows_gemm(x, w)))
    assert lin.rows_tile(70) == (block_n, block_k, stages)


def test_rows_kernel_tiles_from_shape():
    assert [lin.rows_tile(n)[0] for n in (257, 2048, 2304, 3088, 4608, 8192, 16384)] == [16, 16, 32, 32, 64, 64, 64]
    assert lin.rows_tile(6176) == (64, 256, 4) and lin.rows_tile(16384) == (64, 256, 3)
    # past ROWS_MAX_M rows (pushing only) the K step is at most ROWS_WIDE_K: the x tile is twice or four times as big
    assert lin.rows_tile(2048, lin.ROWS_MAX_M) == (16, 512, 4)
    assert lin.rows_tile(2048, lin.ROWS_MAX_M + 1) == (16, lin.ROWS_WIDE_K, 4) == lin.rows_tile(2048, 32)


def test_rows_kernel_limits(monkeypatch):
    """linear_fast: F.linear's bits past ROWS_MAX_M rows and for a weight over ROWS_MAX_BYTES; rows_gemm itself
    refuses what it cannot take, by name."""
    gen = torch.Generator().manual_seed(4)
    w, x = torch.randn(24, 40, generator=gen), torch.randn(5, 40, generator=gen)
    assert not torch.equal(lin.linear_fast(x, w), F.linear(x, w))  # (the rows kernel: another order of the sums)
    monkeypatch.setattr(lin, "ROWS_MAX_BYTES", 24 * 40 * 4 - 1)
    assert torch.equal(lin.linear_fast(x, w), F.linear(x, w))
    with pytest.raises(ValueError, match="rows_gemm"):
        lin.rows_gemm(torch.randn(lin.ROWS_MAX_M + 1, 40), w)
    with pytest.raises(ValueError, match="rows_gemm"):
        lin.rows_gemm(x.double(), w)


def test_skinny_3d_and_strided_inputs():
    gen = torch.Generator().manual_seed(1)
    w = torch.randn(24, 40, generator=gen)
    x3 = torch.randn(2, 3, 40, generator=gen)
    assert scaled_err(lin.skinny_gemm(x3, w), F.linear(x3, w)) <= 1e-5
    wide = torch.randn(4, 100, generator=gen)
    x_cols = wide[:, 10:50]                          # rows strided, features contiguous
    x_t = torch.randn(40, 4, generator=gen).t()      # features strided: copied once
    for x in (x_cols, x_t):
        assert scaled_err(lin.skinny_gemm(x, w), F.linear(x, w)) <= 1e-5
    rows = torch.randn(60, 40, generator=gen)[10:34]  # a row block of a bigger weight (fuse_rows views)
    assert scaled_err(lin.skinny_gemm(x3, rows), F.linear(x3, rows)) <= 1e-5


def test_large_m_and_empty_take_f_linear():
    gen = torch.Generator().manual_seed(2)
    w = torch.randn(8, 32, generator=gen)
    x = torch.randn(lin.SKINNY_MAX_M + 1, 32, generator=gen)
    assert torch.equal(lin.skinny_gemm(x, w), F.linear(x, w))
    assert lin.skinny_gemm(torch.zeros(0, 32), w).shape == (0, 8)


def test_feature_mismatch_is_a_clear_error():
    with pytest.raises(ValueError, match="features"):
        lin.skinny_gemm(torch.zeros(2, 31), torch.zeros(8, 32))


def test_linear_binds_its_kernel_set():
    """Linear runs F.linear with the torch kernels (its bits) and linear_fast with the fast ones (the GEMV and the
    rows kernel up to ROWS_MAX_M rows: within the tolerance; F.linear's bits above)."""
    for name in ("torch", "fast"):
        with backend.use_kernels(name):
            layer = lin.Linear(32, 8, cols=[(0, 32)])
        layer.weight.data.normal_()
        x, many = torch.randn(3, 32), torch.randn(lin.ROWS_MAX_M + 1, 32)
        assert torch.equal(layer(many), F.linear(many, layer.weight))
        if name == "torch":
            assert torch.equal(layer(x), F.linear(x, layer.weight))
        else:
            assert scaled_err(layer(x), F.linear(x, layer.weight)) <= 1e-5


# ------------------------------------------------------------------------------------ gated (dense MLP gate_up)
def gated_case(M, I, K, dtype, seed):
    """x [M, K] and a gate_up weight [2I, K] and bias [2I] whose sums land on silu's curve, not only its tails."""
    gen = torch.Generator().manual_seed(seed)
    x, w = torch.randn(M, K, generator=gen), torch.randn(2 * I, K, generator=gen) * 2 * K ** -0.5
    return x.to(dtype), w.to(dtype), (torch.randn(2 * I, generator=gen) * 0.5).to(dtype)


@pytest.mark.parametrize("dtype,tol", [(torch.float32, 1e-5), (torch.float16, 4e-3)])
@pytest.mark.parametrize("M", [1, 2, 3, 16])
@pytest.mark.parametrize("I,K", [(37, 300), (8, 64), (70, 1000)])
def test_gated_equals_silu_mul_of_the_gemm(M, I, K, dtype, tol, monkeypatch):
    """linear_fast(gated=True), silu(gate) * up in the epilogue of the GEMV (1-2 rows) and of the rows kernel (3-16
    rows; 128-wide K steps: several and a partial one), with and without a bias: the bits of silu_mul_fast over the
    plain kernel's output (the same sums, rounded at the same points; fp16 too, which the interpreter rounds as the
    GPU does), and near silu_mul_torch over F.linear. I: 37 and 70, no multiple of a column block; 8, under the
    rows kernel's least block of 16 columns."""
    monkeypatch.setitem(lin.ROWS_CONFIG, "block_k", 128)
    x, w, b = gated_case(M, I, K, dtype, seed=M * I)
    for bias in (None, b):
        y = lin.linear_fast(x, w, bias, gated=True)
        assert y.shape == (M, I) and y.dtype == dtype
        assert torch.equal(y, silu_mul_fast(lin.linear_fast(x, w, bias)))
        assert scaled_err(y, silu_mul_torch(F.linear(x, w, bias))) <= tol


def test_gated_bf16():
    """bf16 through the interpreter, whose fp32 -> bf16 casts truncate (the GPU's round to nearest): the GEMV's gated
    epilogue within two bf16 ulps of silu_mul_torch over F.linear. (Not the rows kernel: the interpreter's tl.dot
    of bf16 tiles gives garbage, gated or not; test_gpu_gated_bf16 checks it.)"""
    for M in (1, 2):
        x, w, b = gated_case(M, 37, 200, torch.bfloat16, seed=M)
        want = silu_mul_torch(F.linear(x, w, b))
        assert (lin.linear_fast(x, w, b, gated=True).float() - want.float()).abs().max() <= 2 ** -6 * want.abs().max()


def test_gated_past_the_kernels_rows_and_shapes():
    """Past ROWS_MAX_M rows F.linear then silu_mul_fast (their bits), 3-D inputs, a gate_up row block of a bigger
    weight (fuse_rows views); a weight of an odd number of rows is no gate_up."""
    gen = torch.Generator().manual_seed(5)
    w = torch.randn(60, 40, generator=gen)[10:34]
    many, x3 = torch.randn(lin.ROWS_MAX_M + 1, 40, generator=gen), torch.randn(1, 2, 40, generator=gen)
    assert torch.equal(lin.linear_fast(many, w, gated=True), silu_mul_fast(F.linear(many, w)))
    y3 = lin.linear_fast(x3, w, gated=True)
    assert y3.shape == (1, 2, 12) and scaled_err(y3, silu_mul_torch(F.linear(x3, w))) <= 1e-5
    with pytest.raises(ValueError, match="gate rows"):
        lin.linear_fast(x3, w[:5], gated=True)


# ------------------------------------------------------------------------------------------------------ GPU
def skinny_shapes(inputs: bool = False):
    """(name, N, K): the real model's router (replicated) and out projections at the TP=1 and TP=8 shards (with
    `inputs`, the fused input projections too)."""
    from qwen35.config import ModelConfig
    from qwen35.synth import PRESETS
    cfg = ModelConfig.from_dict({"text_config": dict(PRESETS["qwen3.5-35b-a3b"]["text_config"])})
    vd = cfg.linear_num_value_heads * cfg.linear_value_head_dim
    od = cfg.num_attention_heads * cfg.head_dim
    found = [("router", cfg.num_experts + 1, cfg.hidden_size)] + [
        (f"{name} tp{tp}", cfg.hidden_size, k // tp) for name, k in (("out_proj", vd), ("o_proj", od))
        for tp in (1, 8)]
    if inputs:
        kd = cfg.linear_num_key_heads * cfg.linear_key_head_dim
        gdn = 2 * kd + 2 * vd + 2 * cfg.linear_num_value_heads
        qkv = 2 * od + 2 * cfg.num_key_value_heads * cfg.head_dim
        found += [(f"{name} tp{tp}", n // tp, cfg.hidden_size) for name, n in (("gdn_in", gdn), ("qkv", qkv))
                  for tp in (1, 8)]
    return found


@pytest.mark.gpu
@pytest.mark.parametrize("kernel,M", [("skinny", m) for m in (1, 2, 4, 8, 13, 16, 24, 64)]
                         + [("gemv", m) for m in range(1, 5)] + [("rows", m) for m in (3, 4, 8, 13, 16)])
def test_gpu_bits_near_f_linear_bf16(kernel, M):
    """Each output is one rounding of an fp32 sum of the bf16 products: within 2^-8 |v| (half a bf16 ulp, and the
    fp32 sums' own error, 1e-5 of the RMS) of the exact product v (fp64), and at least 99% of the outputs equal to v
    rounded to bf16 (an fp32 sum's error, ~sqrt(K) 2^-24 relative, moves a few across a rounding boundary). Against
    F.linear: equal bits for 99% of the outputs that F.linear itself rounds correctly. (Asking every output to be
    within one bf16 ulp of F.linear's failed for the router at M = 4 on 1x H200, 2026-11-25, with many outputs one
    ulp apart; the exact product says which side rounds off.)"""
    gen = torch.Generator(device="cuda").manual_seed(M)
    op = {"skinny": lin.skinny_gemm, "rows": lin.rows_gemm,
          "gemv": lambda x, w: lin.linear_fast(x, w, gemv_rows=4)}[kernel]
    for name, N, K in skinny_shapes(inputs=kernel != "skinny"):
        w = (torch.randn(N, K, generator=gen, device="cuda") * K ** -0.5).bfloat16()
        x = torch.randn(M, K, generator=gen, device="cuda").bfloat16()
        y, ref = op(x, w), F.linear(x, w)
        exact = x.double() @ w.double().t()
        diff = (y.double() - exact).abs()
        bound = 2 ** -8 * exact.abs() + 1e-5 * exact.pow(2).mean().sqrt()
        assert (diff <= bound).all(), f"{name} M={M}: {(diff - bound).max().item()}"
        rounded = exact.to(torch.bfloat16)
        assert (y == rounded).float().mean().item() >= 0.99, name
        once = ref == rounded
        assert (y[once] == ref[once]).float().mean().item() >= 0.99, name


@pytest.mark.gpu
@pytest.mark.parametrize("M", [1, 2, 3, 8, 16])
def test_gpu_gated_bf16(M):
    """The dense MLP's gate_up with silu(gate) * up in the epilogue (Llama-1B / 3B at TP=1 and 8; at 1-2 rows with
    the layer norm folded in too, as the model runs it): within bf16 rounding of silu_mul_torch over F.linear; the
    GEMV's the bits of silu_mul_fast over the plain GEMV (the same sums: half the columns a program, the same weight
    rows and warps), the rows kernel's (half the columns a program: other tl.dot tiles) 99% of them."""
    from layers.norm import RMSNorm
    gen = torch.Generator(device="cuda").manual_seed(M)
    for H, I in ((2048, 8192), (2048, 1024), (3072, 8192), (3072, 1024)):
        w = (torch.randn(2 * I, H, generator=gen, device="cuda") * H ** -0.5).bfloat16()
        x = torch.randn(M, H, generator=gen, device="cuda").bfloat16()
        y = lin.linear_fast(x, w, gated=True)
        assert rel(y, silu_mul_torch(F.linear(x, w))) <= 1e-2
        same = (y == silu_mul_fast(lin.linear_fast(x, w))).float().mean().item()
        assert same == 1.0 if M <= lin.GEMV_MAX_M else same >= 0.99, (H, I, same)
        if M <= lin.GEMV_MAX_M:
            with backend.use_kernels("fast"):
                norm = RMSNorm(H, 1e-6, plain=True, dtype=torch.bfloat16, device="cuda")
            norm.weight.data.normal_(1.0, 0.1, generator=gen)
            r = torch.randn(M, H, generator=gen, device="cuda").bfloat16()
            folded = lin.linear_fast(norm.boundary(x, r)[0], w, gated=True)
            assert torch.equal(folded, silu_mul_fast(lin.linear_fast(norm.boundary(x, r)[0], w))), (H, I)
