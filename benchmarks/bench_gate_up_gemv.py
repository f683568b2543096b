"""The MoE GEMV path's gate_up at decode sizes: the per-token kernel (masked [k, BLOCK_N, BLOCK_K] tiles stepping
through H; its default tile, and the tuned table's choice `tuned`, 0 where the table takes the sorted layout's path)
against variants of the persistent one (G programs a token, each routing once, then the token's items of whole rows:
per_sm:BLOCK_N:num_stages), at the rank shapes of TP=1, 2, 4, 8 (rank 0's experts; random weights, routing of
random inputs), us per call from a CUDA graph with L2 emptied before each call (benchmarks/tune_moe.py
cold_graph_ms: a decode step streams GBs, so its MoE weights come from HBM). `route` is the routing alone
(route_fast, the code every gate_up program runs before it can load an expert's rows); `gate_up MB` the bytes of
rank 0's gate_up rows the tokens need.

    python -m benchmarks.bench_gate_up_gemv [--tp 1 2 4 8] [--batches 1 2 4 8] [--persistent 4:2:1 ...]
"""
from __future__ import annotations

import argparse
import json
import sys
import time

import torch
import torch.nn.functional as F

from benchmarks.bench_moe import Layer, model_config
from benchmarks.tune_moe import cold_graph_ms as graph_ms
from layers import moe


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--tp", type=int, nargs="+", default=[1, 2, 4, 8])
    ap.add_argument("--batches", type=int, nargs="+", default=[1, 2, 4, 8])
    ap.add_argument("--persistent", nargs="+", default=["4:2:1", "8:2:1", "8:1:1", "4:1:1", "4:2:2", "2:0:1"],
                    help="persistent variants per_sm:BLOCK_N:num_stages (BLOCK_N 0: the default)")
    ap.add_argument("--json", default=None, help="write the rows here")
    args = ap.parse_args()
    variants = [dict(zip(("per_sm", "BLOCK_N", "num_stages"), map(int, v.split(":"))), persistent=True)
                for v in args.persistent]
    cfg = model_config()
    gen = torch.Generator(device="cuda").manual_seed(0)
    print(f"{torch.cuda.get_device_name()}: gate_up of the GEMV path, us per call (CUDA graph, L2 cold)")
    print(f"{'tp':>3} {'T':>3} {'per-token':>10} {'tuned':>6} "
          + " ".join(f"{'p' + v:>8}" for v in args.persistent) + f" {'route':>6} {'down_combine':>13} {'gate_up MB':>11}")
    out = {"device": torch.cuda.get_device_name(), "date": time.strftime("%Y-%m-%d"), "units": "us per call",
           "command": "python -m benchmarks.bench_gate_up_gemv " + " ".join(sys.argv[1:]), "rows": []}
    for tp in args.tp:
        layer = Layer(cfg, tp)
        for T in args.batches:
            x = torch.randn(T, layer.hidden, generator=gen, device="cuda").to(torch.bfloat16)
            logits = F.linear(x, layer.router)
            base = graph_ms(lambda: moe.gate_up_gemv_fast(x, logits, layer.top_k, layer.w, moe.GEMV_TILE))
            persistent = [graph_ms(lambda: moe.gate_up_gemv_fast(x, logits, layer.top_k, layer.w,
                                                                 dict(v, BLOCK_N=v["BLOCK_N"] or None)))
                          for v in variants]
            tile = moe.config_for(x, layer.w)["gemv"]
            tuned = graph_ms(lambda: moe.gate_up_gemv_fast(x, logits, layer.top_k, layer.w, tile)) if tile else 0
            route = graph_ms(lambda: moe.route_fast(logits, layer.top_k))
            g = moe.gate_up_gemv_fast(x, logits, layer.top_k, layer.w)
            hit = torch.unique(g.ids[g.inverse.view(g.ids.shape) >= 0]).numel()
            mb = (hit * layer.w.gate_up[0].numel() + layer.w.shared_gate_up.numel()) * 2 / 1e6
            dc = graph_ms(lambda: moe.down_combine_fast(g.act, layer.w, g.inverse, g.ids, g.weights, g.shared_gate))
            print(f"{tp:3d} {T:3d} {base * 1e3:10.1f} {tuned * 1e3:6.1f} "
                  + " ".join(f"{p * 1e3:8.1f}" for p in persistent) + f" "
                  f"{route * 1e3:6.1f} {dc * 1e3:13.1f} {mb:11.1f}",
                  flush=True)
            out["rows"].append({"tp": tp, "T": T, "per_token": round(base * 1e3, 2), "tuned": round(tuned * 1e3, 2),
                                **{f"p{v}": round(p * 1e3, 2) for v, p in zip(args.persistent, persistent)},
                                "route": round(route * 1e3, 2), "down_combine": round(dc * 1e3, 2),
                                "gate_up_MB": round(mb, 2)})
    if args.json:
        with open(args.json, "w") as f:
            json.dump(out, f, indent=1)


if __name__ == "__main__":
    main()
