"""This rank's MoE expert weights: the Experts module (parameters and per-expert loading) and ExpertWeights, the
tensors every MoE kernel takes (the routed experts with the shared expert's shard, which shares their launches)."""
from __future__ import annotations

from typing import NamedTuple

import torch
from torch import nn

from dist import parallel
from layers import backend
from layers.linear import even_split, make_param, read_shard
from layers.mlp import MLP


class ExpertWeights(NamedTuple):
    """This rank's expert weights: routed [num_local, 2I, H] / [num_local, H, I] for experts start.. (gate rows then
    up rows) and the shared expert's local shard [2 I_s, H] / [H, I_s]. The kernels take any split: Experts gives
    every rank all experts (start 0) and an even share I of each one's intermediate dimension."""
    gate_up: torch.Tensor
    down: torch.Tensor
    start: int
    shared_gate_up: torch.Tensor
    shared_down: torch.Tensor


class Experts(nn.Module):
    """This rank's routed experts: parameters and per-expert loading.

    The TP split is by each expert's intermediate dimension, as the shared expert's (layers/mlp.py MLP): rank r holds
    rows [r I/tp, (r + 1) I/tp) of every expert's gate and up projections and those columns of its down projection.
    Every rank then reads the same bytes for any routing. Split by expert instead (E/tp whole experts per rank), the
    ranks' loads follow the routing (at batch 1 a rank holds 0-8 of the 8 chosen experts, 2 on average at TP=4) and
    the layer boundary after the MoE waits for the busiest rank.

    sync_free: True with the fast kernels (SparseMoE binds moe_fast, which never waits for the host), so CUDA graphs
    may capture it; the torch oracle reads per-expert counts on the host."""

    def __init__(self, num_experts: int, hidden: int, intermediate: int, dtype=None, device=None):
        super().__init__()
        self.start, self.num_local = 0, num_experts
        i0, size = even_split(intermediate, parallel.tp_rank(), parallel.tp_size())
        self.rows = [(i0, size)]  # of each expert's gate (and up) projection; the down projection's columns
        self.gate_up_proj = make_param((num_experts, 2 * intermediate, hidden),
                                       [None, [(i0, size), (intermediate + i0, size)], None], dtype, device)
        self.down_proj = make_param((num_experts, hidden, intermediate), [None, None, self.rows], dtype, device)
        self.sync_free = backend.use_fast()

    def load_expert(self, src, expert: int, proj: str) -> None:
        """Load this rank's share of one per-expert tensor (`experts.{e}.{gate,up,down}_proj.weight`: [I, H] or
        [H, I]); every rank holds every expert."""
        if not 0 <= expert < self.num_local:
            raise ValueError(f"tensor {src.name!r} in {src.file}: expert {expert}, but the model has {self.num_local} "
                             "(is the config right for this checkpoint?)")
        hidden, size = self.down_proj.shape[1], self.rows[0][1]
        I = self.gate_up_proj.full_shape[1] // 2
        if proj == "down_proj":
            target, full, shard = self.down_proj.data[expert], (hidden, I), [None, self.rows]
        else:
            half = slice(0, size) if proj == "gate_proj" else slice(size, 2 * size)
            target, full, shard = self.gate_up_proj.data[expert, half], (I, hidden), [self.rows, None]
        if tuple(src.shape) != full:
            raise ValueError(f"tensor {src.name!r} in {src.file}: shape {tuple(src.shape)}, expected {full}")
        target.copy_(read_shard(src, shard))

    def weights(self, shared: MLP) -> ExpertWeights:
        """This rank's experts with the shared expert's shard (it shares their launches)."""
        return ExpertWeights(self.gate_up_proj, self.down_proj, self.start, shared.gate_up, shared.down_proj.weight)
