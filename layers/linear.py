"""Linear layers with tensor-parallel shards, and the weight loader that fills any shard from a checkpoint tensor.

Every parameter carries `full_shape` (its shape in the checkpoint) and `shard` (per dim: None for the whole dim, or a
list of (start, size) ranges of the full dim that this rank keeps, concatenated in order). The loader reads exactly
those ranges through a lazy checkpoint slice, so a rank never touches bytes it does not own.

    linear_torch  F.linear (cuBLAS on the GPU), the oracle
    linear_fast   the same, except at decode batch sizes (M <= GEMV_MAX_M rows, K <= GEMV_MAX_K): one Triton GEMV
                  launch in which each program holds a few whole weight rows in registers (one load of BLOCK_N x K,
                  fp32 products summed along K) and applies them to every input row. Many small programs keep the
                  memory busy where cuBLAS's tiles do not: in CUDA graphs over weights that do not stay in L2 (as in
                  a decode step, which streams ~6 GB), 1x H200, 2026-11-25, see benchmarks/bench_linear.py.
                  Linear, the fused input projections and the dense MLPs run it with the fast kernel set. Its input
                  may be a PendingNorm (a layer norm not yet computed, RMSNorm.boundary): the GEMV then computes the
                  norm itself, in every program, before its sums (backend.rms_norm_row), and saves the norm's own
                  launch (at one row always, with wider programs; at two only into small grids: the router); any
                  other path computes the norm first. With rows_in_grid (the MoE router at 3-16 rows) the grid has a
                  program per column block and row, so each program pays the norm for its one row.
                  Past GEMV_MAX_M rows, up to ROWS_MAX_M (3-16: small decode batches, verify steps), weights up to
                  ROWS_MAX_BYTES go to the rows kernel (rows_gemm: tl.dot over the rows, K in pipelined steps), which
                  runs level with cuBLAS or ahead and pushes a boundary's partial sums from its epilogue (those up to
                  ROWS_PUSH_MAX_M rows: one launch where cuBLAS needs a push launch after it).
                  `gated` (the dense MLP's gate_up, mlp.mlp_fast): both kernels end in SwiGLU's silu(gate) * up
                  (activation.silu_mul_sums), each program summing its columns' gate rows and up rows, so at decode
                  sizes one launch gives the MLP's activation (past them F.linear, then silu_mul_fast's launch).
    skinny_gemm   the MoE router's GEMM past the row grid's rows, up to SKINNY_MAX_M (moe.router_logits_fast): each
                  program owns a slice of the output columns and a share of the reduction dimension (split K, no
                  float atomics), tl.dot over the rows; it pays where cuBLAS has no good tile for a narrow output
                  (the router's 257 columns).
"""
from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import Callable

import torch
import torch.nn.functional as F
from torch import nn

from dist import parallel, push
from dist.push import Pushed
from layers import backend
from layers.activation import silu_mul_fast, silu_mul_sums
from layers.backend import dot_precision, next_may_start, pdl, prior_done, rms_norm_row, round_to, tl, triton

# linear_fast's GEMV: up to GEMV_MAX_M rows and GEMV_MAX_K features; a program holds BLOCK_N x next_pow2(K) <= tile
# weight elements ("tile_1" at one row, "tile" at more; BLOCK_N a power of two, halved from the most that fits until
# the grid has two programs per SM), with "warps" per program (times K / tile where one row is more than the tile);
# gated, the same weight rows a program, half of them gate and half up rows (_columns_per_program).
# From `python -m benchmarks.bench_linear --sweep` (1x H200, 2026-11-25, weights streamed from HBM, CUDA graphs): at
# one row the GEMV beats cuBLAS on every projection (in 13.6 against 15.9 us, qkv 10.7 / 11.8, out 6.0 / 8.5, router
# 2.2 / 3.1, LM head 227 / 245), at two on the DeltaNet input and the out projections (15.5 / 16.4, 7.2 / 8.8), at
# four it loses the projections (21.9 / 16.3, 9.3 / 8.6: its per-row sums cost) but still wins the router's 257
# columns (3.7 against cuBLAS 8.4 and the skinny kernel 4.3; moe.router_logits_fast asks for it there). The same at
# the TP=4 and TP=2 rank shapes (1x H100, 2026-11-28, `--tp 4 --rows 1,2,4,8 --norm`): at 4 rows the GEMV loses the
# DeltaNet input projection (9.7 against cuBLAS 7.5 us at TP=4) and a folded norm saves nothing past 2 rows. Module
# level, so that the benchmark can sweep them; from shapes only (a CUDA graph holds them).
GEMV_MAX_M = 2
GEMV_MAX_K = 16384
GEMV_CONFIG = {"tile_1": 2048, "tile": 8192, "warps": 4, "norm_tile_1": 16384, "norm_warps_1": 8}
CPU_MAX_PROGRAMS, CPU_MAX_TILE = 64, 1 << 18  # the GEMV's and rows kernel's grids on the CPU (_cpu_columns)
# A PendingNorm input costs every program the norm of its rows before its sums, and saves the norm's own launch
# (~2 us in a decode step's graph): `python -m benchmarks.bench_linear --rows 1,2 --norm --sweep` (1x H200,
# 2026-11-26, L2-cold weights): at one row, with wider programs (norm_tile_1, norm_warps_1: fewer prologues) the
# folded norm wins on every projection that reads one (norm kernel + GEMV against folded: DeltaNet input 15.2 /
# 14.5 us, attention qkv 12.7 / 11.4, router 3.9 / 2.5); at two rows only where the grid is small (router 4.2 /
# 3.5; DeltaNet input 17.3 / 22.5), so there it is folded only into grids of at most FOLD_MAX_PROGRAMS_PER_SM
# programs per SM.
FOLD_MAX_PROGRAMS_PER_SM = 2
FOLD_MAX_M = 16  # rows up to which a layer boundary leaves its norm to the GEMV that reads it (RMSNorm.boundary): the
                 # MoE router's row grid folds it up to 16 (moe.router_logits_fast); other readers compute it first

# rows_gemm (the rows kernel): from GEMV_MAX_M + 1 to ROWS_MAX_M rows, weights up to ROWS_MAX_BYTES, the largest it was
# measured on (Llama-1B's gate_up; the LM head's slice, 127 MB at TP=8, stays on cuBLAS, which streams the larger ones
# at ~4.1 TB/s). `python -m benchmarks.bench_linear --rows 3,4,8,16 --rows-sweep` (1x H200, 2026-11-28, L2-cold weights;
# `--tp 4` and `--model llama-1b` shapes): with 512-wide K steps 4 deep it runs level with cuBLAS on the input
# projections and the dense MLP (e.g. DeltaNet input at TP=4 5.9-6.1 against 6.1-6.3 us) and ahead on the out
# projections (3.8-3.9 against 4.4-4.7 us at TP=4), and it pushes a boundary's partial sums from its epilogue, where
# cuBLAS needs push_'s launch after it. Whole-K programs (the GEMV's way) spilled: 10.2 us. ROWS_TILES: by the output's
# columns, up to N: (block_n, block_k, stages), the best of the sweep (16 at 2,048 columns, 32 at 2,304-3,088, 64 with
# 256-wide steps 3 deep at 16,384; 64 x 512 x 4 stages needs 240 KB of shared memory, over Hopper's 227). The TP=2 input
# projections (4,608 and 6,176 columns) were not in that sweep and took 32 x 512 x 4 at 10.3-11.4 us; a sweep of
# them (1x H200, 2026-11-30, 4 / 8 / 16 rows, L2 cold; bench_linear's timing in a scratch script, now `--tp 2 --rows
# 4,8,16 --rows-sweep`) has 64 x 256 x 4 best: DeltaNet input 8.5-8.7 us (cuBLAS
# 9.7-9.9), attention qkv 7.3-7.4 (7.5-7.8), so 64 x 256 x 4 from 3,089 to 8,192 columns. At TP=1's 9,216 and 12,352
# columns 32 x 128 x 4 led 64 x 256 x 3 by 0.5-0.8 us there: TP=1 decode 3.675 / 4.184 / 6.091 / 7.887 / 9.311 ->
# 3.650 / 4.163 / 6.068 / 7.854 / 9.283 ms at batch 3 / 4 / 8 / 12 / 16 (one 1x H200 call, 2026-11-30,
# 2026-11-30_record_h200_tp1_rows_tile12352{,_base}.json), so it to 12,352. ROWS_CONFIG overrides them where set (the
# sweep's knobs).
ROWS_MAX_M = 16
ROWS_MAX_BYTES = 64 << 20
ROWS_TILES = ((2048, 16, 512, 4), (3088, 32, 512, 4), (8192, 64, 256, 4), (12352, 32, 128, 4), (None, 64, 256, 3))
# A boundary's partial sums (linear_fast(partial=True) where the inbox takes them: the out projections at TP > 1) go
# to the rows kernel up to ROWS_PUSH_MAX_M rows, pushed from its epilogue, where cuBLAS needs push_'s launch after it
# (1.5-1.9 us + ~0.4 of gap a boundary in the TP=2 profile at batch 32 / 64). Past ROWS_MAX_M rows the K step is
# ROWS_WIDE_K (the x tile doubles). A rows sweep (1x H200, 2026-11-30, out projections of 2,048 columns, L2-cold
# weights, us, rows kernel 16 x 256 x 4 against cuBLAS; now `bench_linear --rows 24,32 --rows-sweep`): TP=2 5.68 /
# 5.65 / 6.07 against 5.95 / 5.88 / 6.01 at 24 / 32 / 64 rows (512-wide steps 5.99 / 6.03 at 24 / 32); TP=4 3.95 /
# 4.19 against 4.89 / 4.58 at 32 / 64. The TP=2 decode record with it up to 64 rows (2x H200, one call against
# 81903f1): 7.390 / 8.337 / 9.921 / 10.915 -> 7.277 / 8.234 / 9.981 / 10.967 ms at batch 24 / 32 / 48 / 64, so 32.
ROWS_PUSH_MAX_M = 32
ROWS_WIDE_K = 256
ROWS_CONFIG = {"block_n": 0, "block_k": 0, "stages": 0, "warps": 4}

# skinny_gemm's threshold (rows of the input) and launch settings, likewise. block_n: output columns per program (the
# weight rows it streams, whole K each); block_k: the reduction step, loads pipelined `stages` deep.
SKINNY_MAX_M = 64  # rows: the tile over them is the next power of two, at least 16 (tl.dot's minimum)
SKINNY_CONFIG = {"block_n": 16, "block_k": 256, "warps": 4, "stages": 4, "split": 0}
# split: programs per column block, each summing a 1/split share of K (0: from the shape, see _split_k). With N /
# block_n column blocks alone the SMs are barely filled (128 programs for an out projection's 2,048 columns on 132
# SMs, one 4-warp program streaming per SM) or not at all (17 for the router's 257).

Ranges = list[tuple[int, int]] | None


def even_split(total: int, rank: int, world: int) -> tuple[int, int]:
    """(start, size) of rank's contiguous 1/world part of `total` items."""
    if total % world:
        raise ValueError(f"cannot split {total} evenly over {world} tensor-parallel ranks")
    size = total // world
    return rank * size, size


def make_param(full_shape, shard: list[Ranges], dtype, device) -> nn.Parameter:
    local = [d if r is None else sum(s for _, s in r) for d, r in zip(full_shape, shard)]
    p = nn.Parameter(torch.empty(local, dtype=dtype, device=device), requires_grad=False)
    p.full_shape = tuple(full_shape)
    p.shard = shard
    return p


def read_shard(src, shard: list[Ranges]) -> torch.Tensor:
    """Read the ranges of `shard` from a checkpoint tensor source (dims with one range are sliced lazily; several
    ranges on a dim are read one by one and concatenated)."""
    multi = [i for i, r in enumerate(shard) if r is not None and len(r) > 1]
    if not multi:
        index = tuple(slice(None) if r is None else slice(r[0][0], r[0][0] + r[0][1]) for r in shard)
        return src.read(index)
    d = multi[0]
    pieces = []
    for start, size in shard[d]:
        sub = list(shard)
        sub[d] = [(start, size)]
        pieces.append(read_shard(src, sub))
    return torch.cat(pieces, dim=d)


def default_weight_loader(param: nn.Parameter, src) -> None:
    if tuple(src.shape) != param.full_shape:
        raise ValueError(f"tensor {src.name!r} in {src.file}: shape {tuple(src.shape)}, expected {param.full_shape}")
    param.data.copy_(read_shard(src, param.shard))


class Linear(nn.Module):
    """y = x @ W^T (+ b), W a shard of the checkpoint's [out, in] weight: `rows` picks output rows (column parallel,
    the bias sliced the same way), `cols` picks input columns (row parallel; the caller all-reduces the partial sums,
    so every rank holds the whole bias and only rank 0 adds it). The layers call it for their out projections
    (DeltaNet out_proj, attention o_proj) and the dense models for their projections; linear_fast with the fast
    kernel set (the GEMV at decode sizes). A row-parallel Linear's output is a layer boundary's partial sums
    (`partial`): under TP, at decode sizes, the fast path pushes them to every rank's inbox (dist/push.py) and
    returns a Pushed for the boundary's norm to sum."""

    def __init__(self, in_features: int, out_features: int, *, rows: Ranges = None, cols: Ranges = None,
                 bias: bool = False, dtype=None, device=None):
        super().__init__()
        self.weight = make_param((out_features, in_features), [rows, cols], dtype, device)
        self.bias = make_param((out_features,), [rows], dtype, device) if bias else None
        self.adds_bias = bias and (cols is None or parallel.tp_rank() == 0)
        self.partial = cols is not None  # row parallel: its output is a layer boundary's partial sums
        self._op = linear_fast if backend.use_fast() else linear_torch

    def forward(self, x: torch.Tensor) -> torch.Tensor | Pushed:
        return self._op(x, self.weight, self.bias if self.adds_bias else None, partial=self.partial)


@dataclass(eq=False)
class PendingNorm:
    """A layer norm of a few rows not computed yet (RMSNorm.boundary): norm(x + residual) (residual None: norm(x)),
    into `out`, and the sum x + residual into `residual_out`. The GEMV that reads it first (linear_fast) computes
    the norm in each program's prologue and its first program stores both, so the norm costs no launch of its own;
    any other reader calls tensor(), which runs `compute` (the norm kernel) once. Either way both outputs hold
    their values once the first reader has run, on the stream, before anything after it reads them."""
    x: torch.Tensor | Pushed
    residual: torch.Tensor | None
    weight: torch.Tensor
    eps: float
    plain: bool
    out: torch.Tensor
    residual_out: torch.Tensor | None
    compute: Callable[["PendingNorm"], None]
    done: bool = False

    @property
    def shape(self) -> torch.Size:
        return self.out.shape

    @property
    def device(self) -> torch.device:
        return self.out.device

    @property
    def dtype(self) -> torch.dtype:
        return self.out.dtype

    def tensor(self) -> torch.Tensor:
        if not self.done:
            self.compute(self)
            self.done = True
        return self.out


def computed(x: torch.Tensor | PendingNorm) -> torch.Tensor:
    """x itself, or the rows of a PendingNorm (computed now if no GEMV has yet)."""
    return x.tensor() if isinstance(x, PendingNorm) else x


def linear_torch(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None, *,
                 partial: bool = False) -> torch.Tensor:
    """F.linear (partial: the output is a boundary's partial sums, which the caller's boundary all-reduces)."""
    return F.linear(x, weight, bias)


def linear_fast(x: torch.Tensor | PendingNorm, weight: torch.Tensor, bias: torch.Tensor | None = None, *,
                gemv_rows: int | None = None, rows_in_grid: bool = False, partial: bool = False,
                gated: bool = False) -> torch.Tensor | Pushed:
    """x [..., K] @ weight[N, K]^T (+ bias) -> [..., N] in x's dtype: the GEMV kernel for 1..gemv_rows rows
    (GEMV_MAX_M by default), the rows kernel (rows_gemm) past them up to ROWS_MAX_M for a weight of at most
    ROWS_MAX_BYTES, F.linear otherwise (and for K > GEMV_MAX_K at GEMV rows, a weight whose rows are not contiguous,
    mixed dtypes). A PendingNorm not yet computed is computed inside the GEMV (see the module's docstring), its sum
    pulled from the inbox where it is a Pushed. With `partial` (the output is a boundary's partial sums) where the
    inbox takes them (TP > 1, decode sizes), they are pushed to every rank (from the GEMV's epilogue, else by
    push_ after a cuBLAS GEMM) and a Pushed is returned. rows_in_grid: a program per (column block, row), each
    tiled as at one row, so a folded norm costs a program one row, not every row (for a small weight, read again
    per row from L2: the MoE router's at 3-16 rows).
    gated: `weight` is a dense MLP's gate_up (gate rows, then as many up rows: mlp.MLP) and the result is SwiGLU's
    activation silu(x W_gate^T) * (x W_up^T) [..., N / 2], the bits of silu_mul_fast over the plain result: the GEMV
    and the rows kernel compute it in their epilogue (activation.silu_mul_sums), F.linear's path by silu_mul_fast."""
    norm = x if isinstance(x, PendingNorm) and not x.done else None
    pulled = norm is not None and isinstance(norm.x, Pushed)
    x = (norm.out if pulled else norm.x) if norm is not None else computed(x)  # (pulled: its shape and dtype)
    M, N, K = _gemm_shape(x, weight)
    cols = _output_columns(N, gated)
    box = push.pushes((*x.shape[:-1], cols), x.dtype) if partial else None
    max_rows = GEMV_MAX_M if gemv_rows is None else gemv_rows
    kernels_take = weight.stride(1) == 1 and x.dtype == weight.dtype \
        and (bias is None or (bias.dtype == weight.dtype and bias.stride(0) == 1))
    if not (0 < M <= max_rows and K <= GEMV_MAX_K and kernels_take):
        x = x if norm is None else norm.tensor()
        if kernels_take and max_rows < M <= rows_limit(box) and N * K * weight.element_size() <= ROWS_MAX_BYTES:
            return rows_gemm(x, weight, bias, box, gated=gated)
        y = F.linear(x, weight, bias)
        y = silu_mul_fast(y) if gated else y
        return push.push_(y, box) if box is not None else y
    block_k = triton.next_power_of_2(K)
    one = M == 1 or rows_in_grid  # each program's rows
    if norm is not None and one:
        tile, warps = GEMV_CONFIG["norm_tile_1"], GEMV_CONFIG["norm_warps_1"]
    else:
        tile, warps = GEMV_CONFIG["tile_1" if one else "tile"], GEMV_CONFIG["warps"]
    block_n = gemv_block_n(N, block_k, tile, x.device, M if rows_in_grid else 1)
    warps *= max(1, block_n * block_k // tile)  # (K > tile: one row a program, more warps)
    block_cols = _columns_per_program(block_n, gated, 1)
    grid = triton.cdiv(cols, block_cols)
    if norm is not None and not one and grid > FOLD_MAX_PROGRAMS_PER_SM * backend.sm_count(x.device):
        x, norm, pulled = norm.tensor(), None, False  # too many programs to each pay the norm: the norm kernel first
    x2, y = _rows_and_output(x, M, cols, K)
    if norm is None:
        r, r_out, nw, h, sr, eps = x2, x2, weight, x2, 0, 0.0  # placeholders, never touched without NORM
    else:
        r = x2 if norm.residual is None else norm.residual.reshape(M, K)
        r_out = x2 if norm.residual_out is None else norm.residual_out
        nw, h, sr, eps = norm.weight, norm.out, r.stride(0), norm.eps
    inbox = box if box is not None else (norm.x.inbox if pulled else None)
    slot = box.claim(M) if box is not None else 0
    _gemv_kernel[(grid, M if rows_in_grid else 1)](
        x2, weight, weight if bias is None else bias, y, r, r_out, nw, h, M, cols, K, x2.stride(0), weight.stride(0),
        y.stride(0), sr, eps, norm.x.slot if pulled else 0, slot, *inbox_args(inbox, x.device),
        BLOCK_M=1 if rows_in_grid else triton.next_power_of_2(M), BLOCK_N=block_cols, BLOCK_K=block_k,
        HAS_BIAS=bias is not None, NORM=norm is not None, HAS_RESIDUAL=norm is not None and norm.residual is not None,
        PLAIN=norm is not None and norm.plain, PULL=pulled, PUSH=box is not None,
        P=inbox.world if inbox is not None else 1, ROW_GRID=rows_in_grid, GATED=gated,
        EARLY=box is not None and backend.early_launch(M), num_warps=min(warps, 16), **pdl())
    if norm is not None:
        norm.done = True
    if box is not None:
        return push.Pushed(box, slot, torch.Size((*x.shape[:-1], cols)), x.dtype)
    return y.view(*x.shape[:-1], cols)


def _output_columns(N: int, gated: bool) -> int:
    """The output's columns for a weight of N rows: N, or gated (gate rows then up rows) N / 2."""
    if gated and N % 2:
        raise ValueError(f"linear_fast(gated=True): the weight's {N} rows are not gate rows then as many up rows")
    return N // 2 if gated else N


def _columns_per_program(block_n: int, gated: bool, least: int) -> int:
    """Output columns per program of a kernel tiled for block_n weight rows a program: block_n, or gated half as
    many, each program then loading its columns' gate rows and up rows (block_n rows in all, as the plain GEMM's
    programs, so the same tile settings fit), but never fewer than `least` (the kernel's minimum tile; at block_n 1
    the GEMV's program loads one column's two rows)."""
    return max(least, block_n // 2) if gated else block_n


def inbox_args(box: push.Inbox | None, device: torch.device) -> tuple:
    """dist/push.py's launch arguments of a kernel that pushes or pulls; placeholders (never read) for one that
    does neither."""
    return push.launch_args(box) if box is not None else (_no_table(device), 0, 0)


@functools.lru_cache(maxsize=None)
def _no_table(device: torch.device) -> torch.Tensor:
    return torch.zeros(1, dtype=torch.int64, device=device)


def _gemm_shape(x: torch.Tensor, weight: torch.Tensor) -> tuple[int, int, int]:
    """(M, N, K) of x [..., K] @ weight[N, K]^T (M: the rows of x); a clear error where the features differ."""
    N, K = weight.shape
    if x.shape[-1] != K:
        raise ValueError(f"linear: input has {x.shape[-1]} features, the weight {tuple(weight.shape)} expects {K}")
    return (x.numel() // K if K else 0), N, K


def _rows_and_output(x: torch.Tensor, M: int, N: int, K: int) -> tuple[torch.Tensor, torch.Tensor]:
    """x as [M, K] rows with contiguous features (copied only where they are not), and an empty [M, N] output."""
    x2 = x.reshape(M, K)
    if x2.stride(1) != 1:
        x2 = x2.contiguous()
    return x2, torch.empty(M, N, dtype=x.dtype, device=x.device)


def gemv_block_n(N: int, block_k: int, tile: int, device: torch.device, rows: int = 1) -> int:
    """Output columns per GEMV program: the most whose weights fit `tile` elements, halved while the grid (`rows`
    programs a column block) has fewer than two programs per SM (the router's 257 columns at one row: one each);
    on the CPU, _cpu_columns."""
    block_n = triton.next_power_of_2(tile // block_k) if tile >= block_k else 1
    while block_n > 1 and triton.cdiv(N, block_n) * rows < 2 * backend.sm_count(device):
        block_n //= 2
    return _cpu_columns(N, block_n, block_k, device)


def _cpu_columns(N: int, block_n: int, block_k: int, device: torch.device) -> int:
    """block_n, or on the CPU (Triton's interpreter, which pays per program, not per element) doubled while the grid
    has more than CPU_MAX_PROGRAMS programs, up to CPU_MAX_TILE weight elements a program: the tiny test model's LM
    head (248,320 columns of 64) took 3,880-7,760 programs and 20-40 s a call. Test shapes of up to CPU_MAX_PROGRAMS
    blocks keep their tiling, so the tests still cover several programs and ragged last blocks."""
    if torch.device(device).type == "cpu":
        while triton.cdiv(N, block_n) > CPU_MAX_PROGRAMS and 2 * block_n * block_k <= CPU_MAX_TILE:
            block_n *= 2
    return block_n


def skinny_gemm(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """x [..., K] @ weight[N, K]^T -> [..., N] in x's dtype: the skinny split-K kernel for 1..SKINNY_MAX_M rows,
    F.linear otherwise (and for a weight whose rows are not contiguous)."""
    M, N, K = _gemm_shape(x, weight)
    if not 0 < M <= SKINNY_MAX_M or weight.stride(1) != 1 or x.dtype != weight.dtype:
        return F.linear(x, weight)
    x2, y = _rows_and_output(x, M, N, K)
    cfg = SKINNY_CONFIG
    block_n = max(16, min(cfg["block_n"], triton.next_power_of_2(N)))
    block_k = max(16, min(cfg["block_k"], triton.next_power_of_2(K)))
    col_blocks = triton.cdiv(N, block_n)
    split = _split_k(col_blocks, K, block_k, x.device)
    block_m = max(16, triton.next_power_of_2(M))
    partials, arrivals = _split_scratch(x.device, split, block_m, col_blocks * block_n)
    _skinny_gemm_kernel[(col_blocks, split)](
        x2, weight, y, partials, arrivals, M, N, K, x2.stride(0), weight.stride(0), y.stride(0),
        BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_K=block_k, SPLIT=split, STAGES=cfg["stages"],
        PREC=dot_precision(x.dtype), num_warps=cfg["warps"], **pdl())
    return y.view(*x.shape[:-1], N)


def rows_limit(box: push.Inbox | None) -> int:
    """The most rows the rows kernel takes: ROWS_PUSH_MAX_M where it pushes a boundary's partial sums into `box`,
    else ROWS_MAX_M."""
    return ROWS_PUSH_MAX_M if box is not None else ROWS_MAX_M


def rows_tile(N: int, M: int = 1) -> tuple[int, int, int]:
    """rows_gemm's (block_n, block_k, stages) for N output columns and M rows: ROWS_TILES's row (the K step at most
    ROWS_WIDE_K past ROWS_MAX_M rows), ROWS_CONFIG's where set."""
    block_n, block_k, stages = next(t[1:] for t in ROWS_TILES if t[0] is None or N <= t[0])
    if M > ROWS_MAX_M:
        block_k = min(block_k, ROWS_WIDE_K)
    cfg = ROWS_CONFIG
    return cfg["block_n"] or block_n, cfg["block_k"] or block_k, cfg["stages"] or stages


def rows_gemm(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None,
              box: push.Inbox | None = None, gated: bool = False) -> torch.Tensor | Pushed:
    """x [..., K] @ weight[N, K]^T (+ bias) -> [..., N] in x's dtype by the rows kernel, for 1..ROWS_MAX_M rows of a
    weight with contiguous rows, 1..ROWS_PUSH_MAX_M with `box` (linear_fast takes it from GEMV_MAX_M + 1 rows up to
    those where the weight is at most ROWS_MAX_BYTES); with `box`, this rank's partial sums of a boundary, pushed
    from the epilogue (a Pushed returned); gated (a dense MLP's gate_up, as linear_fast's): silu(gate) * up
    [..., N / 2] from the epilogue."""
    M, N, K = _gemm_shape(x, weight)
    rows_max = rows_limit(box)
    if not 0 < M <= rows_max or weight.stride(1) != 1 or x.dtype != weight.dtype:
        raise ValueError(f"rows_gemm: {M} rows of {x.dtype} against {tuple(weight.shape)} {weight.dtype} "
                         f"(stride {weight.stride()}); it takes 1..{rows_max} rows "
                         f"({'pushed' if box is not None else 'not pushed'}), one dtype, contiguous rows")
    cols = _output_columns(N, gated)
    x2, y = _rows_and_output(x, M, cols, K)
    block_n, block_k, stages = rows_tile(N, M)
    block_k = min(block_k, max(16, triton.next_power_of_2(K)))
    block_n = _cpu_columns(N, block_n, block_k, x.device)
    block_cols = _columns_per_program(block_n, gated, 16)  # (tl.dot's least N)
    slot = box.claim(M) if box is not None else 0
    _rows_kernel[(triton.cdiv(cols, block_cols),)](
        x2, weight, weight if bias is None else bias, y, M, cols, K, x2.stride(0), weight.stride(0), y.stride(0),
        slot, *inbox_args(box, x.device), BLOCK_M=max(16, triton.next_power_of_2(M)), BLOCK_N=block_cols,
        BLOCK_K=block_k, HAS_BIAS=bias is not None, PUSH=box is not None, P=box.world if box is not None else 1,
        STAGES=stages, PREC=dot_precision(x.dtype), GATED=gated, EVEN_K=K % block_k == 0,
        num_warps=ROWS_CONFIG["warps"], **pdl())
    if box is not None:
        return push.Pushed(box, slot, torch.Size((*x.shape[:-1], cols)), x.dtype)
    return y.view(*x.shape[:-1], cols)


def _split_k(col_blocks: int, K: int, block_k: int, device: torch.device) -> int:
    """Programs per column block: SKINNY_CONFIG["split"], else the largest power of two that keeps the grid within
    two programs per SM; never more than K has block_k steps. A function of shapes only (CUDA graphs hold it)."""
    steps = triton.cdiv(K, block_k)
    if SKINNY_CONFIG["split"]:
        return max(1, min(SKINNY_CONFIG["split"], steps))
    split, room = 1, 2 * backend.sm_count(device)
    while col_blocks * split * 2 <= room and split * 2 <= steps:
        split *= 2
    return split


@functools.lru_cache(maxsize=None)
def _split_scratch(device: torch.device, split: int, rows: int, cols: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The split-K partial sums [split, rows, cols] (fp32) and per column block arrival counters (int32, zero between
    calls: the last program of a block resets its counter), shared by every call of the same shape. Calls on one
    stream run one after another, so sharing is safe; the first call of a shape comes in an eager warm-up before
    any CUDA graph capture, so the buffers never belong to a graph's pool."""
    if split == 1:
        placeholder = torch.empty(1, dtype=torch.int32, device=device)
        return placeholder, placeholder
    return (torch.empty(split, rows, cols, dtype=torch.float32, device=device),
            torch.zeros(cols, dtype=torch.int32, device=device))


def fuse_rows(*linears: Linear, attr: str = "weight", pad_rows_to: int = 1) -> torch.Tensor:
    """One [sum of outputs, in] weight (or with attr="bias" one [sum of outputs] bias) for linears that read the
    same input, so one GEMM computes them all. With pad_rows_to > 1 the buffer holds zero rows up to a multiple of
    it after the last linear's, and the returned tensor is the leading [sum of outputs] rows of that buffer (see
    moe.padded_router_gemm, which runs its GEMM over the padded rows).

    Each linear's parameter becomes a view of its rows of the fused tensor (same name, full_shape and shard), so the
    loader and the dummy initialiser still fill each one by its checkpoint name, and no memory is duplicated."""
    first = getattr(linears[0], attr)
    rows = sum(getattr(lin, attr).shape[0] for lin in linears)
    padded = -(-rows // pad_rows_to) * pad_rows_to
    fused = torch.zeros(padded, *first.shape[1:], dtype=first.dtype, device=first.device)[:rows]
    offset = 0
    for lin in linears:
        old = getattr(lin, attr)
        n = old.shape[0]
        view = fused[offset: offset + n]
        view.copy_(old.data)
        p = nn.Parameter(view, requires_grad=False)
        p.full_shape, p.shard = old.full_shape, old.shard
        setattr(lin, attr, p)
        offset += n
    return fused


if triton is not None:
    @triton.jit(do_not_specialize=["M", "pull_slot", "push_slot"])  # one compile per row tile and mode
    def _gemv_kernel(x_ptr, w_ptr, b_ptr, y_ptr, r_ptr, ro_ptr, nw_ptr, h_ptr, M, N, K, sx, sw, sy, sr, eps,
                     pull_slot, push_slot, table, rank, region_stride,
                     BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, HAS_BIAS: tl.constexpr,
                     NORM: tl.constexpr, HAS_RESIDUAL: tl.constexpr, PLAIN: tl.constexpr, PULL: tl.constexpr,
                     PUSH: tl.constexpr, P: tl.constexpr, ROW_GRID: tl.constexpr, GATED: tl.constexpr,
                     EARLY: tl.constexpr):
        """Columns [n0, n0 + BLOCK_N) of y = x @ w^T (+ b) for M <= BLOCK_M rows: the program loads its BLOCK_N weight
        rows whole (K <= BLOCK_K) in one go, so all of its bytes are in flight at once, then for each row sums the
        fp32 products along K and rounds once to y's dtype (the bias added in fp32 before, as cuBLAS's epilogue does).
        No loop over K, no shared memory: a grid of many small programs streams the weight at the memory's rate.
        With NORM the rows are a layer norm's inputs: each program computes the norm of every row (rms_norm_row:
        the residual r added, the norm weight nw) and uses it as x; program 0 stores the sums (ro) and the normed
        rows (h). The weight loads are issued first: the norm's arithmetic runs while they are in flight.
        PULL (with NORM): the rows are a boundary's sum, polled for and summed from the inbox (dist/push.py) after
        the weight loads are issued. A grid of [column blocks, M] (linear_fast's rows_in_grid) gives each program
        one row, program_id(1), with BLOCK_M 1: the weight is read once per row (from L2 but the first), the norm
        computed once per row and program. PUSH: y is this rank's partial sums of a boundary, stored into every rank's
        inbox instead of y_ptr; the programs empty the boundary before it in this rank's inbox.
        GATED: w holds 2N rows, gate then up (a dense MLP's gate_up), and y [M, N] is silu(gate) * up: the program
        loads the gate rows n and the up rows N + n, sums both per row as above and applies silu_mul_sums, which
        rounds the sums as the plain GEMV's store does, so y has the bits of silu_mul_fast over the plain GEMV's."""
        pid = tl.program_id(0)
        n = pid * BLOCK_N + tl.arange(0, BLOCK_N)
        k = tl.arange(0, BLOCK_K)
        nm, km = n < N, k < K
        w = tl.load(w_ptr + n[:, None].to(tl.int64) * sw + k[None, :], mask=nm[:, None] & km[None, :],
                    other=0.0).to(tl.float32)
        if GATED:
            w_up = tl.load(w_ptr + (N + n)[:, None].to(tl.int64) * sw + k[None, :], mask=nm[:, None] & km[None, :],
                           other=0.0).to(tl.float32)
        if HAS_BIAS:
            b = tl.load(b_ptr + n, mask=nm, other=0.0).to(tl.float32)
            if GATED:
                b_up = tl.load(b_ptr + N + n, mask=nm, other=0.0).to(tl.float32)
        prior_done()  # (backend.pdl: the weights stream while the kernel before this one drains)
        if EARLY:  # (backend.early_launch: the GEMV after this kernel loads its weights while it runs)
            next_may_start()
        dt = y_ptr.dtype.element_ty
        for i in tl.static_range(BLOCK_M):
            # a row grid (rows on axis 1) gives each program one row, BLOCK_M 1; otherwise m stays a constant, so
            # the row limits below fold at compile time (a runtime m cost batch-2 steps ~1%, 1x H200, 2026-11-28)
            m = tl.program_id(1) + i if ROW_GRID else i
            # rows past M (the tile is a power of two) read and write nothing: their limits are <= 0
            limit = tl.minimum(K, (M - m) * K)
            xm = k < limit
            if PULL:
                x = round_to(push.pull_sum(pull_slot, m, k, xm, table, rank, region_stride, K, P, dt), dt)
            else:
                x = tl.load(x_ptr + m * sx + k, mask=xm, other=0.0)
            if NORM:  # (program 0 stores: its limit is the row's)
                x = rms_norm_row(x, r_ptr + m * sr, ro_ptr + m * K, nw_ptr, h_ptr + m * K, k, xm,
                                 k < tl.where(pid == 0, limit, 0), K, eps, HAS_RESIDUAL, PLAIN)
            y = tl.sum(w * x.to(tl.float32)[None, :], 1)
            if HAS_BIAS:
                y += b
            if GATED:
                up = tl.sum(w_up * x.to(tl.float32)[None, :], 1)
                if HAS_BIAS:
                    up += b_up
                out = silu_mul_sums(y, up, dt)
            else:
                out = y.to(dt)
            ym = n < tl.minimum(N, (M - m) * N)
            if PUSH:
                push.push_rows(out, m, n, ym, push_slot, table, rank, region_stride, N, P)
            else:
                tl.store(y_ptr + m * sy + n, out, mask=ym)
        if PUSH:
            if push_slot > 0:
                push.clear_slot(push_slot - 1, M * N, table, rank, region_stride, P, dt, 1024)

    @triton.jit(do_not_specialize=["M", "push_slot"])
    def _rows_kernel(x_ptr, w_ptr, b_ptr, y_ptr, M, N, K, sx, sw, sy, push_slot, table, rank, region_stride,
                     BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, HAS_BIAS: tl.constexpr,
                     PUSH: tl.constexpr, P: tl.constexpr, STAGES: tl.constexpr, PREC: tl.constexpr,
                     GATED: tl.constexpr, EVEN_K: tl.constexpr):
        """Columns [n0, n0 + BLOCK_N) of y = x @ w^T (+ b) for M <= BLOCK_M rows: the program streams its BLOCK_N
        weight rows in BLOCK_K steps, STAGES deep, and sums over the rows on the tensor cores (tl.dot, fp32; fp32
        inputs at IEEE precision), the bias added in fp32, rounded once to y's dtype. PUSH: y is this rank's partial
        sums of a boundary, stored into every rank's inbox instead of y_ptr; the programs empty the boundary before
        it in this rank's inbox (as _gemv_kernel's). GATED (as _gemv_kernel's): w holds 2N rows, gate then up; the
        program streams the gate rows n and the up rows N + n in the same steps into two accumulators, and y [M, N]
        is silu_mul_sums of them."""
        prior_done()  # (backend.pdl: the kernels before this one have finished)
        n = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
        m = tl.arange(0, BLOCK_M)
        nm, mm = n < N, m < M
        acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
        acc_up = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)  # (GATED only; otherwise never touched)
        for k0 in tl.range(0, K, BLOCK_K, num_stages=STAGES):
            k = k0 + tl.arange(0, BLOCK_K)
            km = (k < K) | EVEN_K  # (EVEN_K: K a multiple of BLOCK_K, so only the loop-invariant masks remain)
            x = tl.load(x_ptr + m[:, None] * sx + k[None, :], mask=mm[:, None] & km[None, :], other=0.0)
            w = tl.load(w_ptr + n[:, None].to(tl.int64) * sw + k[None, :], mask=nm[:, None] & km[None, :], other=0.0)
            acc = tl.dot(x, tl.trans(w), acc, input_precision=PREC)
            if GATED:
                w_up = tl.load(w_ptr + (N + n)[:, None].to(tl.int64) * sw + k[None, :], mask=nm[:, None] & km[None, :],
                               other=0.0)
                acc_up = tl.dot(x, tl.trans(w_up), acc_up, input_precision=PREC)
        if HAS_BIAS:
            acc += tl.load(b_ptr + n, mask=nm, other=0.0).to(tl.float32)[None, :]
            if GATED:
                acc_up += tl.load(b_ptr + N + n, mask=nm, other=0.0).to(tl.float32)[None, :]
        dt = y_ptr.dtype.element_ty
        if GATED:
            out = silu_mul_sums(acc, acc_up, dt)
        else:
            out = acc.to(dt)
        ym = mm[:, None] & nm[None, :]
        if PUSH:
            push.push_rows(out, m[:, None], n[None, :], ym, push_slot, table, rank, region_stride, N, P)
            if push_slot > 0:
                push.clear_slot(push_slot - 1, M * N, table, rank, region_stride, P, dt, 1024)
        else:
            tl.store(y_ptr + m[:, None] * sy + n[None, :], out, mask=ym)

    @triton.jit
    def _skinny_gemm_kernel(x_ptr, w_ptr, y_ptr, part_ptr, arrive_ptr, M, N, K, sx, sw, sy, BLOCK_M: tl.constexpr,
                            BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, SPLIT: tl.constexpr, STAGES: tl.constexpr,
                            PREC: tl.constexpr):
        """Columns [n0, n0 + BLOCK_N) of y = x @ w^T for all M <= BLOCK_M rows, over share s = program_id(1) of the
        K steps: the program streams its BLOCK_N weight rows over that share once and accumulates in fp32 (tl.dot;
        fp32 inputs at IEEE precision). With SPLIT > 1 it stores its partial sum and counts itself in; the last of
        the block's SPLIT programs to arrive sums the partials in share order (the same bits whatever the order of
        arrival: no float atomics), rounds once to y's dtype, as cuBLAS does, and resets the counter. The results
        differ from F.linear by the order of the fp32 sums only."""
        prior_done()  # (backend.pdl: the kernels before this one have finished)
        pid_n, share = tl.program_id(0), tl.program_id(1)
        n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
        m = tl.arange(0, BLOCK_M)
        nm, mm = n < N, m < M
        steps = tl.cdiv(K, BLOCK_K)
        per_share = tl.cdiv(steps, SPLIT)
        acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
        for step in tl.range(share * per_share, tl.minimum(steps, (share + 1) * per_share), num_stages=STAGES):
            k = step * BLOCK_K + tl.arange(0, BLOCK_K)
            km = k < K
            x = tl.load(x_ptr + m[:, None] * sx + k[None, :], mask=mm[:, None] & km[None, :], other=0.0)
            w = tl.load(w_ptr + n[:, None].to(tl.int64) * sw + k[None, :], mask=nm[:, None] & km[None, :], other=0.0)
            acc = tl.dot(x, tl.trans(w), acc, input_precision=PREC)
        out = y_ptr + m[:, None] * sy + n[None, :]
        if SPLIT == 1:
            tl.store(out, acc.to(y_ptr.dtype.element_ty), mask=mm[:, None] & nm[None, :])
        else:
            cols = tl.num_programs(0) * BLOCK_N
            part = part_ptr + m[:, None] * cols + n[None, :]
            tl.store(part + share * BLOCK_M * cols, acc)
            tl.debug_barrier()  # every thread's partial stored before the count (release) publishes them
            if tl.atomic_add(arrive_ptr + pid_n, 1, sem="acq_rel") == SPLIT - 1:
                total = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
                for i in tl.static_range(SPLIT):
                    total += tl.load(part + i * BLOCK_M * cols, cache_modifier=".cg")
                tl.store(out, total.to(y_ptr.dtype.element_ty), mask=mm[:, None] & nm[None, :])
                tl.atomic_xchg(arrive_ptr + pid_n, 0)
