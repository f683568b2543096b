"""The MoE GEMV path's gate_up at decode sizes: the per-token kernel (masked [k, BLOCK_N, BLOCK_K] tiles stepping
through H) against the slot-parallel one (a program per token, slot and N tile, whole rows at once), at the rank
shapes of TP=1, 2, 4, 8 (rank 0's experts; random weights, routing of random inputs), us per call from a CUDA graph
with L2 emptied before each call (benchmarks/tune_moe.py cold_graph_ms: a decode step streams GBs, so its MoE
weights come from HBM). `route` is the routing alone (route_fast: one program per token, the code every gate_up
program runs before it can load an expert's rows), for the share of the slot kernel's time its chain takes.

    python -m benchmarks.bench_gate_up_slots [--tp 1 2 4 8] [--batches 1 2 4 8]
"""
from __future__ import annotations

import argparse

import torch
import torch.nn.functional as F

from benchmarks.bench_moe import Layer, model_config
from benchmarks.tune_moe import cold_graph_ms as graph_ms
from layers import moe


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--tp", type=int, nargs="+", default=[1, 2, 4, 8])
    ap.add_argument("--batches", type=int, nargs="+", default=[1, 2, 4, 8])
    args = ap.parse_args()
    cfg = model_config()
    gen = torch.Generator(device="cuda").manual_seed(0)
    print(f"{torch.cuda.get_device_name()}: gate_up of the GEMV path, us per call (CUDA graph, L2 cold)")
    print(f"{'tp':>3} {'T':>3} {'per-token':>10} {'slots':>8} {'route':>6} {'down_combine':>13}")
    for tp in args.tp:
        layer = Layer(cfg, tp)
        for T in args.batches:
            x = torch.randn(T, layer.hidden, generator=gen, device="cuda").to(torch.bfloat16)
            logits = F.linear(x, layer.router)
            base = graph_ms(lambda: moe.gate_up_gemv_fast(x, logits, layer.top_k, layer.w, moe.GEMV_TILE))
            slots = graph_ms(lambda: moe.gate_up_gemv_fast(x, logits, layer.top_k, layer.w, dict(slots=True)))
            route = graph_ms(lambda: moe.route_fast(logits, layer.top_k))
            g = moe.gate_up_gemv_fast(x, logits, layer.top_k, layer.w)
            dc = graph_ms(lambda: moe.down_combine_fast(g.act, layer.w, g.inverse, g.ids, g.weights, g.shared_gate))
            print(f"{tp:3d} {T:3d} {base * 1e3:10.1f} {slots * 1e3:8.1f} {route * 1e3:6.1f} {dc * 1e3:13.1f}",
                  flush=True)


if __name__ == "__main__":
    main()
