"""Linear layers with tensor-parallel shards, and the weight loader that fills any shard from a checkpoint tensor.

Every parameter carries `full_shape` (its shape in the checkpoint) and `shard` (per dim: None for the whole dim, or a
list of (start, size) ranges of the full dim that this rank keeps, concatenated in order). The loader reads exactly
those ranges through a lazy checkpoint slice, so a rank never touches bytes it does not own.

    linear_torch  F.linear (cuBLAS on the GPU), the oracle
    linear_fast   the same, except at decode batch sizes (M <= SKINNY_MAX_M rows): one Triton launch in which each
                  program owns a slice of the output columns and the whole reduction dimension. cuBLAS runs these
                  skinny shapes (the out projections: [M x 4096] @ [4096 x 2048] at TP=1) as split-K, two
                  launches (the GEMM, then a reduction kernel); here no split, no float atomics, one launch.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from dist import parallel
from layers import backend
from layers.backend import tl, triton

# linear_fast's threshold (rows of the input) and launch settings, from shapes only (a CUDA graph holds them); module
# level so that the benchmark can sweep them. block_n: output columns per program (the weight rows it streams, whole
# K each); block_k: the reduction step, loads pipelined `stages` deep.
SKINNY_MAX_M = 16
SKINNY_CONFIG = {"block_n": 16, "block_k": 256, "warps": 4, "stages": 4}

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
    (DeltaNet out_proj, attention o_proj); the kernel set binds linear_torch or linear_fast."""

    def __init__(self, in_features: int, out_features: int, *, rows: Ranges = None, cols: Ranges = None,
                 bias: bool = False, dtype=None, device=None):
        super().__init__()
        self.weight = make_param((out_features, in_features), [rows, cols], dtype, device)
        self.bias = make_param((out_features,), [rows], dtype, device) if bias else None
        self.adds_bias = bias and (cols is None or parallel.tp_rank() == 0)
        self._linear = linear_fast if backend.use_fast() else linear_torch

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self._linear(x, self.weight, self.bias if self.adds_bias else None)


def linear_torch(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    return F.linear(x, weight, bias)


def linear_fast(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """x [..., K] @ weight[N, K]^T (+ bias) -> [..., N] in x's dtype: the skinny kernel for 1..SKINNY_MAX_M rows
    without a bias, F.linear otherwise (and for a weight whose rows are not contiguous)."""
    N, K = weight.shape
    if x.shape[-1] != K:
        raise ValueError(f"linear: input has {x.shape[-1]} features, the weight {tuple(weight.shape)} expects {K}")
    M = x.numel() // K if K else 0
    if not 0 < M <= SKINNY_MAX_M or weight.stride(1) != 1 or x.dtype != weight.dtype or bias is not None:
        return F.linear(x, weight, bias)
    x2 = x.reshape(M, K)
    if x2.stride(1) != 1:
        x2 = x2.contiguous()
    y = torch.empty(M, N, dtype=x.dtype, device=x.device)
    cfg = SKINNY_CONFIG
    block_n = max(16, min(cfg["block_n"], triton.next_power_of_2(N)))
    block_k = max(16, min(cfg["block_k"], triton.next_power_of_2(K)))
    _skinny_gemm_kernel[(triton.cdiv(N, block_n),)](
        x2, weight, y, M, N, K, x2.stride(0), weight.stride(0), y.stride(0),
        BLOCK_M=16, BLOCK_N=block_n, BLOCK_K=block_k, STAGES=cfg["stages"],
        PREC="ieee" if x.dtype == torch.float32 else "tf32", num_warps=cfg["warps"])
    return y.view(*x.shape[:-1], N)


def fuse_rows(*linears: Linear, attr: str = "weight", pad_rows_to: int = 1) -> torch.Tensor:
    """One [sum of outputs, in] weight (or with attr="bias" one [sum of outputs] bias) for linears that read the
    same input, so one GEMM computes them all. With pad_rows_to > 1 the buffer holds zero rows up to a multiple of
    it after the last linear's, and the returned tensor is the leading [sum of outputs] rows of that buffer (see
    moe.router_logits, which runs its GEMM over the padded rows).

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
    @triton.jit
    def _skinny_gemm_kernel(x_ptr, w_ptr, y_ptr, M, N, K, sx, sw, sy, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                            BLOCK_K: tl.constexpr, STAGES: tl.constexpr, PREC: tl.constexpr):
        """Columns [n0, n0 + BLOCK_N) of y = x @ w^T for all M <= BLOCK_M rows: the program streams its BLOCK_N weight
        rows over the whole K once, accumulates in fp32 (tl.dot; fp32 inputs at IEEE precision) and rounds once to
        y's dtype, as cuBLAS does, so the results differ from F.linear by the order of the fp32 sums only."""
        n = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
        m = tl.arange(0, BLOCK_M)
        nm, mm = n < N, m < M
        acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
        for k0 in tl.range(0, K, BLOCK_K, num_stages=STAGES):
            k = k0 + tl.arange(0, BLOCK_K)
            km = k < K
            x = tl.load(x_ptr + m[:, None] * sx + k[None, :], mask=mm[:, None] & km[None, :], other=0.0)
            w = tl.load(w_ptr + n[:, None].to(tl.int64) * sw + k[None, :], mask=nm[:, None] & km[None, :], other=0.0)
            acc = tl.dot(x, tl.trans(w), acc, input_precision=PREC)
        tl.store(y_ptr + m[:, None] * sy + n[None, :], acc.to(y_ptr.dtype.element_ty), mask=mm[:, None] & nm[None, :])
