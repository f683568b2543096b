"""This rank's MoE expert weights: the Experts module (parameters and per-expert loading) and ExpertWeights, the
tensors every MoE kernel takes (the routed experts with the shared expert's shard, which shares their launches)."""
from __future__ import annotations

from typing import NamedTuple

import torch
from torch import nn

from dist import parallel
from layers import backend
from layers.linear import even_split, make_param
from layers.mlp import MLP


class ExpertWeights(NamedTuple):
    """This rank's expert weights: routed [num_local, 2I, H] / [num_local, H, I] for experts start.. and the shared
    expert's local shard [2 I_s, H] (gate rows then up rows) / [H, I_s]."""
    gate_up: torch.Tensor
    down: torch.Tensor
    start: int
    shared_gate_up: torch.Tensor
    shared_down: torch.Tensor


class Experts(nn.Module):
    """This rank's routed experts: parameters and per-expert loading.

    sync_free: True with the fast kernels (SparseMoE binds moe_fast, which never waits for the host), so CUDA graphs
    may capture it; the torch oracle reads per-expert counts on the host."""

    def __init__(self, num_experts: int, hidden: int, intermediate: int, dtype=None, device=None):
        super().__init__()
        self.start, self.num_local = even_split(num_experts, parallel.tp_rank(), parallel.tp_size())
        self.intermediate = intermediate
        local = [(self.start, self.num_local)]
        self.gate_up_proj = make_param((num_experts, 2 * intermediate, hidden), [local, None, None], dtype, device)
        self.down_proj = make_param((num_experts, hidden, intermediate), [local, None, None], dtype, device)
        self.sync_free = backend.use_fast()

    def load_expert(self, src, expert: int, proj: str) -> bool:
        """Load one per-expert tensor (`experts.{e}.{gate,up,down}_proj.weight`); False if not this rank's expert."""
        e = expert - self.start
        if not 0 <= e < self.num_local:
            return False
        I = self.intermediate
        if proj == "down_proj":
            target = self.down_proj.data[e]
        else:
            target = self.gate_up_proj.data[e, :I] if proj == "gate_proj" else self.gate_up_proj.data[e, I:]
        if tuple(src.shape) != tuple(target.shape):
            raise ValueError(f"tensor {src.name!r} in {src.file}: shape {tuple(src.shape)}, expected {tuple(target.shape)}")
        target.copy_(src.read((slice(None), slice(None))))
        return True

    def weights(self, shared: MLP) -> ExpertWeights:
        """This rank's experts with the shared expert's shard (it shares their launches)."""
        return ExpertWeights(self.gate_up_proj, self.down_proj, self.start, shared.gate_up, shared.down_proj.weight)
