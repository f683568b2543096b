"""Linear layers with tensor-parallel shards, and the weight loader that fills any shard from a checkpoint tensor.

Every parameter carries `full_shape` (its shape in the checkpoint) and `shard` (per dim: None for the whole dim, or a
list of (start, size) ranges of the full dim that this rank keeps, concatenated in order). The loader reads exactly
those ranges through a lazy checkpoint slice, so a rank never touches bytes it does not own.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from dist import parallel

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
    so every rank holds the whole bias and only rank 0 adds it)."""

    def __init__(self, in_features: int, out_features: int, *, rows: Ranges = None, cols: Ranges = None,
                 bias: bool = False, dtype=None, device=None):
        super().__init__()
        self.weight = make_param((out_features, in_features), [rows, cols], dtype, device)
        self.bias = make_param((out_features,), [rows], dtype, device) if bias else None
        self.adds_bias = bias and (cols is None or parallel.tp_rank() == 0)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(x, self.weight, self.bias if self.adds_bias else None)


def fuse_rows(*linears: Linear, attr: str = "weight") -> torch.Tensor:
    """One [sum of outputs, in] weight (or with attr="bias" one [sum of outputs] bias) for linears that read the
    same input, so one GEMM computes them all.

    Each linear's parameter becomes a view of its rows of the fused tensor (same name, full_shape and shard), so the
    loader and the dummy initialiser still fill each one by its checkpoint name, and no memory is duplicated."""
    first = getattr(linears[0], attr)
    rows = sum(getattr(lin, attr).shape[0] for lin in linears)
    fused = torch.empty(rows, *first.shape[1:], dtype=first.dtype, device=first.device)
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
