"""Sparse MoE block (spec §5): softmax router over all experts, top-k renormalised, routed experts + a shared expert
scaled by a per-token sigmoid gate.

TP split: by the intermediate dimension, routed and shared experts alike. Rank r holds 1/tp of every expert's
intermediate rows (fused [E, 2I, H] / [E, H, I] tensors are sliced on dims 1 and 2: experts.py says why), so every
rank computes every chosen expert's partial product, the same work whatever the routing. The router is replicated so
every rank routes identically. The caller's all-reduce sums the partial outputs. (The kernels also take a block of
whole experts per rank, `ExpertWeights.start`: pairs routed elsewhere are dropped.)

The router and the shared-expert gate read the same input: their weights live in one [E + 1, H] tensor (fuse_rows),
so one GEMM gives the logits [T, E + 1] (column E is the shared gate's). Two implementations of the block
(layers/backend.py), bound once when the layer is built: moe_torch (the oracle) and moe_fast. One file per concern:

    experts.py  this rank's expert weights: Experts (parameters, loading), ExpertWeights (what the kernels take)
    routing.py  router_logits_torch / _fast (the GEMM), route_torch / route_fast (softmax, top-k, renormalise)
    layout.py   align_torch / align_fast: each rank's (token, slot) pairs grouped by expert, the sorted layout
    grouped.py  experts_torch / experts_fast: the grouped (prefill) kernels on that layout, each step a pair too
                (gate_up_, down_, combine_ torch / fast)
    gemv.py     gate_up_gemv_torch / _fast, down_combine_torch / _fast: the decode kernels, a program per token
    scan.py     gate_up_scan_torch / _fast, down_scan_torch / _fast: decode kernels a program per expert, each
                finding its pairs in the routing (no sorted layout)
    tiles.py    tiles and path choices per bucket of T (layers/moe_configs.json, else defaults)
    block.py    moe_torch, moe_fast (which kernels, by T) and the SparseMoE module

The package re-exports its files' public names (`from layers import moe; moe.route_fast`); a test that patches a
module-level name patches the file that reads it (layers.moe.layout.ALIGN_CHUNKS).

The choices depend on shapes only, at power-of-two boundaries: a decode batch padded for a CUDA graph never crosses
the next power of two, so the padded batch takes the same kernels and gives the same bits as the batch run eagerly.
No kernel uses floating-point atomics: every output is bitwise deterministic.

The router GEMM, the kernels' tiles and the fp32 accumulation differ from the oracle's only in rounding; the fast
kernels round to the model dtype where the oracle does (GEMM outputs, silu, the products with the weights).
"""
from layers.moe.block import SparseMoE, decode_path, moe_fast, moe_torch
from layers.moe.experts import ExpertWeights, Experts
from layers.moe.gemv import (GemvAct, down_combine_fast, down_combine_torch, gate_up_gemv_fast, gate_up_gemv_torch,
                             pair_rows_torch)
from layers.moe.grouped import (combine_fast, combine_torch, down_fast, down_torch, experts_fast, experts_on_layout,
                                experts_torch, gate_up_fast, gate_up_torch)
from layers.moe.layout import (ALIGN_CHUNKS, ALIGN_SERIAL_MAX_T, Layout, align_chunk, align_chunked, align_fast,
                               align_serial, align_torch, max_rows)
from layers.moe.routing import (ROUTER_GEMV_MAX_T, ROUTER_PAD_ROWS, padded_router_gemm, route_fast, route_torch,
                                router_logits_fast, router_logits_torch)
from layers.moe.scan import (SCAN_DOWN_TILE, SCAN_GATE_UP_TILE, down_scan_fast, down_scan_torch, gate_up_scan_fast,
                             gate_up_scan_torch)
from layers.moe.tiles import (CONFIG_FILE, DECODE_MAX_T, DOWN_COMBINE_MAX_T, DOWN_COMBINE_TILE, GEMV_MAX_T, GEMV_TILE,
                              config_for, config_key, default_config, entry_config, moe_config, token_buckets)

__all__ = ["SparseMoE", "decode_path", "moe_fast", "moe_torch", "ExpertWeights", "Experts", "GemvAct",
           "down_combine_fast", "down_combine_torch", "gate_up_gemv_fast", "gate_up_gemv_torch", "pair_rows_torch",
           "SCAN_DOWN_TILE", "SCAN_GATE_UP_TILE", "down_scan_fast", "down_scan_torch", "gate_up_scan_fast",
           "gate_up_scan_torch",
           "combine_fast", "combine_torch", "down_fast", "down_torch", "experts_fast", "experts_on_layout",
           "experts_torch", "gate_up_fast", "gate_up_torch", "ALIGN_CHUNKS", "ALIGN_SERIAL_MAX_T", "Layout",
           "align_chunk", "align_chunked", "align_fast", "align_serial", "align_torch", "max_rows", "ROUTER_GEMV_MAX_T",
           "ROUTER_PAD_ROWS", "padded_router_gemm", "route_fast", "route_torch", "router_logits_fast",
           "router_logits_torch", "CONFIG_FILE", "DECODE_MAX_T", "DOWN_COMBINE_MAX_T", "DOWN_COMBINE_TILE",
           "GEMV_MAX_T", "GEMV_TILE", "config_for", "config_key", "default_config", "entry_config", "moe_config",
           "token_buckets"]
