"""GPU micro-benchmark of the gated-attention ops (layers/attention.py): torch oracle vs Triton, one layer at the
Qwen3.5-35B-A3B shapes of one rank, bf16; decode timed by CUDA-graph replay (as decode steps run), prefill eagerly.

    python -m benchmarks.bench_attention [--tp 1] [--out results.json] [--prefill-only] [--sweep]

Prefill rows (S fresh prompts of 1024 tokens packed in one call; a prefix-hit row, 1024 new tokens after 1024
cached; a mixed row, 64 decode rows at context 1024 plus one 1024-token prompt):
- prefill_attn: paged_prefill_attention_torch (the per-sequence SDPA loop) vs _fast (one varlen flash launch);
  TFLOP/s counts the causal work, 4 * heads * head_dim * (keys seen, summed over queries);
- prefill_layer: the whole mixer on that step (GEMMs, norm/RoPE/cache, attention, o_proj).
--sweep also times the prefill kernel's tile settings (block_m, block_n, warps, stages) on each prefill row.

Decode rows:
- norm_rope_cache: q/k RMSNorm + partial RoPE + paged K/V write for a decode batch (one token per sequence);
- decode_attn: paged decode attention with the output gate, at context 1024 for batches 1..64, and long contexts at
  small batches; "1 split ms" is the fast kernel forced to one program per (sequence, KV head), i.e. without
  flash-decoding; GB/s counts the K/V bytes read (the floor of this op);
- layer: the whole attention mixer's decode step (fused q|gate|k|v GEMM, the two ops above, o_proj);
  "x layers" is that times the model's full-attention layers.
"""
from __future__ import annotations

import argparse
import itertools
import json
import math

import torch
import triton.testing

from dist import parallel
from layers import attention as A
from layers import backend
from layers.forward_batch import ForwardBatch
from layers.rotary import RotaryEmbedding
from qwen35.config import ModelConfig
from qwen35.synth import PRESETS

BATCHES = [1, 2, 4, 8, 16, 32, 64]
CONTEXT = 1024
LONG = [(1, 8192), (1, 32768), (2, 32768), (4, 32768)]
BLOCK = 16
# prefill rows: (label, new tokens per sequence, cached tokens per sequence)
PREFILL = [("1 x 1024", [1024], [0]), ("8 x 1024", [1024] * 8, [0] * 8), ("64 x 1024", [1024] * 64, [0] * 64),
           ("prefix 1024+1024", [1024], [1024]), ("64 dec + 1024", [1] * 64 + [1024], [CONTEXT - 1] * 64 + [0])]


def model_config() -> ModelConfig:
    return ModelConfig.from_dict({"text_config": dict(PRESETS["qwen3.5-35b-a3b"]["text_config"])})


def bench(fn) -> float:
    """ms per call, by CUDA-graph replay (NaN when the torch oracle does not fit in memory)."""
    try:
        return triton.testing.do_bench_cudagraph(fn, rep=20)
    except torch.cuda.OutOfMemoryError:
        torch.cuda.empty_cache()
        return float("nan")


def decode_batch(batch: int, ctx: int, gen: torch.Generator) -> ForwardBatch:
    """`batch` sequences of `ctx` tokens (the last one new) in shuffled, disjoint blocks, plus one scratch block."""
    width = math.ceil(ctx / BLOCK)
    tables = torch.randperm(batch * width, generator=gen, device="cuda")[: batch * width].view(batch, width).int()
    lens = torch.full((batch,), ctx, dtype=torch.int32, device="cuda")
    pos = (lens - 1).long()
    rows = torch.arange(batch, device="cuda")
    return ForwardBatch(
        input_ids=torch.zeros(batch, dtype=torch.int64, device="cuda"), positions=pos,
        slot_mapping=tables[rows, pos // BLOCK].long() * BLOCK + pos % BLOCK, cu_seqlens=None,
        start_pos=pos.int(), context_lens=lens, block_tables=tables, state_slots=rows, logits_indices=None,
        seq_lens_cpu=[1] * batch, start_pos_cpu=[ctx - 1] * batch, state_slots_cpu=list(range(batch)), is_decode=True)


def prefill_batch(lens: list[int], starts: list[int], gen: torch.Generator) -> ForwardBatch:
    """A packed step: sequence i feeds lens[i] tokens after starts[i] cached ones, in shuffled disjoint blocks."""
    widths = [math.ceil((n + s) / BLOCK) for n, s in zip(lens, starts)]
    perm = torch.randperm(sum(widths), generator=gen, device="cuda").int()
    tables = torch.zeros(len(lens), max(widths), dtype=torch.int32, device="cuda")
    used = 0
    for i, w in enumerate(widths):
        tables[i, :w] = perm[used:used + w]
        used += w
    lens_t, starts_t = torch.tensor(lens, device="cuda"), torch.tensor(starts, device="cuda")
    seq = torch.repeat_interleave(torch.arange(len(lens), device="cuda"), lens_t)
    cu = torch.zeros(len(lens) + 1, dtype=torch.int64, device="cuda")
    cu[1:] = lens_t.cumsum(0)
    pos = starts_t[seq] + torch.arange(sum(lens), device="cuda") - cu[:-1][seq]
    return ForwardBatch(
        input_ids=torch.zeros(sum(lens), dtype=torch.int64, device="cuda"), positions=pos,
        slot_mapping=tables[seq, pos // BLOCK].long() * BLOCK + pos % BLOCK, cu_seqlens=cu.int(),
        start_pos=starts_t.int(), context_lens=(starts_t + lens_t).int(), block_tables=tables,
        state_slots=torch.arange(len(lens), device="cuda"), logits_indices=None, seq_lens_cpu=list(lens),
        start_pos_cpu=list(starts), state_slots_cpu=list(range(len(lens))),
        is_decode=all(n == 1 and s > 0 for n, s in zip(lens, starts)))


def causal_flops(lens: list[int], starts: list[int], heads: int, head_dim: int) -> float:
    """Multiply-adds x 2 of QK^T and PV over the keys each query sees (start + its index + 1)."""
    keys = sum(n * s + n * (n + 1) // 2 for n, s in zip(lens, starts))
    return 4.0 * heads * head_dim * keys


def bench_eager(fn) -> float:
    """ms per call, eager (prefill steps run without graphs); NaN when out of memory."""
    try:
        return triton.testing.do_bench(fn, warmup=5, rep=50)
    except torch.cuda.OutOfMemoryError:
        torch.cuda.empty_cache()
        return float("nan")


def sweep_prefill(call, label: str, head_dim: int) -> None:
    """The prefill kernel's tile settings on one workload (ms per call), best five printed."""
    saved = dict(A.PREFILL_CONFIG)
    key = min((d for d in A.PREFILL_CONFIG if d >= head_dim), default=max(A.PREFILL_CONFIG))
    results = []
    for bm, bn, warps, stages in itertools.product((64, 128), (32, 64, 128), (4, 8), (1, 2, 3)):
        A.PREFILL_CONFIG[key] = dict(block_m=bm, block_n=bn, num_warps=warps, num_stages=stages)
        try:
            results.append((bench_eager(call), dict(A.PREFILL_CONFIG[key])))
        except Exception as e:  # a tile this GPU cannot hold (shared memory, registers) or compile
            print(f"  {A.PREFILL_CONFIG[key]}: {type(e).__name__}")
    A.PREFILL_CONFIG.clear()
    A.PREFILL_CONFIG.update(saved)
    results.sort(key=lambda r: r[0])
    print(f"  sweep {label} (head_dim {head_dim}; default {saved[key]}):")
    for t, c in results[:5]:
        print(f"    {t:8.3f} ms  {c}")


def build_layer(kernels: str, cfg, rotary, n_blocks: int, tp: int, gen: torch.Generator):
    parallel._WORLD = tp  # rank 0's local shapes; one layer without its all-reduce needs no process group
    try:
        with backend.use_kernels(kernels):
            m = A.GatedAttention(cfg, rotary, dtype=torch.bfloat16, device="cuda")
    finally:
        parallel._WORLD = 1
    for p in m.parameters():
        p.data.copy_(torch.randn(p.shape, generator=gen, device="cuda") / math.sqrt(p.shape[-1]))
    shape = (n_blocks, BLOCK, m.num_kv_heads, m.head_dim)
    m.k_cache = torch.randn(shape, generator=gen, device="cuda").bfloat16()
    m.v_cache = torch.randn(shape, generator=gen, device="cuda").bfloat16()
    return m


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--tp", type=int, default=1, help="local shapes of one rank at this TP degree")
    ap.add_argument("--out", default=None, help="write the rows as JSON here")
    ap.add_argument("--prefill-only", action="store_true", help="only the prefill rows")
    ap.add_argument("--sweep", action="store_true", help="also sweep the prefill kernel's tiles")
    args = ap.parse_args()
    cfg = model_config()
    gen = torch.Generator(device="cuda").manual_seed(0)
    rotary = RotaryEmbedding(cfg.rotary_dim, cfg.rope_theta, max(c for _, c in LONG), device="cuda")
    n_blocks = max(max(BATCHES) * math.ceil(CONTEXT / BLOCK), max(b * math.ceil(c / BLOCK) for b, c in LONG),
                   max(sum(math.ceil((n + s) / BLOCK) for n, s in zip(lens, starts)) for _, lens, starts in PREFILL)) + 1
    layers = {k: build_layer(k, cfg, rotary, n_blocks, args.tp, gen) for k in ("torch", "fast")}
    m = layers["fast"]
    H, KV, D = m.num_heads, m.num_kv_heads, m.head_dim
    n_layers = len(cfg.full_attention_layers)
    print(f"{torch.cuda.get_device_name()}, TP={args.tp}: {H} q heads, {KV} KV heads, head_dim {D}, rotary "
          f"{cfg.rotary_dim}, block {BLOCK}; {n_layers} attention layers; decode {A.decode_config(D, 1)} (1 row) .. "
          f"{A.decode_config(D, 64)} (64 rows), min tiles/split "
          f"{A.MIN_TILES_PER_SPLIT}, max splits {A.MAX_SPLITS}; prefill tiles {A.prefill_config(D)}")
    rows = []

    def row(op, batch, ctx, splits, t_torch, t_fast, t_one=None, nbytes=None):
        gbs = nbytes / t_fast / 1e6 if nbytes else None
        print(f"{op:<16}{batch:>6}{ctx:>7}{splits:>7}{t_torch:>10.4f}{t_fast:>9.4f}"
              f"{'-' if t_one is None else f'{t_one:.4f}':>11}{'-' if gbs is None else f'{gbs:.0f}':>7}"
              f"{t_fast * n_layers:>18.3f}")
        rows.append(dict(op=op, batch=batch, ctx=ctx, splits=splits, torch_ms=t_torch, fast_ms=t_fast,
                         one_split_ms=t_one, gb_s=gbs, layers_ms=t_fast * n_layers))

    with torch.inference_mode():
        prefill_rows = prefill(layers, cfg, gen, n_layers, args.sweep)
        if not args.prefill_only:
            print(f"{'op':<16}{'batch':>6}{'ctx':>7}{'splits':>7}{'torch ms':>10}{'fast ms':>9}{'1 split ms':>11}"
                  f"{'GB/s':>7}{'fast ms x layers':>18}")
        for batch, ctx in ([] if args.prefill_only else [(b, CONTEXT) for b in BATCHES] + LONG):
            fb = decode_batch(batch, ctx, gen)
            x = torch.randn(batch, cfg.hidden_size, generator=gen, device="cuda").bfloat16()
            qkv = torch.nn.functional.linear(x, m.qkv_weight)
            gate = A.split_qkv(qkv, KV, D)[1]
            norm_args = (qkv, fb.positions, fb.slot_mapping, m.q_norm.weight, m.k_norm.weight, rotary.cos,
                         rotary.sin, m.k_cache, m.v_cache, m.eps)
            q = A.qk_norm_rope_cache_fast(*norm_args)
            attn_args = (q, m.k_cache, m.v_cache, fb.block_tables, fb.context_lens, m.scale, gate)
            dc = A.decode_config(D, batch)
            splits = A.decode_splits(batch, KV, fb.block_tables.shape[1] * BLOCK, q.device, dc["tile"], dc["per_sm"])
            kv_bytes = 2 * batch * ctx * KV * D * 2
            if ctx == CONTEXT:
                norm_bytes = qkv.numel() * 2 + q.numel() * 2 + 2 * batch * KV * D * 2
                row("norm_rope_cache", batch, ctx, 1, bench(lambda: A.qk_norm_rope_cache_torch(*norm_args)),
                    bench(lambda: A.qk_norm_rope_cache_fast(*norm_args)), nbytes=norm_bytes)
            row("decode_attn", batch, ctx, splits, bench(lambda: A.paged_decode_attention_torch(*attn_args)),
                bench(lambda: A.paged_decode_attention_fast(*attn_args)),
                bench(lambda: A.paged_decode_launch(*attn_args, 1)), nbytes=kv_bytes)
            if ctx == CONTEXT:
                row("layer", batch, ctx, splits, bench(lambda: layers["torch"](x, fb)),
                    bench(lambda: layers["fast"](x, fb)))
    if args.out:
        with open(args.out, "w") as f:
            json.dump({"device": torch.cuda.get_device_name(), "tp": args.tp, "rows": rows, "prefill": prefill_rows,
                       "config": dict(decode=[A.decode_config(D, b) for b in BATCHES],
                                      min_tiles=A.MIN_TILES_PER_SPLIT,
                                      max_splits=A.MAX_SPLITS, prefill=A.PREFILL_CONFIG)}, f, indent=1)


def prefill(layers: dict, cfg, gen: torch.Generator, n_layers: int, sweep: bool) -> list[dict]:
    m = layers["fast"]
    H, KV, D = m.num_heads, m.num_kv_heads, m.head_dim
    print(f"{'op':<15}{'step':>18}{'tokens':>8}{'torch ms':>10}{'fast ms':>9}{'x':>7}{'TFLOP/s':>9}"
          f"{'fast ms x layers':>18}")
    rows = []
    for label, lens, starts in PREFILL:
        fb = prefill_batch(lens, starts, gen)
        T = sum(lens)
        x = torch.randn(T, cfg.hidden_size, generator=gen, device="cuda").bfloat16()
        qkv = torch.nn.functional.linear(x, m.qkv_weight)
        gate = A.split_qkv(qkv, KV, D)[1]
        q = A.qk_norm_rope_cache_fast(qkv, fb.positions, fb.slot_mapping, m.q_norm.weight, m.k_norm.weight,
                                      m.rotary.cos, m.rotary.sin, m.k_cache, m.v_cache, m.eps)
        layers["torch"].k_cache, layers["torch"].v_cache = m.k_cache, m.v_cache
        args = (q, m.k_cache, m.v_cache, fb, m.scale, gate)
        flops = causal_flops(lens, starts, H, D)
        for op, t_torch, t_fast in (
                ("prefill_attn", bench_eager(lambda: A.paged_prefill_attention_torch(*args)),
                 bench_eager(lambda: A.paged_prefill_attention_fast(*args))),
                ("prefill_layer", bench_eager(lambda: layers["torch"](x, fb)), bench_eager(lambda: m(x, fb)))):
            tflops = flops / t_fast / 1e9 if op == "prefill_attn" else None
            print(f"{op:<15}{label:>18}{T:>8}{t_torch:>10.3f}{t_fast:>9.3f}{t_torch / t_fast:>7.1f}"
                  f"{'-' if tflops is None else f'{tflops:.0f}':>9}{t_fast * n_layers:>18.2f}")
            rows.append(dict(op=op, step=label, tokens=T, torch_ms=t_torch, fast_ms=t_fast,
                             torch_tflop_s=flops / t_torch / 1e9 if op == "prefill_attn" else None,
                             fast_tflop_s=tflops, layers_ms=t_fast * n_layers))
        if sweep:
            sweep_prefill(lambda: A.paged_prefill_attention_fast(*args), label, D)
    return rows


if __name__ == "__main__":
    main()
