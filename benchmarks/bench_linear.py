"""GPU micro-benchmark of the decode GEMMs (layers/linear.py): cuBLAS (F.linear) against the skinny Triton kernel at
the Qwen3.5-35B-A3B projections of one rank, bf16, for the rows of a decode step.

    python -m benchmarks.bench_linear [--tp 1] [--rows 1,2,4,8,16] [--sweep]

Shapes: the DeltaNet and attention input projections (fused), the out projections, the LM head's slice. Prints
microseconds and the weight-read rate (TB/s) per shape and row count; --sweep times the skinny kernel's launch
settings (SKINNY_CONFIG) on the DeltaNet projections at the fewest and most rows and prints the best three.
"""
from __future__ import annotations

import argparse
import itertools

import torch
import torch.nn.functional as F
import triton.testing

from layers import linear
from qwen35.config import ModelConfig
from qwen35.synth import PRESETS


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


def us(fn) -> float:
    return 1e3 * triton.testing.do_bench_cudagraph(fn, rep=50)  # in a graph, as decode runs: no launch cost


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--tp", type=int, default=1)
    ap.add_argument("--rows", default="1,2,4,8,16")
    ap.add_argument("--sweep", action="store_true")
    args = ap.parse_args()
    rows = [int(r) for r in args.rows.split(",")]
    print(f"{torch.cuda.get_device_name()}, TP={args.tp}, skinny config {linear.SKINNY_CONFIG}")
    print(f"{'shape':<10}{'N x K':>14}{'M':>4}{'cuBLAS us':>11}{'TB/s':>6}{'skinny us':>11}{'TB/s':>6}")
    saved = dict(linear.SKINNY_CONFIG)
    for name, (N, K) in shapes(args.tp).items():
        w = torch.randn(N, K, device="cuda", dtype=torch.bfloat16)
        for M in rows:
            x = torch.randn(M, K, device="cuda", dtype=torch.bfloat16)
            t_cublas, t_skinny = us(lambda: F.linear(x, w)), us(lambda: linear.linear_fast(x, w))
            rate = lambda t: w.numel() * 2 / t / 1e6  # noqa: E731
            print(f"{name:<10}{f'{N} x {K}':>14}{M:>4}{t_cublas:>11.1f}{rate(t_cublas):>6.2f}{t_skinny:>11.1f}"
                  f"{rate(t_skinny):>6.2f}", flush=True)
            if not args.sweep or M not in (1, max(rows)) or name not in ("gdn_in", "gdn_out"):
                continue
            results = []
            for bn, bk, warps, stages in itertools.product((16, 32), (128, 256, 512), (4, 8), (3, 4, 6)):
                linear.SKINNY_CONFIG.update(block_n=bn, block_k=bk, warps=warps, stages=stages)
                try:
                    results.append((us(lambda: linear.linear_fast(x, w)), (bn, bk, warps, stages)))
                except Exception as e:  # out of shared memory and the like
                    print(f"    {(bn, bk, warps, stages)}: {type(e).__name__}")
            linear.SKINNY_CONFIG.update(saved)
            results.sort()
            print("    best (block_n, block_k, warps, stages): " +
                  ", ".join(f"{t:.1f} us {cfg}" for t, cfg in results[:3]), flush=True)


if __name__ == "__main__":
    main()
