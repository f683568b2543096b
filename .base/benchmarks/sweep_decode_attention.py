"""Sweep the paged decode attention kernel's launch settings per head shape (issue #29: the fast decode for any head
dim and GQA ratio), L2 cold, from CUDA graphs, as decode steps run it.

    python -m benchmarks.sweep_decode_attention [--shapes 32/8x64,24/8x128,16/2x256] [--batches 1,8,32,64]
        [--context 1024] [--json out.json]

A shape is query heads / KV heads x head dim (Llama-3.2-1B, Llama-3.2-3B, Qwen3.5-35B-A3B at TP=1). Per shape and
batch: the current setting (layers/attention.py) and every (tile, warps, stages, programs per SM) of the grid, in us
per call, with GB/s of K/V read; the best per row and the best single setting per shape (the sum over batches).
"""
from __future__ import annotations

import argparse
import itertools
import json
import time

import torch

from benchmarks.tune_moe import cold_graph_ms
from layers import attention as A

GRID = dict(tile=[16, 32, 64, 128], warps=[4, 8], stages=[2, 3, 4], per_sm=[1, 2, 4])




def case(batch: int, heads: int, kv: int, dim: int, context: int, block_size: int = 16):
    dev = torch.device("cuda")
    nblk = -(-context // block_size)
    gen = torch.Generator(device=dev).manual_seed(0)
    q = torch.randn(batch, heads, dim, device=dev, generator=gen).to(torch.bfloat16)
    k = torch.randn(batch * nblk + 1, block_size, kv, dim, device=dev, generator=gen).to(torch.bfloat16)
    v = torch.randn_like(k)
    tables = torch.randperm(batch * nblk, device=dev, generator=gen).view(batch, nblk).int()
    lens = torch.full((batch,), context, dtype=torch.int32, device=dev)
    return q, k, v, tables, lens


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--shapes", default="32/8x64,24/8x128,16/2x256")
    ap.add_argument("--batches", default="1,8,32,64")
    ap.add_argument("--context", type=int, default=1024)
    for name, default in GRID.items():
        ap.add_argument(f"--{name.replace('_', '-')}", default=",".join(map(str, default)),
                        help=f"grid values (default {default})")
    ap.add_argument("--json")
    args = ap.parse_args()
    grid = {name: [int(x) for x in getattr(args, name).split(",")] for name in GRID}
    batches = [int(b) for b in args.batches.split(",")]
    out = {"device": torch.cuda.get_device_name(), "date": time.strftime("%Y-%m-%d"), "context": args.context,
           "command": "python -m benchmarks.sweep_decode_attention " + " ".join(
               f"--{k.replace('_', '-')} {v}" for k, v in vars(args).items() if v is not None and k != "json"),
           "shapes": []}
    settings = [dict(zip(grid, v)) for v in itertools.product(*grid.values())]
    for shape in args.shapes.split(","):
        hk, dim = shape.split("x")
        heads, kv = (int(x) for x in hk.split("/"))
        dim = int(dim)
        rows, totals = [], {}
        for b in batches:
            q, k, v, tables, lens = case(b, heads, kv, dim, args.context)
            gate = torch.randn_like(q)
            nbytes = 2 * b * args.context * kv * dim * 2
            max_tokens = tables.shape[1] * k.shape[1]
            current = lambda: A.paged_decode_attention_fast(q, k, v, tables, lens, dim ** -0.5, gate)  # noqa: E731
            current()  # (eager first: the split kernel's arrival counters are made outside a capture)
            cur = cold_graph_ms(current)
            best = (float("inf"), None)
            for st in settings:
                splits = A.decode_splits(b, kv, max_tokens, q.device, st["tile"], st["per_sm"])
                try:
                    A.paged_decode_launch(q, k, v, tables, lens, dim ** -0.5, gate, splits, tile=st["tile"],
                                          warps=st["warps"], stages=st["stages"])
                    ms = cold_graph_ms(lambda: A.paged_decode_launch(q, k, v, tables, lens, dim ** -0.5, gate, splits,
                                                                     tile=st["tile"], warps=st["warps"],
                                                                     stages=st["stages"]))
                except Exception:  # (a tile that does not fit)
                    ms = float("inf")
                key = tuple(st.values())
                totals[key] = totals.get(key, 0.0) + ms
                best = min(best, (ms, st), key=lambda r: r[0])
            rows.append({"batch": b, "current_us": round(cur * 1e3, 2), "best_us": round(best[0] * 1e3, 2),
                         "best": best[1], "current_GBs": round(nbytes / cur / 1e6, 1),
                         "best_GBs": round(nbytes / best[0] / 1e6, 1)})
            print(f"{shape} b={b:3d}: current {cur * 1e3:7.1f} us ({nbytes / cur / 1e6:6.0f} GB/s)  best "
                  f"{best[0] * 1e3:7.1f} us {best[1]}", flush=True)
        overall = min(totals.items(), key=lambda kv_: kv_[1])
        print(f"{shape}: best single setting {dict(zip(grid, overall[0]))} (sum {overall[1] * 1e3:.1f} us)")
        out["shapes"].append({"shape": shape, "rows": rows, "best_single": dict(zip(grid, overall[0])),
                              "best_single_sum_us": round(overall[1] * 1e3, 2)})
    if args.json:
        with open(args.json, "w") as f:
            json.dump(out, f, indent=1)


if __name__ == "__main__":
    main()
