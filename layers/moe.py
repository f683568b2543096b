"""Sparse MoE block (spec §5): softmax router over all experts, top-k renormalised, routed experts + a shared expert
scaled by a per-token sigmoid gate.

TP split: expert parallel. Rank r owns a contiguous block of E/tp experts (fused [E, 2I, H] / [E, H, I] tensors are
sliced on dim 0) and adds the contributions of its experts only; the router is replicated so every rank routes
identically. The shared expert is split by its intermediate dimension (an even share of its work on every rank,
rather than a replica computed on one). The caller's all-reduce sums the partial outputs.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from dist import parallel
from layers.linear import Linear, even_split, make_param
from layers.mlp import MLP


def grouped_mm_supported(device: torch.device, dtype: torch.dtype) -> bool:
    """Grouped GEMMs on Hopper GPUs in bf16. The CPU keeps forward_loop: its torch._grouped_mm exists only from
    torch 2.9 and is itself a loop of per-group matmuls with a host sync each (measured within ~15% of forward_loop)."""
    return (hasattr(torch, "_grouped_mm") and device.type == "cuda" and dtype == torch.bfloat16
            and torch.cuda.get_device_capability(device)[0] >= 9)


def use_grouped_mm(x: torch.Tensor) -> bool:
    return grouped_mm_supported(x.device, x.dtype)


class Experts(nn.Module):
    def __init__(self, num_experts: int, hidden: int, intermediate: int, dtype=None, device=None):
        super().__init__()
        self.start, self.num_local = even_split(num_experts, parallel.tp_rank(), parallel.tp_size())
        self.intermediate = intermediate
        local = [(self.start, self.num_local)]
        self.gate_up_proj = make_param((num_experts, 2 * intermediate, hidden), [local, None, None], dtype, device)
        self.down_proj = make_param((num_experts, hidden, intermediate), [local, None, None], dtype, device)

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

    def forward(self, x: torch.Tensor, topk_ids: torch.Tensor, topk_weights: torch.Tensor) -> torch.Tensor:
        """Sum over this rank's experts of weight * expert(x), accumulated in fp32. x: [T, H]; topk_*: [T, k]."""
        if use_grouped_mm(x):
            return self.forward_grouped(x, topk_ids, topk_weights)
        return self.forward_loop(x, topk_ids, topk_weights)

    def forward_grouped(self, x: torch.Tensor, topk_ids: torch.Tensor, topk_weights: torch.Tensor) -> torch.Tensor:
        """All local experts in two grouped GEMMs, with no host sync (CUDA-graph safe).

        (token, expert) entries are sorted by local expert; entries of other ranks' experts get the sentinel group
        num_local, sort last, lie past the last group offset (rows the grouped GEMM leaves unwritten) and are
        zeroed before the scatter."""
        T, k = topk_ids.shape
        local = topk_ids.flatten() - self.start
        valid = (local >= 0) & (local < self.num_local)
        group = torch.where(valid, local, self.num_local)
        order = torch.argsort(group, stable=True)
        counts = torch.zeros(self.num_local + 1, dtype=torch.int32, device=x.device)
        counts.scatter_add_(0, group, torch.ones_like(group, dtype=torch.int32))
        offs = counts[: self.num_local].cumsum(0, dtype=torch.int32)
        tokens = order // k
        h = torch._grouped_mm(x[tokens], self.gate_up_proj.transpose(1, 2), offs=offs)
        gate, up = h.chunk(2, dim=-1)
        y = torch._grouped_mm(F.silu(gate) * up, self.down_proj.transpose(1, 2), offs=offs)
        w = topk_weights.flatten()[order]
        y = torch.where(valid[order, None], y * w[:, None], 0).float()
        return torch.zeros(T, x.shape[1], dtype=torch.float32, device=x.device).index_add_(0, tokens, y)

    def forward_loop(self, x: torch.Tensor, topk_ids: torch.Tensor, topk_weights: torch.Tensor) -> torch.Tensor:
        """Reference: one expert at a time (needs the per-expert counts on the host)."""
        T, k = topk_ids.shape
        out = torch.zeros(T, x.shape[1], dtype=torch.float32, device=x.device)
        local = topk_ids.flatten() - self.start
        mine = (local >= 0) & (local < self.num_local)
        entry = mine.nonzero().squeeze(1)
        if entry.numel() == 0:
            return out
        experts = local[entry]
        order = torch.argsort(experts, stable=True)
        entry, experts = entry[order], experts[order]
        counts = torch.bincount(experts, minlength=self.num_local).tolist()
        tokens = entry // k
        weights = topk_weights.flatten()[entry]
        offset = 0
        for e, n in enumerate(counts):
            if n == 0:
                continue
            tok = tokens[offset: offset + n]
            gate, up = F.linear(x[tok], self.gate_up_proj[e]).chunk(2, dim=-1)
            y = F.linear(F.silu(gate) * up, self.down_proj[e]) * weights[offset: offset + n, None]
            out.index_add_(0, tok, y.float())
            offset += n
        return out


class SparseMoE(nn.Module):
    def __init__(self, cfg, dtype=None, device=None):
        super().__init__()
        H = cfg.hidden_size
        self.top_k = cfg.num_experts_per_tok
        self.gate = Linear(H, cfg.num_experts, dtype=dtype, device=device)          # router, replicated
        self.experts = Experts(cfg.num_experts, H, cfg.moe_intermediate_size, dtype=dtype, device=device)
        self.shared_expert = MLP(H, cfg.shared_expert_intermediate_size, dtype=dtype, device=device)
        self.shared_expert_gate = Linear(H, 1, dtype=dtype, device=device)           # replicated

    def route(self, x: torch.Tensor):
        logits = self.gate(x)                                # model dtype, as the reference rounds them
        probs = torch.softmax(logits, dim=-1, dtype=torch.float32)
        weights, ids = torch.topk(probs, self.top_k, dim=-1)
        weights = weights / weights.sum(dim=-1, keepdim=True)
        return ids, weights.to(x.dtype)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        ids, weights = self.route(x)
        routed = self.experts(x, ids, weights)
        shared = torch.sigmoid(self.shared_expert_gate(x)) * self.shared_expert(x)
        return (routed + shared.float()).to(x.dtype)
