"""GPU micro-benchmark of the decode GEMMs (layers/linear.py): cuBLAS (F.linear) against the GEMV kernel (linear_fast)
and the skinny split-K kernel (skinny_gemm) at the Qwen3.5-35B-A3B projections of one rank, bf16, for the rows of a
decode step.

    python -m benchmarks.bench_linear [--tp 1] [--model M] [--rows 1,2,4,8] [--sweep] [--rows-sweep] [--norm]
        [--out F.json]

Shapes: the DeltaNet and attention input projections (fused), the out projections, the router, the LM head's slice.
Each shape is timed over enough copies of its weight (at least 256 MB, one call per copy in one CUDA graph) that
they do not stay in L2, as in a decode step, which streams ~6 GB: a single weight timed over and over sits in L2
(50 MB) and flatters whichever kernel reads it. Prints microseconds per call and the weight-read rate (TB/s) of
cuBLAS, the GEMV (its rows tiled in each program), the GEMV's row grid (linear_fast's rows_in_grid: a program per
column block and row, the weight re-read per row, from L2 but the first; the MoE router's path at 3-16 rows), the
rows kernel (rows_gemm, linear_fast's past 2 rows; past ROWS_MAX_M, up to ROWS_PUSH_MAX_M, as it runs pushing a
boundary but storing plainly) and, for the router and gdn_out, the skinny kernel. --model
llama-1b (a dense preset) takes that model's projections instead. --sweep times GEMV_CONFIG's tile and warps per
shape at each row count and prints the best three; --rows-sweep the rows kernel's tiles past 2 rows. --norm
times, for the shapes that read a layer norm (the mixers' input projections, the router) at every row count, the
norm kernel then the GEMV against the GEMV that computes the norm itself (a PendingNorm, layers/norm.py
RMSNorm.boundary), tiled and as a row grid past 2 rows.
"""
from __future__ import annotations

import argparse
import contextlib
import itertools
import json
import sys
import time

import torch
import torch.nn.functional as F

from layers import backend, linear
from qwen35.config import ModelConfig
from qwen35.bench.step_timing import graph_ms
from qwen35.synth import PRESETS

L2_SPAN = 256 << 20  # bytes of weight copies per shape


def shapes(tp: int, model: str = "qwen3.5-35b-a3b") -> dict[str, tuple[int, int]]:
    """name -> (N, K) of one rank's weight."""
    if model != "qwen3.5-35b-a3b":  # a dense LLaMA-like (issue #29's runtime)
        c = ModelConfig.from_dict(dict(PRESETS[model]))
        q, kv = c.num_attention_heads * c.head_dim, 2 * c.num_key_value_heads * c.head_dim
        return {"qkv": ((q + kv) // tp, c.hidden_size), "o": (c.hidden_size, q // tp),
                "gate_up": (2 * c.intermediate_size // tp, c.hidden_size),
                "down": (c.hidden_size, c.intermediate_size // tp)}
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


def norm_then_gemv(weights: list[torch.Tensor], M: int, K: int, sweep: bool) -> dict:
    """Microseconds per (residual add + norm + GEMV) of M rows: the norm kernel then the GEMV, and the GEMV that
    computes the norm itself (the norm's inputs made anew per call, as a layer boundary does); with `sweep`, the
    norm kernel's warps (NORM_CONFIG) for the first and the GEMV's tile and warps for the second."""
    from layers import norm as norm_mod

    with backend.use_kernels("fast"):
        norm = norm_mod.RMSNorm(K, 1e-6, dtype=torch.bfloat16, device="cuda")
    x, res = (torch.randn(M, K, device="cuda", dtype=torch.bfloat16) for _ in range(2))
    gemv_rows = max(M, linear.GEMV_MAX_M)
    separate = lambda x, w: linear.linear_fast(norm(x, res)[0], w, gemv_rows=gemv_rows)  # noqa: E731
    folded = lambda x, w: linear.linear_fast(norm.boundary(x, res)[0], w, gemv_rows=gemv_rows)  # noqa: E731
    out = {"norm_then_gemv_us": us_per_call(separate, weights, x), "folded_us": us_per_call(folded, weights, x)}
    if linear.GEMV_MAX_M < M <= linear.FOLD_MAX_M:  # (boundary leaves the norm pending up to FOLD_MAX_M rows)
        grid = lambda x, w: linear.linear_fast(norm.boundary(x, res)[0], w, gemv_rows=M,  # noqa: E731
                                               rows_in_grid=True)
        out["folded_row_grid_us"] = us_per_call(grid, weights, x)
    if sweep:
        saved_norm, saved_gemv = dict(norm_mod.NORM_CONFIG), dict(linear.GEMV_CONFIG)
        for warps in (1, 2, 4, 8):
            norm_mod.NORM_CONFIG.update(max_warps=warps, per_warp=1)
            out[f"norm_warps_{warps}"] = us_per_call(separate, weights, x)
        norm_mod.NORM_CONFIG.update(saved_norm)
        for tile, warps in itertools.product((2048, 4096, 8192, 16384, 32768), (4, 8, 16)):
            linear.GEMV_CONFIG.update(tile_1=tile, tile=tile, warps=warps)
            try:
                out[f"folded_tile_{tile}_warps_{warps}"] = us_per_call(folded, weights, x)
            except Exception as e:  # out of registers and the like
                print(f"    {(tile, warps)}: {type(e).__name__}")
        linear.GEMV_CONFIG.update(saved_gemv)
    return {k: round(v, 2) for k, v in out.items()}


@contextlib.contextmanager
def rows_taken():
    """rows_gemm takes up to ROWS_PUSH_MAX_M rows unpushed (past ROWS_MAX_M it takes them only pushing a boundary:
    the same kernel and tiles but for the epilogue's stores)."""
    saved = linear.rows_limit
    linear.rows_limit = lambda box: linear.ROWS_PUSH_MAX_M
    try:
        yield
    finally:
        linear.rows_limit = saved


def rows_sweep(weights: list[torch.Tensor], x: torch.Tensor) -> list:
    """The best three of rows_gemm's settings (block_n, block_k, warps, stages) at these rows (ROWS_CONFIG over
    ROWS_TILES), of those within Hopper's shared memory."""
    M = x.shape[0]
    saved, results = dict(linear.ROWS_CONFIG), []
    grid = [(bn, bk, 4, st) for bn in (16, 32, 64) for bk in (128, 256, 512) for st in (3, 4)]
    for bn, bk, w, st in [g for g in grid if (g[3] - 1) * (max(16, M) + g[0]) * g[1] * 2 <= 232448]:
        linear.ROWS_CONFIG.update(block_n=bn, block_k=bk, warps=w, stages=st)
        try:
            with rows_taken():
                results.append((round(us_per_call(linear.rows_gemm, weights, x), 2), (bn, bk, w, st)))
        except Exception as e:  # out of shared memory and the like
            print(f"    {(bn, bk, w, st)}: {type(e).__name__}")
    linear.ROWS_CONFIG.update(saved)
    return sorted(results)[:3]


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--tp", type=int, default=1)
    ap.add_argument("--rows", default="1,2,4,8")
    ap.add_argument("--sweep", action="store_true")
    ap.add_argument("--norm", action="store_true", help="also the norm kernel + GEMV against the folded norm")
    ap.add_argument("--model", default="qwen3.5-35b-a3b", help="or a dense preset: llama-1b, llama-3b")
    ap.add_argument("--rows-sweep", action="store_true", help="ROWS_CONFIG's settings at each row count past 2")
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    rows = [int(r) for r in args.rows.split(",")]
    dev = torch.cuda.get_device_name()
    print(f"{dev}, TP={args.tp}, GEMV up to {linear.GEMV_MAX_M} rows {linear.GEMV_CONFIG}, skinny "
          f"{linear.SKINNY_CONFIG}")
    print(f"{'shape':<10}{'N x K':>14}{'M':>4}{'cuBLAS us':>11}{'TB/s':>6}{'GEMV us':>9}{'TB/s':>6}{'grid us':>9}"
          f"{'TB/s':>6}{'skinny us':>11}{'TB/s':>6}{'rows us':>9}{'TB/s':>6}")
    saved = dict(linear.GEMV_CONFIG)
    records = []
    for name, (N, K) in shapes(args.tp, args.model).items():
        copies = max(2, -(-L2_SPAN // (N * K * 2)))
        weights = [torch.randn(N, K, device="cuda", dtype=torch.bfloat16) for _ in range(copies)]
        rate = lambda t: N * K * 2 / t / 1e6  # noqa: E731
        for M in rows:
            x = torch.randn(M, K, device="cuda", dtype=torch.bfloat16)
            t_cublas = us_per_call(F.linear, weights, x)
            gemv = lambda x, w: linear.linear_fast(x, w, gemv_rows=M)  # noqa: E731 (the GEMV at any row count)
            t_gemv = us_per_call(gemv, weights, x)
            grid = lambda x, w: linear.linear_fast(x, w, gemv_rows=M, rows_in_grid=True)  # noqa: E731
            t_grid = us_per_call(grid, weights, x) if M > 1 else float("nan")
            t_skinny = us_per_call(linear.skinny_gemm, weights, x) if name in ("router", "gdn_out") else float("nan")
            with rows_taken():
                t_rows = us_per_call(linear.rows_gemm, weights, x) if 1 < M <= linear.ROWS_PUSH_MAX_M else float("nan")
            print(f"{name:<10}{f'{N} x {K}':>14}{M:>4}{t_cublas:>11.1f}{rate(t_cublas):>6.2f}{t_gemv:>9.1f}"
                  f"{rate(t_gemv):>6.2f}{t_grid:>9.1f}{rate(t_grid):>6.2f}{t_skinny:>11.1f}{rate(t_skinny):>6.2f}"
                  f"{t_rows:>9.1f}{rate(t_rows):>6.2f}", flush=True)
            rec = {"shape": name, "N": N, "K": K, "rows": M, "cublas_us": round(t_cublas, 2),
                   "gemv_us": round(t_gemv, 2), "row_grid_us": None if t_grid != t_grid else round(t_grid, 2),
                   "skinny_us": None if t_skinny != t_skinny else round(t_skinny, 2),
                   "rows_us": None if t_rows != t_rows else round(t_rows, 2)}
            if args.rows_sweep and M > 2 and name not in ("router", "lm_head"):
                rec["rows_sweep_best"] = rows_sweep(weights, x)
                print("    rows kernel (block_n, block_k, warps, stages): " + ", ".join(
                    f"{t:.1f} us {cfg}" for t, cfg in rec["rows_sweep_best"]), flush=True)
            if args.sweep and not args.norm and name != "lm_head":
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
            if args.norm and name in ("gdn_in", "attn_qkv", "router"):
                t = norm_then_gemv(weights, M, K, args.sweep)
                rec.update(t)
                print(f"    norm + GEMV {t.pop('norm_then_gemv_us'):.1f} us, GEMV with the norm folded in "
                      f"{t.pop('folded_us'):.1f} us" + (f", as a row grid {t.pop('folded_row_grid_us'):.1f} us"
                                                        if "folded_row_grid_us" in t else ""), flush=True)
                if t:
                    print("    " + ", ".join(f"{k} {v:.1f}" for k, v in sorted(t.items(), key=lambda kv: kv[1])[:8]),
                          flush=True)
            records.append(rec)
        del weights
    if args.out:
        with open(args.out, "w") as f:
            json.dump({"device": dev, "date": time.strftime("%Y-%m-%d"), "command": "python -m benchmarks.bench_linear "
                       + " ".join(sys.argv[1:]), "tp": args.tp, "model": args.model, "gemv_config": saved,
                       "rows_config": linear.ROWS_CONFIG, "rows": records}, f, indent=1)


if __name__ == "__main__":
    main()
