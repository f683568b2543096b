"""GPU micro-benchmark of the sparse MoE block (layers/moe/): torch oracle vs Triton, one layer at the
Qwen3.5-35B-A3B shapes of one rank (rank 0 of --tp), bf16, random weights and routing of random inputs.

    python -m benchmarks.bench_moe [--tp 1] [--decode-only | --layout-only] [--out results.json]

Rows, for decode batches 1..64 and prefill sizes:
- route: the router|shared-gate GEMM and the routing (softmax, top-k, renormalise, sigmoid);
- experts: everything after routing (the torch per-expert loop vs align + gate_up + down + combine);
- moe: the whole block (moe_torch vs moe_fast, which takes the decode kernels up to moe.DECODE_MAX_T tokens).
"torch ms" and "fast ms" are eager (triton.testing.do_bench; the torch loop syncs with the host, so it cannot be
graph-captured); "graph ms" is the fast path replayed from a CUDA graph, as decode steps run. GB/s: bytes the fast
path must move (the distinct local experts hit, the shared expert and router weights, activations in and out) over
the graph time; the floor of a decode MoE layer is those bytes at the GPU's copy bandwidth.

Then the layout table (T = 128..16384, us from a CUDA graph): the one-program align_serial (the path at
moe.ALIGN_SERIAL_MAX_T tokens and below) against align_chunked's three launches at several chunk sizes (the
default: moe.align_chunk, by moe.ALIGN_CHUNKS); T = 128, 192 and 256 are verify steps of batch 64 at k = 1, 2, 3.

Then the decode tables (batches 1..64, us per layer from a CUDA graph; launches per layer counted eagerly with
torch.profiler, memcpy/memset excluded):
- fused / split: decode_path (router GEMM, route_fast, align_serial, gate_up, then down + combine in one kernel
  / in two: 5 or 6); gemv: the GEMV path
  (router GEMM, gate_up_gemv_fast with the routing in its prologue, down_combine: 3); scan_fused / scan_split: the
  scan path (router GEMM, route_fast, gate_up_scan_fast, then down_combine or down_scan + combine: 4 or 5);
  "moe_fast" says which one
  moe_fast takes here (the tuned table's choice, else moe.GEMV_MAX_T and moe.DOWN_COMBINE_MAX_T);
- the parts alone: route_fast + align_serial; router GEMM + both;
  down_combine vs down + combine vs the scan down (down_scan alone); route + align + gate_up vs the GEMV path's
  gate_up (routing included) vs gate_up_scan alone;
- floor: the layer's bytes at the copy rate measured in the same run.
"""
from __future__ import annotations

import argparse
import json

import torch
import torch.nn.functional as F
import triton.testing

from layers import moe
from qwen35.config import ModelConfig
from qwen35.bench.step_timing import copy_rate, count_kernels
from qwen35.synth import PRESETS

DECODE = [1, 2, 4, 8, 16, 32, 64]
PREFILL = [512, 2048, 8192]
LAYOUT = [128, 192, 256, 512, 1024, 2048, 4096, 8192, 16384]
CHUNKS = (128, 256, 512, 1024, 2048)


def model_config() -> ModelConfig:
    return ModelConfig.from_dict({"text_config": dict(PRESETS["qwen3.5-35b-a3b"]["text_config"])})


class Layer:
    """One rank's MoE weights (random, std 0.02) and the two implementations as plain functions."""

    def __init__(self, cfg: ModelConfig, tp: int):
        # every expert on every rank, 1/tp of its intermediate rows (layers/moe/experts.py)
        E, H, I = cfg.num_experts, cfg.hidden_size, cfg.moe_intermediate_size // tp
        num_local, shared = E, cfg.shared_expert_intermediate_size // tp

        def rand(*shape):
            return torch.randn(*shape, device="cuda", dtype=torch.bfloat16) * 0.02
        self.top_k, self.hidden = cfg.num_experts_per_tok, H
        self.router = rand(E + 1, H)
        self.w = moe.ExpertWeights(rand(num_local, 2 * I, H), rand(num_local, H, I), 0, rand(2 * shared, H),
                                   rand(H, shared))
        self.expert_bytes = 3 * I * H * 2

    def bytes(self, x, ids) -> int:
        """Weights the step must read (each local expert hit once, the shared expert, the router), x and out."""
        hit = torch.unique(ids[(ids >= self.w.start) & (ids < self.w.start + self.w.gate_up.shape[0])]).numel()
        shared = (self.w.shared_gate_up.numel() + self.w.shared_down.numel()) * 2
        return hit * self.expert_bytes + shared + self.router.numel() * 2 + 2 * x.numel() * 2


def eager_ms(fn) -> float:
    return triton.testing.do_bench(fn, warmup=5, rep=20)


def graph_ms(fn) -> float:
    return triton.testing.do_bench_cudagraph(fn, rep=20)


def rows_for(layer: Layer, T: int, gen: torch.Generator) -> list[dict]:
    x = torch.randn(T, layer.hidden, generator=gen, device="cuda").to(torch.bfloat16)
    logits = F.linear(x, layer.router)
    ids, weights, gate = moe.route_fast(logits, layer.top_k)
    ops = {
        "route": (lambda: moe.route_torch(F.linear(x, layer.router), layer.top_k),
                  lambda: moe.route_fast(F.linear(x, layer.router), layer.top_k), None),
        "experts": (lambda: moe.experts_torch(x, ids, weights, gate, layer.w),
                    lambda: moe.experts_fast(x, ids, weights, gate, layer.w), layer.bytes(x, ids)),
        "moe": (lambda: moe.moe_torch(x, layer.router, layer.top_k, layer.w),
                lambda: moe.moe_fast(x, layer.router, layer.top_k, layer.w), layer.bytes(x, ids)),
    }
    out = []
    for name, (torch_fn, fast_fn, nbytes) in ops.items():
        t_torch, t_fast, t_graph = eager_ms(torch_fn), eager_ms(fast_fn), graph_ms(fast_fn)
        out.append(dict(op=name, batch=T, torch_ms=t_torch, fast_ms=t_fast, graph_ms=t_graph,
                        gb_s=nbytes / t_graph / 1e6 if nbytes else None))
    return out


def layout_row(layer: Layer, T: int, gen: torch.Generator) -> dict:
    """The sorted layout of T tokens routed from random inputs: one program vs the chunked kernels."""
    x = torch.randn(T, layer.hidden, generator=gen, device="cuda").to(torch.bfloat16)
    ids = moe.route_fast(F.linear(x, layer.router), layer.top_k)[0]
    w = layer.w
    num_local = w.gate_up.shape[0]
    block_m = moe.moe_config(T, num_local, layer.hidden, w.down.shape[2], w.shared_down.shape[1], x.device)["BLOCK_M"]
    row = {"batch": T, "block_m": block_m,
           "serial_us": graph_ms(lambda: moe.align_serial(ids, w.start, num_local, block_m)) * 1e3}
    for chunk in CHUNKS:
        row[f"chunk{chunk}_us"] = graph_ms(lambda: moe.align_chunked(ids, w.start, num_local, block_m, chunk)) * 1e3
    return row


def decode_row(layer: Layer, T: int, gen: torch.Generator, rate: float) -> dict:
    """One decode batch: the whole layer fused / split / gemv, and its parts alone (see the docstring)."""
    x = torch.randn(T, layer.hidden, generator=gen, device="cuda").to(torch.bfloat16)
    k, w, router = layer.top_k, layer.w, layer.router
    num_local, inter = w.gate_up.shape[0], w.down.shape[2]
    cfg = moe.moe_config(T, num_local, layer.hidden, inter, w.shared_down.shape[1], x.device)
    logits = moe.padded_router_gemm(x, router)
    ids, weights, shared_gate = moe.route_fast(logits, k)
    layout = moe.align_serial(ids, w.start, num_local, cfg["BLOCK_M"])
    act = moe.gate_up_fast(x, w, layout, cfg["gate_up"])

    def route_align(logits):
        return moe.align_serial(moe.route_fast(logits, k)[0], w.start, num_local, cfg["BLOCK_M"])
    whole = {
        "fused": lambda: moe.decode_path(x, router, k, w, down_combine=True, gemv=False),
        "split": lambda: moe.decode_path(x, router, k, w, down_combine=False, gemv=False),
        "gemv": lambda: moe.decode_path(x, router, k, w, gemv=True),
        "scan_fused": lambda: moe.decode_path(x, router, k, w, gemv=False, scan=True, down_combine=True),
        "scan_split": lambda: moe.decode_path(x, router, k, w, gemv=False, scan=True, down_combine=False),
    }
    parts = {
        "route_align": lambda: route_align(logits),
        "gemm_route_align": lambda: route_align(moe.padded_router_gemm(x, router)),
        "down_before": lambda: moe.combine_fast(moe.down_fast(act, w, layout, weights, shared_gate, cfg["down"]),
                                                layout.inverse, T),
        "down_combine": lambda: moe.down_combine_fast(act, w, layout.inverse, ids, weights, shared_gate,
                                                      cfg["down_combine"]),
        "layout_gate_up": lambda: moe.gate_up_fast(x, w, route_align(logits), cfg["gate_up"]),
        "gemv_gate_up": lambda: moe.gate_up_gemv_fast(x, logits, k, w, cfg["gemv"]),
        "scan_gate_up": lambda: moe.gate_up_scan_fast(x, ids, weights, shared_gate, w, scan["gate_up"]),
        "scan_down": lambda: moe.down_scan_fast(g.act, w, g.inverse, ids, weights, shared_gate, scan["down"]),
    }
    scan = cfg["scan"] or {"gate_up": None, "down": None}
    g = moe.gate_up_scan_fast(x, ids, weights, shared_gate, w, scan["gate_up"])
    taken = ("gemv" if cfg["gemv"] is not None else
             ("scan_split" if cfg["scan"]["down"] else "scan_fused") if cfg["scan"] is not None else
             "split" if cfg["down_combine"] is None else "fused")
    row = {"batch": T, "moe_fast": taken, "floor_us": layer.bytes(x, ids) / rate * 1e6}
    for name, fn in whole.items():
        row[f"{name}_launches"] = count_kernels(fn)  # eager first: compiles
    for name, fn in {**whole, **parts}.items():
        row[f"{name}_us"] = graph_ms(fn) * 1e3
    return row


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--tp", type=int, default=1, help="time rank 0 of this tensor-parallel degree")
    only = ap.add_mutually_exclusive_group()
    only.add_argument("--decode-only", action="store_true", help="only the decode tables")
    only.add_argument("--layout-only", action="store_true", help="only the layout table")
    ap.add_argument("--out", help="also write the rows as JSON here")
    args = ap.parse_args()
    cfg = model_config()
    layer = Layer(cfg, args.tp)
    gen = torch.Generator(device="cuda").manual_seed(0)
    print(f"{torch.cuda.get_device_name()}, TP={args.tp}: {layer.w.gate_up.shape[0]} local experts, "
          f"shared intermediate {layer.w.shared_down.shape[1]}, {cfg.num_hidden_layers} MoE layers")
    rows, layout, decode, rate = [], [], [], None
    if not (args.decode_only or args.layout_only):
        print(f"{'op':<8} {'batch':>6} {'torch ms':>9} {'fast ms':>8} {'graph ms':>9} {'GB/s':>7}")
        for T in DECODE + PREFILL:
            for r in rows_for(layer, T, gen):
                rows.append(r)
                gbs = f"{r['gb_s']:7.0f}" if r["gb_s"] else f"{'':>7}"
                print(f"{r['op']:<8} {T:>6} {r['torch_ms']:9.3f} {r['fast_ms']:8.3f} {r['graph_ms']:9.3f} {gbs}")
    if not args.decode_only:
        print(f"\nlayout, us from a CUDA graph: one program (align_serial) vs align_chunked's three launches "
              f"at {len(CHUNKS)} chunk sizes (the default: moe.align_chunk)")
        print(f"{'batch':>6} {'BLOCK_M':>7} {'serial':>8} " + " ".join(f"{'chunk ' + str(c):>10}" for c in CHUNKS)
              + f" {'default':>8} {'speedup':>8}")  # serial / the default chunk
        for T in LAYOUT:
            r = layout_row(layer, T, gen)
            layout.append(r)
            default = moe.align_chunk(T * layer.top_k)
            print(f"{T:>6} {r['block_m']:>7} {r['serial_us']:8.1f} "
                  + " ".join(f"{r[f'chunk{c}_us']:10.1f}" for c in CHUNKS)
                  + f" {default:>8} {r['serial_us'] / r[f'chunk{default}_us']:7.1f}x")
    if not args.layout_only:
        rate = copy_rate(torch.device("cuda"))
        for T in DECODE:
            decode.append(decode_row(layer, T, gen, rate))
        print(f"\ndecode, us per layer from a CUDA graph (launches per layer, eager); copy rate {rate / 1e9:.0f} GB/s")
        paths = ("fused", "split", "gemv", "scan_fused", "scan_split")
        print(f"{'batch':>5} " + " ".join(f"{n:>13}" for n in paths) + f" {'moe_fast':>10} {'floor':>6}")
        for r in decode:
            cells = " ".join(f"{r[n + '_us']:7.1f} ({r[n + '_launches']})" for n in paths)
            print(f"{r['batch']:>5} {cells} {r['moe_fast']:>10} {r['floor_us']:6.1f}")
        print("\ndecode parts, us from a CUDA graph: route_fast + align_serial; router GEMM + both; down + combine vs "
              "down_combine vs the scan down; route + align + gate_up vs the GEMV gate_up vs the scan gate_up")
        print(f"{'batch':>5} {'route+align':>11} | {'GEMM+r+a':>8} | {'down+comb':>9} {'down_comb':>9} "
              f"{'scan down':>9} | {'r+a+up':>7} {'gemv up':>7} {'scan up':>7}")
        for r in decode:
            print(f"{r['batch']:>5} {r['route_align_us']:11.1f} | {r['gemm_route_align_us']:8.1f} | "
                  f"{r['down_before_us']:9.1f} {r['down_combine_us']:9.1f} {r['scan_down_us']:9.1f} | "
                  f"{r['layout_gate_up_us']:7.1f} {r['gemv_gate_up_us']:7.1f} {r['scan_gate_up_us']:7.1f}")
    if args.out:
        with open(args.out, "w") as f:
            json.dump({"device": torch.cuda.get_device_name(), "tp": args.tp,
                       "copy_gb_s": rate / 1e9 if rate else None, "rows": rows, "layout": layout,
                       "decode": decode}, f, indent=1)


if __name__ == "__main__":
    main()
