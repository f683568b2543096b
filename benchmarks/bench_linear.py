"""GPU micro-benchmark of the decode GEMMs (layers/linear.py): cuBLAS (F.linear) against the GEMV kernel (linear_fast)
and the skinny split-K kernel (skinny_gemm) at the Qwen3.5-35B-A3B projections of one rank, bf16, for the rows of a
decode step.

    python -m benchmarks.bench_linear [--tp 1] [--rows 1,2,4,8] [--sweep] [--out F.json]

Shapes: the DeltaNet and attention input projections (fused), the out projections, the router, the LM head's slice.
Each shape is timed over enough copies of its weight (at least 256 MB, one call per copy in one CUDA graph) that
they do not stay in L2, as in a decode step, which streams ~6 GB: a single weight timed over and over sits in L2
(50 MB) and flatters whichever kernel reads it. Prints microseconds per call and the weight-read rate (TB/s); --sweep
times GEMV_CONFIG's tile and warps per shape at each row count and prints the best three.
"""
from __future__ import annotations

import argparse
import itertools
import json

import torch
import torch.nn.functional as F

from layers import linear
from qwen35.config import ModelConfig
from qwen35.step_timing import graph_ms
from qwen35.synth import PRESETS

L2_SPAN = 256 << 20  # bytes of weight copies per shape


def shapes(tp: int) -> dict[str, tuple[int, int]]:
    """name -> (N, K) of one rank's weight."""
    c = ModelConfig.from_dict({"text_config": dict(PRESETS["qwen3.5-35b-a3b"]["text_config"])})
    kd, vd = c.linear_num_key_heads * c.linear_key_head_dim, c.linear_num_value_heads * c.linear_value_head_dim
    q = c.num_attention_heads * c.head_dim * 2  # query and output gate
    kv = 2 * c.num_key_value_heads * c.head_dim
    return {"gdn_in": ((2 * kd + 2 * vd + 2 * c.linear_num_value_heads) // tp, c.hidden_size),
            "attn_qkv": ((q + kv) // tp, c.hidden_size),
            "gdn_out": (c.hidden_size, vd // tp),
            "attn_out": (c.hidden_size, c.num_attention_heads * c.head_dim // tp),
            "router": (c.num_experts + 1, c.hidden_size),  # the router | shared-expert gate rows, replicated
            "lm_head": (c.vocab_size // tp, c.hidden_size)}


def us_per_call(fn, weights: list[torch.Tensor], x: torch.Tensor, reps: int = 10) -> float:
    """One call per weight copy, captured in one CUDA graph; microseconds per call."""
    for w in weights[:2]:
        fn(x, w)  # compiles, cuBLAS heuristics
    torch.cuda.synchronize()
    return 1e3 * graph_ms(lambda: [fn(x, w) for w in weights], reps) / len(weights)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--tp", type=int, default=1)
    ap.add_argument("--rows", default="1,2,4,8")
    ap.add_argument("--sweep", action="store_true")
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    rows = [int(r) for r in args.rows.split(",")]
    dev = torch.cuda.get_device_name()
    print(f"{dev}, TP={args.tp}, GEMV up to {linear.GEMV_MAX_M} rows {linear.GEMV_CONFIG}, skinny "
          f"{linear.SKINNY_CONFIG}")
    print(f"{'shape':<10}{'N x K':>14}{'M':>4}{'cuBLAS us':>11}{'TB/s':>6}{'GEMV us':>9}{'TB/s':>6}{'skinny us':>11}"
          f"{'TB/s':>6}")
    saved = dict(linear.GEMV_CONFIG)
    records = []
    for name, (N, K) in shapes(args.tp).items():
        copies = max(2, -(-L2_SPAN // (N * K * 2)))
        weights = [torch.randn(N, K, device="cuda", dtype=torch.bfloat16) for _ in range(copies)]
        rate = lambda t: N * K * 2 / t / 1e6  # noqa: E731
        for M in rows:
            x = torch.randn(M, K, device="cuda", dtype=torch.bfloat16)
            t_cublas = us_per_call(F.linear, weights, x)
            gemv = lambda x, w: linear.linear_fast(x, w, gemv_rows=M)  # noqa: E731 (the GEMV at any row count)
            t_gemv = us_per_call(gemv, weights, x)
            t_skinny = us_per_call(linear.skinny_gemm, weights, x) if name in ("router", "gdn_out") else float("nan")
            print(f"{name:<10}{f'{N} x {K}':>14}{M:>4}{t_cublas:>11.1f}{rate(t_cublas):>6.2f}{t_gemv:>9.1f}"
                  f"{rate(t_gemv):>6.2f}{t_skinny:>11.1f}{rate(t_skinny):>6.2f}", flush=True)
            rec = {"shape": name, "N": N, "K": K, "rows": M, "cublas_us": round(t_cublas, 2),
                   "gemv_us": round(t_gemv, 2), "skinny_us": None if t_skinny != t_skinny else round(t_skinny, 2)}
            if args.sweep and name != "lm_head":
                results = []
                for tile, warps in itertools.product((2048, 4096, 8192, 16384), (1, 2, 4, 8)):
                    linear.GEMV_CONFIG.update(tile_1=tile, tile=tile, warps=warps)
                    try:
                        results.append((us_per_call(gemv, weights, x), (tile, warps)))
                    except Exception as e:  # out of registers and the like
                        print(f"    {(tile, warps)}: {type(e).__name__}")
                linear.GEMV_CONFIG.update(saved)
                results.sort()
                rec["sweep_best"] = [(round(t, 2), cfg) for t, cfg in results[:3]]
                print("    best (tile, warps): " + ", ".join(f"{t:.1f} us {cfg}" for t, cfg in results[:3]),
                      flush=True)
            records.append(rec)
        del weights
    if args.out:
        with open(args.out, "w") as f:
            json.dump({"device": dev, "tp": args.tp, "gemv_config": saved, "rows": records}, f, indent=1)


if __name__ == "__main__":
    main()
