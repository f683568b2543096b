"""The sparse MoE block: moe_torch (the oracle) and moe_fast, and the SparseMoE module that binds one of them.

moe_fast picks its kernels by T alone. Prefill (T > DECODE_MAX_T) is the router GEMM, _route_kernel and the
grouped kernels on the chunked layout (layers/moe/grouped.py): 8 dependent launches per layer, where the grouped
kernels stream each expert's weights once for all its tokens. At decode sizes the launches, not the bytes, are the
cost (more so at TP=8, where a rank's expert bytes shrink 8x), so decode_path runs 3 on the GEMV path (up to
GEMV_MAX_T tokens without a table; the tuned table says per bucket), else 5 (or 6):

    router GEMM           logits [T, E + 1]: the GEMV kernel, or the skinny one (router_logits_fast)
    _gate_up_gemv_kernel  (GEMV path) per (token, N tile): the token's routing and its experts' gate|up rows, then
                          _down_combine_kernel (layers/moe/gemv.py)
    _route_kernel         one program per token
    _align_kernel         one program: the sorted layout
    _gate_up_kernel       on that layout
    _down_combine_kernel  (few tokens) per (token, N tile): the token's routed experts and the shared expert's in one
                          software-pipelined loop; else _down_kernel + _combine_kernel. The tuned table says which,
                          per bucket of T and rank shape (DOWN_COMBINE_MAX_T without a table)

or, where the tuned table has a "scan" entry, 4 (or 5) with no sorted layout (layers/moe/scan.py): router GEMM,
_route_kernel, _gate_up_scan_kernel (a program per expert and N tile, finding its pairs in the routing), then
_down_combine_kernel or _down_scan_kernel + _combine_kernel. At the TP=4 rank shape and 32 tokens it took 85.7 us
against 89.0 on the GEMV path and 93.6 on the sorted layout (1x H200, L2 cold, benchmarks/tune_moe.py, 2026-11-27):
each expert's weights read once, as the sorted layout's kernels do, without the align launch. The last kernel
pushes the layer boundary's partial sums (dist/push.py) where the inbox takes them.

Fewer launches measured slower (1x H200, python -m benchmarks.bench_moe --tp 1 --decode-only, in CUDA graphs):
routing and layout in one program (one launch less) took 26 us at T = 1..16 and 88 us at T = 64, where
_route_kernel + _align_kernel take 8-10 us, as one program's reductions over [16, 256] tiles serialise
(2026-11-24); a front kernel that folded the router GEMM in too took ~32 us against 11-19 us for the three
launches (2026-11-23) and was removed.
"""
from __future__ import annotations

import torch
from torch import nn

from dist import push
from layers import backend
from layers.linear import Linear, computed, fuse_rows
from layers.mlp import MLP
from layers.moe.experts import ExpertWeights, Experts
from layers.moe.gemv import down_combine_fast, gate_up_gemv_fast
from layers.moe.grouped import combine_fast, experts_fast, experts_on_layout, experts_torch
from layers.moe.layout import align_fast
from layers.moe.routing import ROUTER_PAD_ROWS, route_fast, route_torch, router_logits_fast, router_logits_torch
from layers.moe.scan import down_scan_fast, gate_up_scan_fast
from layers.moe.tiles import DECODE_MAX_T, config_for, token_buckets


def moe_torch(x: torch.Tensor, router: torch.Tensor, top_k: int, w: ExpertWeights,
              partial: bool = False) -> torch.Tensor:
    """The block's oracle: router GEMM (model dtype, as the reference rounds the logits), route_torch, experts_torch.
    (partial: the output is a layer boundary's partial sums; the caller's boundary all-reduces them.)"""
    return experts_torch(x, *route_torch(router_logits_torch(x, router), top_k), w)


def moe_fast(x: torch.Tensor, router: torch.Tensor, top_k: int, w: ExpertWeights,
             partial: bool = False) -> torch.Tensor | push.Pushed:
    """moe_torch without host syncs: decode_path up to DECODE_MAX_T tokens, else the router GEMM, route_fast and
    experts_fast (the chunked layout and the grouped kernels). partial: where the inbox takes the output (TP > 1,
    decode and verify sizes), it is pushed to every rank (dist/push.py) and a Pushed is returned."""
    if x.shape[0] <= DECODE_MAX_T:
        return decode_path(x, router, top_k, w, partial=partial)
    x = computed(x)
    return experts_fast(x, *route_fast(router_logits_fast(x, router), top_k), w, partial=partial)


def decode_path(x: torch.Tensor, router: torch.Tensor, top_k: int, w: ExpertWeights,
                down_combine: bool | None = None, gemv: bool | None = None, scan: bool | None = None,
                partial: bool = False, cfg: dict | None = None):
    """moe_fast's kernels up to DECODE_MAX_T tokens, as the tile table chooses them, or as the caller forces them
    (tests and benchmarks/bench_moe.py take every path):
    - the GEMV path (gemv; by default where the config has a gemv tile): router GEMM, gate_up_gemv_fast,
      down_combine_fast;
    - the scan path (scan; by default where the config has a scan entry): router GEMM, route_fast,
      gate_up_scan_fast, then down_combine_fast or down_scan_fast + combine_fast (the entry's "down" tile, or
      down_combine's where it has none; down_combine forces);
    - else the sorted layout's: router GEMM, route_fast, align_fast, experts_on_layout (down + combine in one
      kernel or two as down_combine forces or the config says).
    The last kernel pushes where `partial` and the inbox takes the output. cfg: the tiles and paths to run
    (tiles.entry_config; a benchmark comparing two tables' entries), else the table's for this T."""
    if x.shape[0] == 0:
        return torch.empty_like(computed(x))
    cfg = cfg or config_for(x, w)
    if cfg["gemv"] is not None if gemv is None else gemv:
        logits = router_logits_fast(x, router)  # first: its GEMV computes a PendingNorm x, which gate_up reads
        g = gate_up_gemv_fast(computed(x).contiguous(), logits, top_k, w, cfg["gemv"])
        return down_combine_fast(g.act, w, g.inverse, g.ids, g.weights, g.shared_gate, cfg["down_combine"],
                                 partial=partial)
    logits = router_logits_fast(x, router)
    x = computed(x).contiguous()
    ids, weights, shared_gate = route_fast(logits, top_k)
    if cfg["scan"] is not None if scan is None else scan:
        tiles = cfg["scan"] or {"gate_up": None, "down": None}
        g = gate_up_scan_fast(x, ids, weights, shared_gate, w, tiles["gate_up"])
        if tiles["down"] is None if down_combine is None else down_combine:
            return down_combine_fast(g.act, w, g.inverse, ids, weights, shared_gate, cfg["down_combine"],
                                     partial=partial)
        y = down_scan_fast(g.act, w, g.inverse, ids, weights, shared_gate, tiles["down"])
        return combine_fast(y, g.inverse, x.shape[0], partial)
    layout = align_fast(ids, w.start, w.gate_up.shape[0], cfg["BLOCK_M"])
    return experts_on_layout(x, w, layout, ids, weights, shared_gate, cfg, down_combine, partial)


class SparseMoE(nn.Module):
    def __init__(self, cfg, dtype=None, device=None):
        super().__init__()
        H = cfg.hidden_size
        self.top_k = cfg.num_experts_per_tok
        self.gate = Linear(H, cfg.num_experts, dtype=dtype, device=device)          # router, replicated
        self.experts = Experts(cfg.num_experts, H, cfg.moe_intermediate_size, dtype=dtype, device=device)
        self.shared_expert = MLP(H, cfg.shared_expert_intermediate_size, dtype=dtype, device=device)
        self.shared_expert_gate = Linear(H, 1, dtype=dtype, device=device)           # replicated
        self.router = fuse_rows(self.gate, self.shared_expert_gate,                 # [E + 1, H]: one GEMM
                                pad_rows_to=ROUTER_PAD_ROWS)
        self.sync_free = self.experts.sync_free
        self._moe = moe_fast if backend.use_fast() else moe_torch

    def forward(self, x: torch.Tensor) -> torch.Tensor | push.Pushed:
        """Routed experts + sigmoid(shared gate) * shared expert, in the model dtype: this rank's partial sums of the
        layer boundary after it (a Pushed where they went by push, dist/push.py)."""
        return self._moe(x, self.router, self.top_k, self.experts.weights(self.shared_expert), partial=True)

    def token_buckets(self, max_tokens: int) -> list[int]:
        """The token counts up to max_tokens at which this layer's tiles may change (tiles.token_buckets)."""
        return token_buckets(max_tokens, self.experts.weights(self.shared_expert), self.router.device)
